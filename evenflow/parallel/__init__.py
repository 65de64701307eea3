"""Process groups and collectives for ranks of one model: shared memory on one host (shm.py),
gloo across hosts (gloo.py), and both together (hierarchical.py). Pure communication: the engine
calls it; it never touches NATS or Redis."""
