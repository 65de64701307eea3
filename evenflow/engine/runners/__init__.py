"""What runs a forward pass: the single-process model runner (KV cache, input tensors,
forward, sample) and tensor-parallel rank processes, with the typed commands a rank 0 sends
its followers (rank_wire)."""
