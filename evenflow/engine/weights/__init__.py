"""Weights from disk into a model: safetensors reads, HF tensor names, loading (with
quantization, tensor-parallel shards and GPTQ checkpoints), prepacking for the kernels, and
the expert store that reads the experts a new placement needs."""
