"""The model in PyTorch: HF checkpoint loading, MoE transformer, paged KV cache with prefix
caching, continuous-batching scheduler, sampler and the offline `LLM` API."""
