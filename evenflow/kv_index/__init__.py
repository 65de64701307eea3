"""Global KV-block index: KV events in over NATS -> Redis (service.py), the Redis layout and its
Lua scripts (store.py), and the gateway's read side: one-round-trip prefix match plus
predictions (client.py). `python -m evenflow.kv_index ID`."""
