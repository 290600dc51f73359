"""Timing GPU work as the engine runs it: inside a CUDA graph, so launch gaps count as they do in a replayed step
(`graph_time_us`), or as eager launches (`event_time_ms`, for work too long for launch gaps to matter).

Helpers the tools under benchmarks/ share (`from moebius.bench.graph_timing import graph_time_us`), not run by
itself."""

from __future__ import annotations

from collections.abc import Callable

import torch


def graph_time_us(fn: Callable[[], object], reps: int = 20, barrier: Callable[[], None] | None = None) -> float:
    """Best per-call time (µs) of `fn` over five replays of a graph holding `reps` calls. `barrier` (multi-rank
    runs) lines the ranks up before each replay."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up outside the graph: compilation, communicator set-up
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        if barrier is not None:
            barrier()
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / reps)
    g.reset()
    return best


def event_time_ms(fn: Callable[[], object], reps: int = 10) -> float:
    """Median time (ms) of one eager call of `fn` between CUDA events, after one untimed call (compilation)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]
