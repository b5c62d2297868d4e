"""Alias of `torch_xla.core.dynamo_bridge` (the original's module path)."""
from ..core.dynamo_bridge import *  # noqa: F401,F403
from ..core.dynamo_bridge import (CompiledGraph, GraphInputMatcher, NoneRemover,  # noqa: F401
                                  UnsupportedNodesCollector, alias_with_buffer_donor_config,
                                  extract_compiled_graph)
