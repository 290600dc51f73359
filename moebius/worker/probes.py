"""A benchmark's hook into the ranks, off the serving path: decode and prefill steps timed through the real runner
(`link.messages.DecodeProbe`, `PrefillProbe`), with made-up requests whose KV pages hold whatever is there."""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from moebius.link.messages import DecodeProbe, PrefillProbe, split_evenly
from moebius.link.request import Request, RequestSpec
from moebius.parallel.groups import Groups, all_gather_ints
from moebius.sampling_params import SamplingParams
from moebius.worker.runner import PendingStep, StepSync
from moebius.worker.scheduler import ScheduledChunk

if TYPE_CHECKING:
    from moebius.worker.rank import Rank


def run(rank: Rank, probe: DecodeProbe | PrefillProbe) -> dict[str, Any]:
    """This rank's timings of `probe` (an answer with "error" where it cannot run: a rank that raised would take the
    engine down)."""
    if isinstance(probe, DecodeProbe):
        return bench_decode(rank, probe.batch, probe.context, probe.steps, probe.warmup, probe.graphs)
    return bench_prefill(rank, probe.tokens, probe.context, probe.steps, probe.warmup, probe.graphs, probe.sequences,
                         probe.decodes, probe.decode_context, probe.idle_s)


def _decoding(rank: Rank, n: int, context: int) -> list[ScheduledChunk]:
    """n requests each decoding one token after `context` cached ones (their pages allocated; the KV holds whatever
    is there), with distinct tokens per request, so the batch routes like real traffic (not all to one expert)."""
    params, V, r = SamplingParams(temperature=0.0, max_tokens=1), rank.cfg.vocab_size, rank.groups.rank
    chunks = []
    for i in range(n):
        ids = [(r * 7919 + i * 104729 + j * 31) % V for j in range(context + 1)]
        req = Request(RequestSpec(f"bench{i}", ids, params, i, context + 2))
        req.set_tables(rank.kv_pages.take(context, context + 1))
        req.num_computed = context
        chunks.append(ScheduledChunk(req, context, 1))
    return chunks


def _pages(counts: list[int]) -> str:
    """Page counts of the KV groups: one number where there is one group."""
    return str(counts[0]) if len(counts) == 1 else "/".join(map(str, counts)) + " (a KV group each)"


NOT_HERE = "fits this rank, not another"  # (each rank answers for itself: the one that lacks room says why)


def fits_every_rank(ok: bool, groups: Groups) -> bool:
    """Whether a probe fits every rank (a collective where there are several)."""
    return groups.world_size == 1 or all(v for (v,) in all_gather_ints([int(ok)], groups))


def bench_decode(rank: Rank, batch: int, context: int, steps: int, warmup: int, graphs: bool) -> dict[str, Any]:
    """Time steady-state decode steps of `batch` requests (global) with `context` cached tokens each, through
    the real runner (graph or eager) but without prefill: the requests' KV pages hold whatever is there."""
    if steps < 1 or warmup < 0:  # an answer, not an exception: a rank that raised would take the engine down
        return {"error": f"bench_decode needs steps >= 1 and warmup >= 0, got {steps} and {warmup}"}
    lay, alloc, groups = rank.layout, rank.kv_pages, rank.groups
    local = lay.local_batch(batch)
    ecfg = rank.spec.engine
    need = [local * n for n in alloc.need(alloc.empty(), context, context + 1)]
    why = []
    if not alloc.fits(need):
        why.append(f"needs {_pages(need)} KV pages, {_pages([a.num_free for a in alloc.groups])} free")
    if local > ecfg.max_num_batched_tokens:
        why.append(f"{local} requests a step, past the token budget of {ecfg.max_num_batched_tokens}")
    if not fits_every_rank(not why, groups) or why:
        return {"error": "; ".join(why) or NOT_HERE}
    chunks = _decoding(rank, local, context)
    sync = StepSync(lay.step_tokens(batch), True)
    runner = rank.runner
    used_graph = graphs and runner.has_graph(sync.max_tokens)
    times, meta = [], []
    try:
        for _ in range(warmup + steps):
            if rank.device.type == "cuda":
                torch.cuda.synchronize(rank.device)
            t = time.perf_counter()
            runner.launch(chunks, [], sync, graphs=graphs).result()  # tokens on the host: a whole step
            times.append(time.perf_counter() - t)
            meta.append(runner.last_metadata_s)
        # overlap needs an asynchronous device: on the CPU a launch computes the step, so there is nothing to hide
        overlapped = (_time_overlapped(rank, chunks, sync, steps, warmup, graphs) if rank.device.type == "cuda"
                      else statistics.median(times[warmup:]) * 1e3)
        replay_ms = runner.time_replay(sync.max_tokens, steps) if used_graph else None
    finally:
        for c in chunks:
            alloc.free(c.req.tables)
    sync_ms = statistics.median(times[warmup:]) * 1e3
    return {"step_ms": overlapped if rank.overlap else sync_ms, "step_ms_overlap": overlapped,
            "step_ms_no_overlap": sync_ms, "local_batch": local, "cuda_graph": used_graph,
            "replay_ms": replay_ms, "metadata_ms": statistics.median(meta[warmup:]) * 1e3}


