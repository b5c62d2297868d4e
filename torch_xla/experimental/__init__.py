"""Experimental features: eager mode, ready callbacks, deprecation helpers."""
from .eager import eager_mode, eager_mode_context, is_eager_mode  # noqa: F401
