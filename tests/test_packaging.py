"""The package's metadata: the accelerator extras name jax's PJRT plugins over the jax
range the package declares, the declared ranges hold what is installed here, and the
README documents each extra and the declared ranges."""
from __future__ import annotations

import importlib.metadata
import pathlib
import platform
import re
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
README = (ROOT / "README.md").read_text()

# extra -> (jax's extra it goes through, the plugin packages it must name)
ACCELERATORS = {
    "cuda": ("cuda12", {"jax-cuda12-plugin", "jax-cuda12-pjrt"}),
    "cuda12": ("cuda12", {"jax-cuda12-plugin", "jax-cuda12-pjrt"}),
    "cuda13": ("cuda13", {"jax-cuda13-plugin", "jax-cuda13-pjrt"}),
    "tpu": ("tpu", {"libtpu"}),
}


def _deps(reqs) -> dict:
    return {Requirement(r).name: Requirement(r) for r in reqs}


DEPS = _deps(PROJECT["dependencies"])
DEPS_TEXT = {Requirement(r).name: r for r in PROJECT["dependencies"]}
EXTRAS = PROJECT["optional-dependencies"]


def _section(title: str) -> str:
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", README, re.S | re.M)
    assert m, f"README.md has no section {title!r}"
    return m.group(1)


@pytest.mark.parametrize("extra", sorted(ACCELERATORS))
def test_accelerator_extra_names_jax_plugins(extra):
    jax_extra, plugins = ACCELERATORS[extra]
    reqs = _deps(EXTRAS[extra])
    # jax's own extra keeps the plugin at exactly the installed jaxlib's version
    assert jax_extra in reqs["jax"].extras
    assert reqs["jax"].specifier == DEPS["jax"].specifier
    assert plugins <= set(reqs)
    for name in plugins - {"libtpu"}:
        assert reqs[name].specifier == DEPS["jaxlib"].specifier, name


def test_jax_and_jaxlib_ranges_agree():
    assert DEPS["jax"].specifier == DEPS["jaxlib"].specifier


def test_declared_ranges_hold_this_environment():
    assert SpecifierSet(PROJECT["requires-python"]).contains(platform.python_version())
    for name in ("torch", "jax", "jaxlib"):
        installed = Version(importlib.metadata.version(name))
        assert DEPS[name].specifier.contains(installed, prereleases=True), (name, installed)


def test_requires_python_within_what_jax_supports():
    """No Python is declared that the installed jax refuses."""
    ours = SpecifierSet(PROJECT["requires-python"])
    jax_python = SpecifierSet(importlib.metadata.metadata("jax")["Requires-Python"] or "")
    for minor in range(8, 20):
        v = f"3.{minor}.0"
        if ours.contains(v):
            assert jax_python.contains(v), v


def test_readme_documents_each_extra():
    text = _section("Installing for an accelerator")
    assert README.index("## Installing by hand") < README.index("## Installing for an accelerator")
    for extra in EXTRAS:
        if extra != "test":
            assert f"torch-xla-jax[{extra}]" in text, extra
    for plugin in set().union(*(p for _, p in ACCELERATORS.values())):
        assert plugin in text, plugin
    for device in ("CUDA", "TPU"):
        assert f"PJRT_DEVICE={device}" in text, device
    # the declared ranges, as pyproject.toml writes them, beside what is tested
    assert f"`{PROJECT['requires-python']}`" in text
    for name in ("torch", "jax", "jaxlib"):
        assert f"`{DEPS_TEXT[name]}`" in text, name
    assert "tested" in text
