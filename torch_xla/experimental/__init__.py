"""Experimental features: eager mode."""
from .eager import eager_mode, is_eager_mode  # noqa: F401
