"""`torch_xla._dynamo`: the TorchDynamo bridge under the names the original gives it
(`dynamo_bridge`, `config`, `dynamo_backend2`; the latter two modules load on import)."""
from . import config  # noqa: F401
