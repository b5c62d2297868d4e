"""Getting at jax (and torchax) from code that calls jax functions on xla tensors.

jax is this package's runtime: importing it is safe once the runtime has started, which
`jax_import_guard` makes sure of (jax must start through the engine, which chooses its
platform and options before `import jax`).
"""
from __future__ import annotations

import contextlib
import functools
import logging
from typing import Any, Callable, Iterator, Optional


def jax_import_guard() -> None:
    """Starts the runtime (jax and its PJRT client) if it has not started yet."""
    import torch_xla
    torch_xla._XLAC._init_computation_client()


def requires_jax(func: Callable) -> Callable:
    """Decorator: `func` runs once the runtime (and so jax) has started."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs) -> Any:
        try:
            jax_import_guard()
        except ImportError as e:
            raise ImportError(f"{func.__qualname__} needs jax, whose runtime could not start: {e}") from e
        with jax_env_context():
            return func(*args, **kwargs)

    return wrapper


@contextlib.contextmanager
def jax_env_context() -> Iterator[None]:
    """The environment jax code runs in. The original keeps a second PJRT client (jax's
    multi-slice one) from starting here; jax is the only client of this package, so
    there is nothing to change."""
    yield


def maybe_get_torchax():
    """The `torchax` module (with its tensor, interop and dtype-mapping modules loaded), or
    None when it is not installed."""
    try:
        jax_import_guard()
        with jax_env_context():
            import torchax
            import torchax.interop  # noqa: F401
            import torchax.ops.mappings  # noqa: F401
            import torchax.tensor  # noqa: F401
            return torchax
    except ImportError:
        return None


def maybe_get_jax(log: bool = True) -> Optional[Any]:
    """The `jax` module, started by the runtime; None (with a warning if `log`) when jax
    cannot be imported."""
    try:
        jax_import_guard()
        with jax_env_context():
            import jax
            return jax
    except ImportError:
        if log:
            logging.warning("this feature needs jax, which cannot be imported: reinstall torch-xla-jax "
                            "with its dependencies")
        return None
