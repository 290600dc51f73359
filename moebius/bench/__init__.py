"""The `moebius bench` commands (sweep, throughput, rollout, bursty, simulate, serve), what they share (workload,
serve_stats, floor, hf_baseline), the one results schema every benchmark writes (results.py), the CUDA-graph timer
the one-off tools share (graph_timing) and kernels compiled for Hopper without a GPU (sm90: a tool's and the
tests'). The tools themselves (kernel tuners, A/Bs, profiles, switch and communication benchmarks) are scripts under
benchmarks/<sub>/. Index of tools and recorded results: benchmarks/README.md."""
