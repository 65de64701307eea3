"""EPLB: the pure placement algorithm (eplb.py), when to rebalance (policy.py), and the
balancer actor that aggregates expert load and pushes versioned placements (service.py)."""
