"""Benchmarks of expert placement and expert parallelism: EPLB, DEP ranks, their simulation, and
the collectives under them."""
