"""Benchmarks behind `evenflow bench ...`."""
