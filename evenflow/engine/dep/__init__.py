"""Expert parallelism with data-parallel attention (DEP): several whole engines (each its own
scheduler and KV cache) stepping in lockstep, their MoE layers exchanging tokens. It sits
above serving/ because each rank is an Engine."""
