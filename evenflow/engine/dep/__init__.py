"""Expert parallelism with data-parallel attention (DEP): several whole engines (each its own
scheduler and KV cache) stepping in lockstep, their MoE layers exchanging tokens. It sits
above engine.py because each rank is an Engine."""
