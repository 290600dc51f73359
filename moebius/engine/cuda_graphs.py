"""CUDA graphs of the decode step, one per batch bucket, per mode; captured once at start and kept resident.

A graph reads the mode's static buffers (unified-memory views: fixed addresses) and writes logits into its own
output. A switch never recaptures: it only changes which mode's graphs the runner replays.
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from moebius.engine.runner import ModelRunner

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
    def __init__(self, runner: ModelRunner, buckets: list[int], pool: object) -> None:
        self.runner = runner
        self.buckets = sorted(buckets)
        self.pool = pool
        self.set = GraphSet()

    def capture(self) -> float:
        """Capture every bucket (largest first, so smaller graphs reuse its pool memory). Returns seconds."""
        t = time.perf_counter()
        comm = self.runner.comm
        stream = torch.cuda.Stream()
        for b in reversed(self.buckets):
            ids, meta = self.runner.decode_metadata(b)
            ids.zero_()
            meta.positions.zero_()
            meta.slot_mapping.zero_()  # page 0 is reserved: padding reads and writes land there
            meta.seq_lens.fill_(1)
            meta.block_tables.zero_()
            meta.query_start_loc.copy_(torch.arange(b + 1, device=ids.device))
            if hasattr(comm, "capacity"):
                comm.capacity = b
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up: Triton compilation, NCCL and cuBLAS set-up stay out of the graph
                    comm.vocab_argmax(self.runner.forward_logits(ids, meta))
            torch.cuda.current_stream().wait_stream(stream)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                self.set.logits[b] = self.runner.forward_logits(ids, meta)
                self.set.greedy[b] = comm.vocab_argmax(self.set.logits[b])
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
