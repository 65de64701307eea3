"""EPLB: pure rebalance algorithm + actor that aggregates expert load and pushes placements.

Not built yet: this package is reserved by the layout in DESIGN.md."""
