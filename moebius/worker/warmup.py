"""Start-up warm-up: before serving, one step of every shape class the engine launches outside its decode graphs,
in both layouts, so that Triton compiles each kernel variant then (or loads it from its on-disk cache,
`TRITON_CACHE_DIR`, by default ~/.triton/cache) and not under the first requests. Each step runs the path a served
step of its shape runs (the step pieces of its token bucket where it has one, their attention launched as the
pieces' capture set it up; else eagerly). A kernel variant is picked by a step's token count: power-of-two blocks,
ranges at least twice as wide (the MoE tile configs by pairs per expert, the few-row projections, a bucket's release
order), and Triton's own specialization of integer arguments (1, multiples of 16); by whether the step decodes only,
prefills, or samples; and, where a step's decodes attend in a launch of their own (`--mixed-attention apart`), by
how many decodes it holds (its KV splits). The last steps take their decodes' input tokens from the step before,
still on the device, as served steps do under overlap scheduling (the index copy that fills them, a torch kernel,
held the first request after start-up on its first use in the process: docs/performance-history.md, the first
request's extra time). The steps read and write only the reserved KV page 0, as graph capture's warm-up does, so
they need no switch and leave no trace."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from tqdm import tqdm

from moebius.kernels import FRESH_CHUNK_MIN_TOKENS
from moebius.link.request import Request, RequestSpec
from moebius.sampling_params import SamplingParams
from moebius.worker.runner import ModelRunner, PendingStep, StepSync
from moebius.worker.scheduler import ScheduledChunk

if TYPE_CHECKING:
    from moebius.worker.rank import Rank

# how a step's rows sample: greedy (the logits' argmax), temperature alone (scores raced per vocabulary id, the
# default sampling parameters' path) and top-k / top-p (the whole vocabulary gathered, ModelRunner._sample)
SAMPLING = {"greedy": SamplingParams(temperature=0.0, max_tokens=1), "temperature": SamplingParams(max_tokens=1),
            "top-k/p": SamplingParams(temperature=0.8, top_p=0.9, top_k=20, max_tokens=1)}


@dataclass(frozen=True)
class WarmupStep:
    """One step: (start, tokens) per sequence (start: tokens already cached); its rows sample (else greedy)."""

    chunks: tuple[tuple[int, int], ...]
    sampling: str = "greedy"  # a key of SAMPLING
    # its decodes' input tokens are the step before's sampled tokens, still on the device, as in every served step
    # after a request's first (overlap scheduling): their index copy's first use in a process would otherwise
    # fall under the engine's first request (module docstring)
    follows: bool = False

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.chunks)

    @property
    def sampled(self) -> bool:
        return self.sampling != "greedy"

    @property
    def decode_only(self) -> bool:
        return all(n == 1 and s > 0 for s, n in self.chunks)


def token_ladder(budget: int) -> list[int]:
    """1, 2, 3, every power of two and the count one past it, the budget itself and the multiple of 16 at or below it:
    a count in every power-of-two bucket, on both sides of Triton's divisible-by-16 specialization (the last bucket
    too, where the budget cuts it short)."""
    counts = {1, 2, 3, budget, budget - budget % 16}
    p = 1
    while p <= budget:
        counts |= {p, p + 1}
        p *= 2
    return sorted(c for c in counts if 1 <= c <= budget)


def fresh_chunk_lengths(budget: int, max_len: int) -> frozenset[int]:
    """The whole-prompt lengths the warm-up runs from FRESH_CHUNK_MIN_TOKENS: the chunk lengths at which cuDNN's
    attention may serve a fresh prompt (its graph for the length is built here, not under a request)."""
    return frozenset(T for T in token_ladder(min(budget, max_len - 1)) if T >= FRESH_CHUNK_MIN_TOKENS)


# decodes beside a chunk where they attend apart: a count in each class of KV splits
# (`layers.attention.num_splits_for`: by decodes x KV heads, up to 32 pairs for a rank of one KV head)
APART_DECODES = (1, 2, 4, 8, 16, 32)


def warmup_steps(budget: int, max_running: int, max_len: int, page: int, graphed: set[int],
                 apart_release: Callable[[int], int] | None = None) -> list[WarmupStep]:
    """The steps for one layout: per ladder count T, a whole prompt of T tokens; a chunk after a cached page with up
    to T/2 decodes beside it (a mixed step); T decodes where no graph holds a batch of T; then a step in each
    sampling path but greedy; last, decodes whose input tokens come from the step before (alone, and beside a
    chunk). `graphed`: the decode batches the layout's graphs replay.
    apart_release (where decodes attend apart): the release order of a step of T tokens. Their launch's variant
    follows only their count's KV splits and that order, so each of APART_DECODES beside a chunk once per order,
    at the first power of two T from 16 with room for it."""
    steps, apart_done = [], set()
    for T in token_ladder(min(budget, max_len - 1)):
        steps.append(WarmupStep(((0, T),)))
        start = page if page + T < max_len else 0
        d = min(T // 2, max_running - 1, T - 2)  # the chunk keeps 2+ tokens: a prefill, not one more decode
        few = []
        if apart_release is not None and T >= 16 and T & (T - 1) == 0:
            order = apart_release(T)
            few = [n for n in APART_DECODES if n < d and (order, n) not in apart_done]
            apart_done |= {(order, n) for n in [*few, d]}  # (its T/2 step covers its own count)
        for n in few + ([d] if d else []):
            steps.append(WarmupStep(((page, 1),) * n + ((start, T - n),)))
        if T <= max_running and T not in graphed:
            steps.append(WarmupStep(((page, 1),) * T))
    for how in [h for h in SAMPLING if h != "greedy"]:  # a list: every rank takes them in the same order
        steps.append(WarmupStep(((0, 2), (page, 1))[:max_running], sampling=how))  # no more sequences than may run
    # decodes fed by the step before: in a decode step (a graph's, where one holds a batch of 1), and beside a chunk
    steps.append(WarmupStep(((page, 1),), follows=True))
    if max_running > 1:
        steps.append(WarmupStep(((page, 1), (0, 2)), follows=True))
    return steps


def _chunks(step: WarmupStep, page: int, vocab: int, groups: int = 1) -> list[ScheduledChunk]:
    """Requests whose every page (in each of `groups` KV groups) is the reserved page 0 (token ids spread so routing
    looks like real traffic)."""
    out = []
    for i, (start, n) in enumerate(step.chunks):
        ids = [(i * 7919 + j * 104729) % vocab for j in range(start + n)]
        req = Request(RequestSpec(f"warmup{i}", ids, SAMPLING[step.sampling], i, start + n + 1))
        req.set_tables([[0] * -(-(start + n) // page) for _ in range(groups)])
        req.num_computed = start
        out.append(ScheduledChunk(req, start, n))
    return out


def warm_up(rank: Rank, progress: bool) -> tuple[int, float]:
    """Run every layout's warm-up steps on this rank (every rank the same steps in the same order: EP's steps run
    collectives); returns (steps, seconds)."""
    ecfg, page, t0 = rank.spec.engine, rank.spec.engine.block_size, time.perf_counter()
    plans: list[tuple[ModelRunner, list[WarmupStep]]] = []
    for rt in rank.modes.values():
        budget = min(ecfg.max_num_batched_tokens, rank.spec.max_model_len)
        graphed = {b for b in range(1, budget + 1) if rt.runner.has_graph(b)}
        plans.append((rt.runner, warmup_steps(ecfg.max_num_batched_tokens, ecfg.max_running_requests,
                                              rank.spec.max_model_len, page, graphed,
                                              rt.runner.release_order if rt.runner.decodes_apart else None)))
    total = sum(len(s) for _, s in plans)
    with tqdm(total=total, desc="compiling kernels", unit="step", disable=not progress) as bar:
        for runner, steps in plans:
            prev: PendingStep | None = None
            for step in steps:
                sync = StepSync(step.tokens, step.decode_only)
                fill = None
                if step.follows and prev is not None:  # each decode's input: a row of the step before's tokens
                    fill = np.array([b % prev.tokens.shape[0] if start and n == 1 else -1
                                     for b, (start, n) in enumerate(step.chunks)], dtype=np.int64)
                prev = runner.launch(_chunks(step, page, rank.cfg.vocab_size, len(rank.cfg.kv_groups)), [], sync,
                                     prev if fill is not None else None, fill)
                prev.result()  # as served
                bar.update()
    if rank.device.type == "cuda":
        torch.cuda.synchronize(rank.device)
    return total, time.perf_counter() - t0
