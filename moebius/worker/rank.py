"""One rank of the engine, serving: it applies each `StepPlan` (admit, release, maybe switch, maybe step) to its
scheduler and runtimes and reports what happened (`StepReport`). Built by `worker/build.py`; its diagnostics live in
`worker/diagnostics.py`, a benchmark's step timing in `worker/probes.py`.

Overlap scheduling (the default): a step is launched before the previous one's tokens are read back, so the host
work of step N+1 (scheduling, metadata, the round trip to the front end) runs while the device computes step N.
A request whose token is still on the device carries `PLACEHOLDER` as its last output token; the step that
produced it is resolved right after the next one is launched. A request that stops on that token has run one
step too many: that row's result is dropped, and its KV writes into the pages it has since released come, in stream
order, before any later step that reuses them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from moebius.config import EngineConfig, ModelConfig
from moebius.link.lifecycle import StopRules
from moebius.link.messages import (
    KVStats,
    MemoryOrder,
    MemoryOutcome,
    RankTimes,
    StepPlan,
    StepReport,
    StepWork,
    SwitchOrder,
    SwitchOutcome,
    SwitchTimes,
    TokenDelta,
    UpdateOutcome,
    WeightUpdate,
    attended_pairs,
    window_reads,
)
from moebius.link.request import PLACEHOLDER, Request, RequestSpec
from moebius.memory.kv_pool import KVPages, KVPool
from moebius.memory.umm import UnifiedMemory
from moebius.models.weights import ModelWeights
from moebius.parallel.groups import Groups, all_gather_ints, all_gather_json
from moebius.parallel.layout import MODES, Layout
from moebius.switch.executor import Switcher
from moebius.switch.handover import RankRequests, SwitchResult, switch_requests
from moebius.worker.runner import ModelRunner, PendingStep, StepSync, admission_error
from moebius.worker.scheduler import ScheduledChunk, Scheduler
from moebius.worker.weight_update import WeightTargets, apply_update


@dataclass(frozen=True)
class RankSpec:
    """Everything a rank needs to build itself (picklable, so rank processes can receive it)."""

    engine: EngineConfig
    model: ModelConfig
    checkpoint: str | None  # None: dummy weights
    device: str
    dtype: str
    eos_token_ids: tuple[int, ...]
    max_model_len: int
    rank: int = 0
    world_size: int = 1
    mode: str = "tp"
    held: tuple[str, ...] = MODES  # the layouts the rank holds: both (the switchable engine), or the start one alone


@dataclass
class ModeRuntime:
    """Everything one layout needs to run, built once at start and kept resident (views over the same buffer)."""

    layout: Layout
    weights: ModelWeights
    kv: KVPool
    runner: ModelRunner


def step_work(batch: list[ScheduledChunk], preempted: int = 0, window: int = 0) -> StepWork:
    """What a scheduled batch computes (the floor model's terms; `window`: the model's largest sliding window, 0 for
    none), and the requests preempted to schedule it."""
    w = StepWork(sequences=len(batch), preempted=preempted)
    for c in batch:
        n, p, samples = c.num_tokens, c.start, c.samples
        w.tokens += n
        w.decode_tokens += n == 1 and samples and p >= c.req.num_prompt  # not a prompt's one-token last chunk
        w.kv_tokens += p + n
        w.attended += attended_pairs(p, n)
        w.sampled += samples
        w.window_kv_tokens += window_reads(p, n, window)
        w.window_attended += attended_pairs(p, n, window) if window else 0
    return w


@dataclass
class InFlight:
    """A launched step not yet resolved: the requests it samples for (row order) and where the tokens come back."""

    sampling: list[Request]
    pending: PendingStep
    rows: dict[str, int]  # request id -> row of its placeholder's token in pending.tokens (the next launch)


class Rank:
    def __init__(self, spec: RankSpec, groups: Groups, umm: UnifiedMemory, modes: dict[str, ModeRuntime],
                 switcher: Switcher, rules: StopRules) -> None:
        self.spec, self.groups, self.umm, self.modes = spec, groups, umm, modes
        self.cfg: ModelConfig = spec.model
        self.device = umm.device
        self.switcher, self.rules = switcher, rules
        self.mode = spec.mode
        ecfg = spec.engine
        self.kv_pages = KVPages(modes[self.mode].kv.group_pages, ecfg.block_size,
                                [g.window for g in self.cfg.kv_groups])
        self.scheduler = Scheduler(self.kv_pages, ecfg.max_running_requests, ecfg.max_num_batched_tokens,
                                   prefix_caching=not ecfg.disable_prefix_caching)
        # EP: the specs of the live requests the other ranks hold (every plan reaches every rank), so that an
        # EP -> TP switch moves only their outputs and state, not their prompts
        self.others: dict[str, RequestSpec] = {}
        self.overlap = not ecfg.disable_overlap_schedule
        for rt in modes.values():
            rt.runner.logprobs_mode = ecfg.logprobs_mode
            rt.runner.lm_head_fp32 = ecfg.lm_head_dtype == "float32"
            if not ecfg.enable_return_routed_experts:  # before any graph is captured: no forward records them
                rt.runner.routed = None
        self.inflight: InFlight | None = None
        self._late_switch_times: SwitchTimes | None = None  # see report()
        self._work = StepWork()  # what the last launched step computes (see report())
        self._synced = 0.0  # seconds blocked on the device for a step's tokens since report() began
        self.targets = WeightTargets(self.cfg, {m: rt.layout for m, rt in modes.items()}, getattr(torch, spec.dtype))
        self._updated: UpdateOutcome | None = None  # the plan's weight update (see report())
        self._memory_done: MemoryOutcome | None = None  # the plan's memory release or resume (see report())

    @property
    def layout(self) -> Layout:
        return self.modes[self.mode].layout

    @property
    def runner(self) -> ModelRunner:
        return self.modes[self.mode].runner

    @property
    def kv_capacity(self) -> int:
        """KV tokens one request may reach: what a rank holds in the smaller of the two layouts (the front end's
        admission limit, so every admitted request fits in either layout after any switch)."""
        return min(rt.kv.num_pages - 1 for rt in self.modes.values()) * self.spec.engine.block_size

    def kv_stats(self) -> KVStats:
        """Free KV tokens: the first KV group's (a window group's pages are sized never to run out before them)."""
        first = self.kv_pages.first
        return KVStats(first.free_tokens, first.total_tokens)

    def destroy_graphs(self) -> None:
        for rt in self.modes.values():
            rt.runner.destroy_graphs()

    def report(self, plan: StepPlan) -> StepReport:
        """Apply a plan and report (a query's answer is the caller's: `worker/diagnostics.py`). In TP every rank
        computes the same tokens and only rank 0 reports them; in EP each rank reports its own. Deltas from before a
        switch (the step in flight, resolved first) are reported by the old layout's rule, those of the step by the
        new one's."""
        t0, self._synced = time.perf_counter(), 0.0
        first = self.layout.reports_deltas
        before, after, outcome = self.apply(plan)
        second = self.layout.reports_deltas
        sched = self.scheduler
        counts = (len(sched.running), len(sched.waiting)) if second else (0, 0)
        host = time.perf_counter() - t0 - self._synced
        return StepReport((before if first else []) + (after if second else []), [self.kv_stats()], *counts,
                          self._work if second else StepWork(), outcome, self._late_switch_times,
                          RankTimes(host * 1e3, self._synced * 1e3), update=self._updated, memory=self._memory_done)

    def apply(self, plan: StepPlan) -> tuple[list[TokenDelta], list[TokenDelta], SwitchOutcome | None]:
        """Apply the plan: admit, release, maybe update weights, maybe switch, maybe run one forward step. Returns the
        deltas of the step in flight resolved before a switch or a call without a step, those of the step, and the
        switch's outcome (an update's: `_updated`)."""
        sched = self.scheduler
        self._work = StepWork()  # (a plan without a step launches nothing)
        self._updated = None
        # times of a switch that rode on the step before this one (its pass is over by now, or nearly)
        self._late_switch_times = self.switcher.pass_times()
        # a switch moves requests and a query looks at them: both need every token on the host; the step in flight
        # ran on the weights an update replaces
        t = time.perf_counter()
        drained = self.drain() if plan.switch or plan.update or plan.retract or plan.memory or not plan.run else []
        drain_ms = (time.perf_counter() - t) * 1e3
        for a in plan.admit:
            # every rank judges every request alike (a pure function of it): the one that reports it says so
            error = admission_error(a.spec, self.cfg.vocab_size)
            held = a.owner is None or self.layout.holds(a.owner)
            if error is not None:
                if held:  # ended here, before any step: reported by the rule of the layout it came in
                    drained.append(TokenDelta(a.spec.request_id, [], "error", error=error))
            elif held:
                sched.add(Request(a.spec))
            else:
                self.others[a.spec.request_id] = a.spec
        if plan.release:
            self._release(plan.release)
        if plan.memory is not None and plan.memory.release is False:  # (mapped again before anything touches it)
            self._memory_done = self._memory(plan.memory)
        if plan.update is not None:
            self._updated = self._update(plan.update)
        if plan.retract:  # (after an update in the same plan: the recompute runs on the new weights)
            sched.retract()
        outcome = self._switch(plan.switch, drain_ms) if plan.switch else None
        if plan.memory is not None and plan.memory.release:
            self._memory_done = self._memory(plan.memory)
        deltas = self._forward_step() if plan.run else []
        if outcome is not None and outcome.done and not plan.run:  # nothing rides on it: its times now
            outcome.device = self.switcher.pass_times()
        return drained, deltas, outcome

    def _release(self, request_ids: list[str]) -> None:
        """End the requests the front end is done with (their pages freed; a step in flight drops their rows) and
        forget the specs kept of other ranks' ones."""
        gone = set(request_ids)
        for rid in request_ids:
            self.others.pop(rid, None)
        sched = self.scheduler
        for req in [r for r in (*sched.running, *sched.waiting) if r.request_id in gone]:
            sched.finish(req)

    def _update(self, update: WeightUpdate) -> UpdateOutcome:
        """New weights into the resident views (every rank, or none); requests in flight continue on them."""
        views, error = apply_update(self.umm, self.targets, self.mode, update, self.groups)
        if error is not None:
            return UpdateOutcome(False, error)
        if update.group is not None:  # joined or left a trainer's process group: no weight changed
            return UpdateOutcome(True, None, 0, 0)
        # the cached pages were computed by the old weights: no later prompt may start from them
        return UpdateOutcome(True, None, views, self.kv_pages.clear_cache())

    def _memory(self, order: MemoryOrder) -> MemoryOutcome:
        """Release or map again the buffer's memory under the order's tags on every rank, or on none: where some
        rank failed, the others undo what they did. A release of the KV cache forgets the cached pages (their bytes
        are gone)."""
        umm, error = self.umm, None
        try:
            stats = umm.release(order.tags, order.keep_weights) if order.release else umm.resume(order.tags)
        except (RuntimeError, MemoryError, OSError, ValueError) as e:  # no cuda-python, the host or device is full
            error = f"{type(e).__name__}: {e}"
        failed = [f"rank {r}: {e}" for r, e in enumerate(all_gather_json(error, self.groups)) if e]
        if failed:  # (the front end orders only tags all mapped, or all released: the undo touches nothing else)
            if order.release:  # mapped again, with the weights kept so far
                umm.resume(order.tags)
            else:  # released again, keeping the weights restored so far
                umm.release(order.tags, keep_weights=True)
            return MemoryOutcome(False, "; ".join(failed))
        if order.release and "kv_cache" in order.tags:
            self.kv_pages.clear_cache()
        return MemoryOutcome(True, None, stats.nbytes, stats.host_bytes, stats.seconds)

    def _switch(self, order: SwitchOrder, drain_ms: float) -> SwitchOutcome:
        if order.target == self.mode:
            return SwitchOutcome(self.mode, order.target, False, f"already in {self.mode}")
        if order.target not in self.modes:
            return SwitchOutcome(self.mode, order.target, False,
                                 f"the engine holds only the {self.mode} layout (--static-layout, or a quantized "
                                 "model TP cannot cut)")
        sched = self.scheduler
        result = switch_requests(self.switcher, self.layout, self.modes[order.target].layout,
                                 self.modes[order.target].kv.group_pages,
                                 RankRequests(sched.running, list(sched.waiting), self.others), order.owners,
                                 self.groups, self.device, self.spec.engine.block_size,
                                 self.spec.engine.max_running_requests, not self.spec.engine.disable_prefix_caching)
        result.outcome.drain_ms = drain_ms  # waiting for the step in flight (overlap) before the switch could start
        self._adopt(result)
        return result.outcome

    def _adopt(self, result: SwitchResult) -> None:
        """The target's requests, allocator and runtime become active (nothing changes on a refusal)."""
        if result.mode is None:
            return
        assert result.kv_pages is not None
        self.scheduler.adopt(result.running, result.waiting, result.kv_pages)
        self.kv_pages, self.mode, self.others = result.kv_pages, result.mode, result.others

    def _forward_step(self) -> list[TokenDelta]:
        """Schedule and launch a step, then resolve the step before it (overlap) or this one. Returns the deltas
        of the step resolved."""
        preempted = self.scheduler.num_preemptions
        batch = self.scheduler.schedule()
        self._work = w = step_work(batch, self.scheduler.num_preemptions - preempted, self.cfg.largest_window)
        n_tokens, decode = w.tokens, w.tokens == w.sequences == w.sampled  # one token a sequence, every one sampled
        if self.layout.data_parallel:
            # attention is per rank, but every rank joins each layer's collectives while any rank has work, and all
            # must agree on the dispatch size (and on the graph bucket)
            everyone = all_gather_ints([n_tokens, int(decode)], self.groups)
            sync = StepSync(max(n for n, _ in everyone), all(d for _, d in everyone))
        else:
            sync = StepSync(n_tokens, decode)
        if sync.max_tokens == 0:
            return self.drain()
        sampling = [c.req for c in batch if c.samples]
        masks = [(row, ids) for row, r in enumerate(sampling) if (ids := self.rules.banned(r))]
        prev = self.inflight
        prev_rows = None
        if prev is not None:
            prev_rows = np.array([prev.rows.get(c.req.request_id, -1)
                                  if c.samples and c.req.output_token_ids[-1:] == [PLACEHOLDER] else -1
                                  for c in batch], dtype=np.int64)
        pending = self.runner.launch(batch, masks, sync, prev.pending if prev else None, prev_rows)
        for b, chunk in enumerate(batch):
            chunk.req.num_computed = chunk.start + chunk.num_tokens
            if b in pending.prompt_logits:  # already on the host
                chunk.req.prompt_logits.append(pending.prompt_logits[b])
        deltas = self.drain()
        # Tokens still on the device: placeholders, so the next step schedules their requests' next positions.
        rows = {}
        for row, req in enumerate(sampling):
            if not req.finished:
                req.output_token_ids.append(PLACEHOLDER)
                rows[req.request_id] = row
        self.inflight = InFlight(sampling, pending, rows)
        return deltas + (self.drain() if not self.overlap else [])

    def drain(self) -> list[TokenDelta]:
        """Resolve the step in flight, if any: its tokens replace their placeholders and the stop rules run."""
        if self.inflight is None:
            return []
        flight, self.inflight = self.inflight, None
        t = time.perf_counter()
        tokens, _ = flight.pending.result()
        self._synced += time.perf_counter() - t
        logprobs = flight.pending.logprobs()
        routed = flight.pending.routed_experts()
        deltas: list[TokenDelta] = []
        if routed:  # prompt chunks that sample nothing report their routing on their own
            sampled = {r.request_id for r in flight.sampling}
            deltas += [TokenDelta(rid, [], None, routed_experts=ids, routed_start=pos)
                       for rid, (pos, ids) in routed.items() if rid not in sampled]
        for row, req in enumerate(flight.sampling):
            if req.finished:
                continue  # finished (or released) before this step was resolved: its row is dropped
            req.output_token_ids[-1] = tokens[row]
            self.rules.check(req)
            if req.finish_reason is not None:
                self.scheduler.finish(req)
            lp = logprobs[row] if logprobs is not None and req.params.logprobs is not None else None
            k = (req.params.logprobs or 0) + 1  # the step computed the largest k any of its requests asked for
            first = len(req.output_token_ids) == 1
            # the prompt's logits with the first token: every chunk is in by then, and the front end may end the
            # request (a stop string) without a rank ever reporting its end
            logits = torch.cat(req.prompt_logits) if first and req.params.prompt_logits else None
            deltas.append(TokenDelta(req.request_id, [tokens[row]], req.finish_reason, req.stop_reason, logits,
                                     lp[0][:k] if lp else None, lp[1][:k] if lp else None,
                                     req.num_cached_tokens if first else None))
            if req.request_id in routed:
                deltas[-1].routed_start, deltas[-1].routed_experts = routed[req.request_id]
        return deltas
