"""Helpers the original's tests and tools import from `torch_xla._internal`."""
