"""Benchmarks, all in this package: the decode sweep (`moebius bench sweep`), the kernel, communication and switch
benchmarks (`python -m moebius.bench.<name>`), their helpers (graph_timing, tp_rank_model, floor, hf_baseline) and
the one results schema they write (results.py). Index of tools and recorded results: benchmarks/README.md."""
