"""CUDA graphs, per mode, captured once at start and kept resident: the decode step, one graph per batch bucket
(`CudaGraphs`); steps with prompt chunks (alone or beside decodes), one set of pieces per token bucket, the forward
cut at each layer's attention, which runs eagerly between the pieces (`StepPieces`).

A graph reads the mode's static buffers (unified-memory views: fixed addresses) and writes into its own outputs. A
switch never recaptures: it only changes which mode's graphs the rank replays. The runner says what a graph runs
(`ModelRunner.capture_graphs`, `capture_pieces`); these classes know only buckets and graphs.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import zip_longest

import torch

from moebius.kernels import KernelConfig

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


def _capture_buckets(buckets: list[int], inputs: Callable[[int], None], warm: Callable[[int], object],
                     capture: Callable[[int], None]) -> float:
    """For every bucket b, largest first (smaller graphs reuse its pool memory): `inputs(b)` writes its static
    inputs, `warm(b)` runs the step twice uncaptured (Triton compilation, NCCL and cuBLAS set-up stay out of the
    graphs), then `capture(b)` captures it; both on a side stream. Returns seconds."""
    t = time.perf_counter()
    stream = torch.cuda.Stream()
    for b in reversed(buckets):
        inputs(b)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                warm(b)
            stream.synchronize()
            capture(b)
        torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    return time.perf_counter() - t


class CudaGraphs:
    """The decode graphs of one mode's runner, one per batch bucket."""

    def __init__(self, buckets: list[int], pool: object) -> None:
        self.buckets = sorted(buckets)
        self.pool = pool
        self.set = GraphSet()

    def capture(self, inputs: Callable[[int], None], step: Callable[[int], tuple[torch.Tensor, torch.Tensor]]
                ) -> float:
        """Capture every bucket b: `inputs(b)` writes its static inputs, `step(b)` runs the step and returns
        (logits, greedy tokens). Returns seconds."""

        def one(b: int) -> None:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                self.set.logits[b], self.set.greedy[b] = step(b)
            self.set.graphs[b] = g

        return _capture_buckets(self.buckets, inputs, step, one)

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


def piece_buckets(cap: int) -> list[int]:
    """Token buckets of step pieces: 16 to 256 by powers of two, multiples of 128 to 1024, of 256 beyond, up to cap
    (cap last): a step pays for its padding tokens (past the smallest buckets the GPU, not the host, sets a step's
    time: docs/performance.md, prefill steps; benchmarks/results/h200-p1-prefill.json), so neighbouring buckets
    stay close in size."""
    out = [b for b in (16, 32, 64, 128, 256) if b < cap]
    b = 384
    while b < cap:
        out.append(b)
        b += 128 if b < 1024 else 256
    return out + [cap] if cap > 0 else []


@dataclass(frozen=True)
class AttentionCall:
    """One layer's attention between two pieces: its KV cache and how it was launched at capture."""

    cache: torch.Tensor
    scale: float
    kc: KernelConfig
    group: int = 0  # its KV group (`AttentionMetadata.group`)
    window: int | None = None  # a sliding-window layer's
    sinks: torch.Tensor | None = None  # learned sink logits [H] (GPT-OSS)


@dataclass
class PieceSet:
    """The captured pieces of one token bucket: graphs[i] runs up to layer i's attention (calls[i]); the last runs
    after the last layer's and writes `hidden`."""

    graphs: list[torch.cuda.CUDAGraph]
    calls: list[AttentionCall]
    hidden: torch.Tensor  # [bucket, D]: final-normed hidden states (static output)


class _Cut:
    """The `AttentionCut` a forward runs with while its pieces are warmed up (capture=False: attention skipped; the
    output buffer keeps old, finite values) or captured: each attention ends the graph being captured and begins
    the next."""

    def __init__(self, q: torch.Tensor, o: torch.Tensor, pool: object | None) -> None:
        self.q, self.o, self.pool = q, o, pool
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.calls: list[AttentionCall] = []
        if pool is not None:
            self._begin()

    def _begin(self) -> None:
        g = torch.cuda.CUDAGraph()
        self.graphs.append(g)
        g.capture_begin(self.pool)

    def end(self) -> None:
        if self.pool is not None:
            self.graphs[-1].capture_end()

    def q_buffer(self, T: int) -> torch.Tensor:
        return self.q[:T]

    def attend(self, q_THd: torch.Tensor, cache: torch.Tensor, scale: float, kc: KernelConfig, *, group: int = 0,
               window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        self.calls.append(AttentionCall(cache, scale, kc, group, window, sinks))
        if self.pool is not None:
            self.end()
            self._begin()
        return self.o[: q_THd.shape[0]]  # [T, H, o_dim]


class StepPieces:
    """Graphs of steps that hold prompt chunks, per token bucket: eager, such a step launches ~15 kernels a layer
    from Python, which at a few thousand tokens takes longer than the GPU does. The pieces replay everything but
    attention, whose launch depends on the step's sequences (host values); attention reads q from and writes its
    output to static buffers between them. Padding tokens (past the step's own) write only the reserved KV page 0."""

    def __init__(self, buckets: list[int], pool: object, heads: int, q_dim: int, o_dim: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.buckets = sorted(buckets)
        self.pool = pool
        self.q = torch.zeros(self.buckets[-1], heads, q_dim, dtype=dtype, device=device)
        # zeros: padding rows stay finite
        self.o = torch.zeros(self.buckets[-1], heads, o_dim, dtype=dtype, device=device)
        self.sets: dict[int, PieceSet] = {}

    def capture(self, inputs: Callable[[int], None], forward: Callable[[int, _Cut], torch.Tensor]) -> float:
        """Capture every bucket b: `inputs(b)` writes its static inputs, `forward(b, cut)` runs the step with `cut`
        as its metadata's AttentionCut and returns the final hidden states. Returns seconds."""

        def one(b: int) -> None:  # on the side stream: a capture must not run on the default stream
            cut = _Cut(self.q, self.o, self.pool)
            hidden = forward(b, cut)
            cut.end()
            self.sets[b] = PieceSet(cut.graphs, cut.calls, hidden)

        return _capture_buckets(self.buckets, inputs, lambda b: forward(b, _Cut(self.q, self.o, None)), one)

    def bucket_for(self, n: int) -> int | None:
        i = bisect.bisect_left(self.buckets, max(n, 1))
        return self.buckets[i] if i < len(self.buckets) else None

    def replay(self, b: int, T: int, attend: Callable[[AttentionCall, torch.Tensor, torch.Tensor], object]
               ) -> torch.Tensor:
        """Run a step of T tokens (T <= b) on bucket b's pieces: `attend(call, q, out)` runs each layer's attention
        on the step's own tokens between them. Returns the final hidden states of the bucket's rows."""
        s = self.sets[b]
        for g, call in zip_longest(s.graphs, s.calls):
            g.replay()
            if call is not None:
                attend(call, self.q[:T], self.o[:T])
        return s.hidden

    def destroy(self) -> None:
        for s in self.sets.values():
            for g in s.graphs:
                g.reset()
        self.sets = {}
