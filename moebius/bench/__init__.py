"""Benchmarks: decode sweep (TP vs EP against the floor), with JSON results and PNG plots."""
