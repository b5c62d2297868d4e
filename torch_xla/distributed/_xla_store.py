"""A torch.distributed Store on the job's coordination service (jax's key-value store).

The `xla://` init method hands this store to torch.distributed, so a multi-process job
needs no port besides the coordinator's. The service's client raises jax's
`JaxRuntimeError` whose text starts with a status code; `store_error` turns it into the
torch.distributed error of that cause (a timeout, an unreachable service, anything else),
keeping the service's own message.
"""
from __future__ import annotations

import datetime
from typing import Optional

import torch.distributed as dist

from .._engine import job as _job

__all__ = ["XlaKVStore", "service_error", "status_code", "store_error"]


service_error = _job.service_error
status_code = _job.status_code
_first_line = _job.first_line


def store_error(what: str, err: BaseException, timeout_ms: Optional[int] = None) -> dist.DistError:
    """The torch.distributed error for a failed coordination service call `what`.

    DEADLINE_EXCEEDED is a timeout (DistStoreError, as PyTorch's stores raise), UNAVAILABLE
    an unreachable service (DistNetworkError); other codes a DistStoreError naming them.
    """
    code = status_code(err)
    if code == "DEADLINE_EXCEEDED":
        after = f" after {timeout_ms / 1000:g} s" if timeout_ms is not None else ""
        return dist.DistStoreError(f"{what} timed out{after} ({_first_line(err)})")
    if code == "UNAVAILABLE":
        return dist.DistNetworkError(f"{what} failed: the coordination service is unreachable "
                                     f"(has the coordinator, replica 0, exited?): {_first_line(err)}")
    return dist.DistStoreError(f"{what} failed: {_first_line(err)}")


class XlaKVStore(dist.Store):
    """torch.distributed.Store over jax's coordination-service key-value store."""

    _PREFIX = "torch_xla/store/"

    def __init__(self, timeout: Optional[datetime.timedelta] = None):
        super().__init__()
        self._client = _job.kv_client()
        self._timeout = timeout or datetime.timedelta(seconds=_job.collective_timeout_s())

    def _k(self, key: str) -> str:
        return self._PREFIX + key

    def _ms(self, timeout=None) -> int:
        t = timeout if timeout is not None else self._timeout
        if isinstance(t, datetime.timedelta):
            t = t.total_seconds()
        return max(int(t * 1000), 1)

    @staticmethod
    def _bytes(value) -> bytes:
        if isinstance(value, str):
            return value.encode()
        return bytes(value)

    def _try_get(self, key: str, what: str) -> Optional[bytes]:
        """The value of `key`, or None when it is not set (`what`: the call, for errors)."""
        try:
            return self._client.key_value_try_get_bytes(self._k(key))
        except service_error() as e:
            if status_code(e) == "NOT_FOUND":
                return None
            raise store_error(f"XlaKVStore.{what}({key!r})", e) from e

    def set(self, key, value):
        try:
            self._client.key_value_set_bytes(self._k(key), self._bytes(value), allow_overwrite=True)
        except service_error() as e:
            raise store_error(f"XlaKVStore.set({key!r})", e) from e

    def get(self, key):
        ms = self._ms()
        try:
            return self._client.blocking_key_value_get_bytes(self._k(key), ms)
        except service_error() as e:
            raise store_error(f"XlaKVStore.get({key!r})", e, ms) from e

    def add(self, key, amount):
        try:
            return int(self._client.key_value_increment(self._k(key), int(amount)))
        except service_error() as e:
            raise store_error(f"XlaKVStore.add({key!r})", e) from e

    def check(self, keys):
        return all(self._try_get(k, "check") is not None for k in keys)

    def wait(self, keys, timeout=None):
        ms = self._ms(timeout)
        for k in keys:
            try:
                self._client.blocking_key_value_get_bytes(self._k(k), ms)
            except service_error() as e:
                raise store_error(f"XlaKVStore.wait({k!r})", e, ms) from e

    def delete_key(self, key):
        # The service deletes a missing key without complaint: whether there was one is
        # asked first (PyTorch's stores return it).
        existed = self._try_get(key, "delete_key") is not None
        try:
            self._client.key_value_delete(self._k(key))
        except service_error() as e:
            raise store_error(f"XlaKVStore.delete_key({key!r})", e) from e
        return existed

    def compare_set(self, key, expected, desired):
        # Not atomic across processes (the coordination service has no compare-and-swap).
        cur = self._try_get(key, "compare_set")
        expected = self._bytes(expected)
        if (cur is None and expected == b"") or cur == expected:
            self.set(key, desired)
            return self._bytes(desired)
        return cur if cur is not None else expected

    def set_timeout(self, timeout):
        self._timeout = timeout

    @property
    def timeout(self):
        return self._timeout
