"""Experimental features: eager mode."""
from .eager import eager_mode, eager_mode_context, is_eager_mode  # noqa: F401
