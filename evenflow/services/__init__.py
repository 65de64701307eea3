"""Shared runtime of the mesh services (config, NATS bus, Redis, tracing, metrics, lifecycle,
local launcher). Filled in by the mesh issue; nothing here yet."""
