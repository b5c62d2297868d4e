"""The engine under the public modules (docs/ARCHITECTURE.md): kernels, executor, lowering,
runtime, platform policies, and the state they share (IR, tensors, modes, config)."""
