"""The engine under the public modules: device, tensor, IR, lowering, graph executor, runtime, metrics."""
