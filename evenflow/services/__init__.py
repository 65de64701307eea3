"""Shared runtime of the mesh services: config (the only reader of EVENFLOW_*), the NATS bus and
its in-memory twin for tests, the engine interface and engine thread, Redis connections,
tracing, metrics, the worker lifecycle and the local launcher (`evenflow up`)."""
