"""`torch_xla._dynamo`: the TorchDynamo bridge under the name the original gives it."""
from . import config, dynamo_backend2, dynamo_bridge  # noqa: F401
