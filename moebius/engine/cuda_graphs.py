"""CUDA graphs of the decode step, one per batch bucket, per mode; captured once at start and kept resident.

A graph reads the mode's static buffers (unified-memory views: fixed addresses) and writes logits into its own
output. A switch never recaptures: it only changes which mode's graphs the rank replays. The runner says what a
graph runs (`ModelRunner.capture_graphs`); this class knows only buckets and graphs.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

log = logging.getLogger("moebius")


def default_buckets(cap: int) -> list[int]:
    """1, 2, 4, then multiples of 8 up to 64, of 32 up to 256, of 256 beyond, up to cap."""
    out = [b for b in (1, 2, 4) if b <= cap]
    b = 8
    while b <= cap:
        out.append(b)
        b += 8 if b < 64 else 32 if b < 256 else 256
    if out[-1] != cap:
        out.append(cap)
    return out


@dataclass
class GraphSet:
    """The captured graphs of one mode and their static outputs."""

    graphs: dict[int, torch.cuda.CUDAGraph] = field(default_factory=dict)
    logits: dict[int, torch.Tensor] = field(default_factory=dict)  # [bucket, V] (TP: the rank's vocab slice)
    greedy: dict[int, torch.Tensor] = field(default_factory=dict)  # [bucket] int64: argmax over the whole vocab


class CudaGraphs:
    """The decode graphs of one mode's runner, one per batch bucket."""

    def __init__(self, buckets: list[int], pool: object) -> None:
        self.buckets = sorted(buckets)
        self.pool = pool
        self.set = GraphSet()

    def capture(self, inputs: Callable[[int], None], step: Callable[[int], tuple[torch.Tensor, torch.Tensor]]
                ) -> float:
        """Capture every bucket b (largest first, so smaller graphs reuse its pool memory): `inputs(b)` writes its
        static inputs, `step(b)` runs the step and returns (logits, greedy tokens). Returns seconds."""
        t = time.perf_counter()
        stream = torch.cuda.Stream()
        for b in reversed(self.buckets):
            inputs(b)
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up: Triton compilation, NCCL and cuBLAS set-up stay out of the graph
                    step(b)
            torch.cuda.current_stream().wait_stream(stream)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                self.set.logits[b], self.set.greedy[b] = step(b)
            self.set.graphs[b] = g
        torch.cuda.synchronize()
        return time.perf_counter() - t

    def bucket_for(self, n: int) -> int | None:
        i = bisect.bisect_left(self.buckets, max(n, 1))
        return self.buckets[i] if i < len(self.buckets) else None

    def replay(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, greedy tokens) of the bucket's rows, in the graph's static outputs."""
        self.set.graphs[b].replay()
        return self.set.logits[b], self.set.greedy[b]

    def destroy(self) -> None:
        for g in self.set.graphs.values():
            g.reset()
        self.set = GraphSet()