def bench_prefill(rank: Rank, tokens: int, context: int, steps: int, warmup: int, graphs: bool = True,
                  sequences: int = 1, decodes: int = 0, decode_context: int = 0, idle_s: float = 0.0
                  ) -> dict[str, Any]:
    """Time a prefill step: on every rank prompt chunks of `tokens` tokens in all, split evenly over `sequences`
    prompts (many short prompts: a burst's step), each after `context` cached tokens (the KV pages hold whatever is
    there), each prompt's last token sampled, through the real runner as the engine runs prefill (graph pieces up to
    --cuda-graph-max-tokens, else eager; graphs=False: eager; tokens read back). decodes: that many running
    requests first in the step, each decoding one token after `decode_context` cached ones (a mixed step: a prompt
    arriving while others decode). idle_s: the device idles that long before each step, a lone prompt's step
    (back to back, long steps hold an H200 at its power cap, its clocks lowered:
    docs/performance.md, "Prefill steps and TTFT")."""
    if (steps < 1 or warmup < 0 or tokens < 1 or context < 0 or not 1 <= sequences <= tokens or decodes < 0
            or decode_context < 0 or idle_s < 0):
        return {"error": f"bench_prefill needs tokens >= 1, context >= 0, steps >= 1, warmup >= 0, 1 <= sequences "
                         f"<= tokens, decodes >= 0, decode_context >= 0 and idle_s >= 0, got {tokens}, {context}, "
                         f"{steps}, {warmup}, {sequences}, {decodes}, {decode_context} and {idle_s}"}
    alloc, groups, ecfg = rank.kv_pages, rank.groups, rank.spec.engine
    sizes = split_evenly(tokens, sequences)
    fresh = alloc.empty()
    each = [alloc.need(fresh, context, context + n) for n in sizes]
    each += [alloc.need(fresh, decode_context, decode_context + 1)] * decodes
    need = [sum(n) for n in zip(*each, strict=True)]
    ok = (alloc.fits(need) and tokens + decodes <= ecfg.max_num_batched_tokens
          and sequences + decodes <= ecfg.max_running_requests)
    if not fits_every_rank(ok, groups) or not ok:
        return {"error": NOT_HERE if ok else (
            f"needs {_pages(need)} KV pages ({_pages([a.num_free for a in alloc.groups])} free), a token budget of "
            f"{tokens + decodes} "
            f"({ecfg.max_num_batched_tokens}) and room for {sequences + decodes} requests "
            f"({ecfg.max_running_requests})")}
    V = rank.cfg.vocab_size
    chunks = _decoding(rank, decodes, decode_context)  # running requests come first in a step (the scheduler's order)
    for s, n in enumerate(sizes):
        ids = [(groups.rank * 7919 + s * 7 + j * 104729) % V for j in range(context + n)]
        req = Request(RequestSpec(f"bench-prefill-{s}", ids, SamplingParams(temperature=0.0, max_tokens=1), 0,
                                  context + n + 1))
        req.set_tables(alloc.take(context, context + n))
        req.num_computed = context
        chunks.append(ScheduledChunk(req, context, n))
    sync, times = StepSync(tokens + decodes, False), []
    try:
        for _ in range(warmup + steps):
            if rank.device.type == "cuda":
                torch.cuda.synchronize(rank.device)
            time.sleep(idle_s)
            t = time.perf_counter()
            rank.runner.launch(chunks, [], sync, graphs=graphs).result()
            times.append(time.perf_counter() - t)
    finally:
        for c in chunks:
            alloc.free(c.req.tables)
    return {"step_ms": statistics.median(times[warmup:]) * 1e3, "tokens": tokens, "context": context,
            "chunk_tokens": [c.num_tokens for c in chunks[decodes:]], "decodes": decodes,
            "pieces": graphs and rank.runner.pieces_bucket(sync.max_tokens) is not None}


def _time_overlapped(rank: Rank, chunks: list[ScheduledChunk], sync: StepSync, steps: int, warmup: int,
                     graphs: bool) -> float:
    """Steady-state ms per step as overlap scheduling runs them: each step is launched with its input tokens
    taken on the device from the step before, and only then is the step before read back."""
    rows = np.arange(len(chunks))
    prev: PendingStep | None = None
    arrived = []  # when each step's tokens reached the host
    for _ in range(max(warmup, 1) + steps):
        cur = rank.runner.launch(chunks, [], sync, prev, rows if prev is not None else None, graphs=graphs)
        if prev is not None:
            prev.result()
            arrived.append(time.perf_counter())
        prev = cur
    assert prev is not None
    prev.result()
    arrived.append(time.perf_counter())
    # between the last warm-up step's arrival and the last step's, exactly `steps` steps completed (timing from
    # a launch instead would count the step already in flight then)
    return (arrived[-1] - arrived[-1 - steps]) / steps * 1e3
