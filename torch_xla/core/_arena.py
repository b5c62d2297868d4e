"""`xm.ToXlaTensorArena`: converts every selected tensor of a nested structure in one call."""
from __future__ import annotations

from typing import Any, Callable, List


class ToXlaTensorArena:
    """`transform(inputs)`: a copy of `inputs` (dicts, lists, tuples, namedtuples, sets)
    where the values for which `select_fn(v)` is true are replaced by the results of a
    single `convert_fn(list_of_those_values)` call (same order)."""

    def __init__(self, convert_fn: Callable[[List[Any]], List[Any]], select_fn: Callable[[Any], bool]):
        self._convert_fn = convert_fn
        self._select_fn = select_fn

    def _walk(self, x, fn):
        if self._select_fn(x):
            return fn(x)
        if isinstance(x, dict):
            return type(x)((self._walk(k, fn), self._walk(v, fn)) for k, v in x.items())
        if isinstance(x, tuple) and hasattr(x, "_fields"):
            return type(x)(*(self._walk(v, fn) for v in x))
        if isinstance(x, (list, tuple, set)):
            return type(x)(self._walk(v, fn) for v in x)
        return x

    def transform(self, inputs: Any) -> Any:
        found: List[Any] = []
        self._walk(inputs, lambda v: found.append(v) or v)
        if not found:
            return inputs
        converted = iter(self._convert_fn(found))
        return self._walk(inputs, lambda _v: next(converted))
