"""The engine proper: `Engine` (engine.py: add / abort / step, KV export and import, KV events)
and the parts it is built from: expert placement (placement_control.py), KV pulls
(prefix_transfer.py) and operator profiles (profiling.py)."""
