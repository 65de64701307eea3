"""Developer tools: simulated hosts (hosts.py)."""
