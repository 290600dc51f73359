"""One rank of the engine: its unified memory, weights, KV pool, scheduler and model runner, driven by StepPlans.

The front end (rank 0's side) turns user calls into a `StepPlan` per iteration; every rank applies the same plan
and runs one step. With one rank the front end calls `Worker.step` directly.

Overlap scheduling (the default): a step is launched before the previous one's tokens are read back, so the host
work of step N+1 (scheduling, metadata, the round trip to the front end) runs while the device computes step N.
A request whose token is still on the device carries `PLACEHOLDER` as its last output token; the step that
produced it is resolved right after the next one is launched. A request that stops on that token has run one
step too many: that row's result is dropped, and its KV writes into the pages it has since released come, in stream
order, before any later step that reuses them.
"""

from __future__ import annotations

import hashlib
import logging
import socket
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from moebius.config import EngineConfig, ModelConfig
from moebius.engine.cuda_graphs import CudaGraphs, default_buckets
from moebius.engine.request import PLACEHOLDER, Request, RequestSpec
from moebius.engine.runner import ModelRunner, PendingStep, StaticBuffers, StepSync
from moebius.engine.scheduler import ScheduledChunk, Scheduler, StopChecker
from moebius.kernels import moe as kmoe
from moebius.memory.kv_pool import BlockAllocator, KVPool
from moebius.memory.umm import MemoryPlan, UnifiedMemory
from moebius.model.loader import Checkpoint, DummyCheckpoint, load_weights
from moebius.model.qwen3_moe import ModelWeights, MoEWeights
from moebius.model.weights import build_weights, plan_weights, weight_specs
from moebius.parallel.dispatch import (
    Communicator,
    EPComm,
    LocalComm,
    SymmetricAllReduce,
    TPComm,
    symmetric_memory_available,
)
from moebius.parallel.groups import Groups, all_gather_ints, all_gather_json
from moebius.parallel.layout import MODES, Layout, check_shapes
from moebius.sampling_params import SamplingParams
from moebius.switch.executor import Switcher
from moebius.tokenizer import Tokenizer

log = logging.getLogger("moebius")

CPU_DEFAULT_KV_TOKENS = 65536


@dataclass
class StepPlan:
    """What rank 0 tells every rank before a step: requests to admit and abort, an optional layout switch (done
    before the step), whether to run a forward step, and an optional query (diagnostics, answered per rank)."""

    new: list[RequestSpec] = field(default_factory=list)
    owners: list[int] = field(default_factory=list)  # rank owning each new request (EP); ignored in TP
    aborts: list[str] = field(default_factory=list)
    # requests that ended since the last plan (the front end saw their last token): EP ranks forget their specs
    retired: list[str] = field(default_factory=list)
    switch_to: str | None = None
    run: bool = True
    query: dict[str, Any] | None = None  # {"name": ..., **arguments}


@dataclass
class TokenDelta:
    """What a rank reports for one request after a step."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None
    prompt_logits: torch.Tensor | None = None


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a rank needs to build itself (picklable, so rank processes can receive it)."""

    engine: EngineConfig
    model: ModelConfig
    checkpoint: str | None  # None: dummy weights
    device: str
    dtype: str
    eos_token_ids: tuple[int, ...]
    tokenizer_dir: str | None  # None with use_builtin_tokenizer False: no tokenizer
    use_builtin_tokenizer: bool
    max_model_len: int
    rank: int = 0
    world_size: int = 1
    mode: str = "tp"


def make_comm(layout: Layout, groups: Groups) -> Communicator:
    if groups.world_size == 1:
        return LocalComm()
    if layout.mode == "tp":
        return TPComm(groups.device, split_vocab=layout.cfg.vocab_size % groups.world_size == 0)
    return EPComm(groups.device, groups.world_size, layout.num_local_experts)


@dataclass
class ModeRuntime:
    """Everything one layout needs to run, built once at start and kept resident (views over the same buffer)."""

    layout: Layout
    weights: ModelWeights
    kv: KVPool
    runner: ModelRunner


@dataclass
class InFlight:
    """A launched step not yet resolved: the requests it samples for (row order) and where the tokens come back."""

    sampling: list[Request]
    pending: PendingStep
    rows: dict[str, int]  # request id -> row of its placeholder's token in pending.tokens (the next launch)


class Worker:
    EP_SYMMETRIC_MAX_TOKENS = 2048  # per rank: EP steps up to this many tokens exchange through symmetric memory

    def __init__(self, spec: WorkerSpec, groups: Groups | None = None) -> None:
        ecfg, cfg = spec.engine, spec.model
        self.spec, self.cfg = spec, cfg
        self.groups = groups or Groups(0, 1, None, None)
        self.device = torch.device(spec.device)
        if self.device.type == "cpu":
            torch.set_num_threads(ecfg.cpu_threads)
        kmoe.BACKEND = ecfg.moe_kernel
        self.dtype = getattr(torch, spec.dtype)
        check_shapes(cfg, spec.world_size)
        # Both layouts resident (the switchable engine), or only the start one (--static-layout, for comparison).
        held = (spec.mode,) if ecfg.static_layout else MODES
        layouts = {m: Layout(cfg, m, spec.rank, spec.world_size) for m in held}
        start, bs, elt = layouts[spec.mode], ecfg.block_size, self.dtype.itemsize

        # One plan for both modes: dense regions (shared where the shard is equal), static buffers, slots.
        plan = MemoryPlan()
        plan_weights(plan, cfg, list(layouts.values()), self.dtype)
        max_pages_per_seq = -(-spec.max_model_len // bs)
        buf_shape = (ecfg.max_num_batched_tokens, ecfg.max_running_requests, max_pages_per_seq)
        for m in held:
            StaticBuffers.plan(plan, m, *buf_shape)
        expert_bytes = -(-start.expert_bytes(elt) // 256) * 256  # the same in both modes
        page_bytes = {m: KVPool.page_bytes(bs, lay.num_kv_heads, cfg.head_dim, self.dtype)
                      for m, lay in layouts.items()}
        start_pages = self._num_pages(plan.total_bytes, expert_bytes, page_bytes[spec.mode], cfg.num_layers + 1)
        kv_bytes = start_pages * page_bytes[spec.mode]
        plan.add_slots(cfg.num_layers + 1, expert_bytes + kv_bytes)
        self.umm = UnifiedMemory(plan, self.device)

        # Weights: dense parts of both layouts, experts in the start layout's slots.
        ckpt = DummyCheckpoint(ecfg.seed, self.device) if spec.checkpoint is None else Checkpoint(spec.checkpoint)
        specs = {m: weight_specs(cfg, lay, elt) for m, lay in layouts.items()}
        other = [s for m in held if m != spec.mode for s in specs[m] if s.slot is None]
        load_weights(self.umm, specs[spec.mode] + other, ckpt, self.dtype, cfg)

        self.modes: dict[str, ModeRuntime] = {}
        for m, lay in layouts.items():
            weights = build_weights(self.umm, cfg, lay, self.dtype)
            kv = KVPool(self.umm, [lay.slot_of(i) for i in range(cfg.num_layers)], expert_bytes,
                        kv_bytes // page_bytes[m], bs, lay.num_kv_heads, cfg.head_dim, self.dtype)
            runner = ModelRunner(cfg, weights, kv.layers, make_comm(lay, self.groups),
                                 StaticBuffers.build(self.umm, m, *buf_shape), bs, self.device)
            self.modes[m] = ModeRuntime(lay, weights, kv, runner)
        self.mode = spec.mode
        self.allocator = BlockAllocator(self.modes[self.mode].kv.num_pages, bs)
        self.scheduler = Scheduler(self.allocator, ecfg.max_running_requests, ecfg.max_num_batched_tokens)
        tokenizer = (Tokenizer.builtin() if spec.use_builtin_tokenizer
                     else Tokenizer.from_dir(spec.tokenizer_dir) if spec.tokenizer_dir else None)
        self.stop = StopChecker(spec.eos_token_ids, tokenizer)
        self.switcher = Switcher(self)
        self.late_switch_times: dict[str, Any] | None = None  # see step()
        # EP: the specs of the live requests the other ranks hold (every plan reaches every rank), so that an
        # EP -> TP switch moves only their outputs and state, not their prompts
        self.others: dict[str, RequestSpec] = {}
        self.overlap = not ecfg.disable_overlap_schedule
        self.inflight: InFlight | None = None
        log.info("rank %d: unified buffer %.1f MiB; KV pages of %d tokens: %s", spec.rank, plan.total_bytes / 2**20,
                 bs, {m: rt.kv.num_pages for m, rt in self.modes.items()})

    def prepare_runtime(self) -> None:
        """The start-up steps that run collectives (graph capture warms up NCCL, the switch paths are opened): every
        rank calls this once all ranks are built, so a rank that failed to build cannot leave the others waiting."""
        ecfg = self.spec.engine
        if self.groups.world_size > 1:
            # peers' memory is mapped over NVLink (symmetric memory) or shared files: one machine only; torchrun
            # across machines keeps NCCL and the collective switch transport
            one_host = len(set(all_gather_json(socket.gethostname(), self.groups))) == 1
            if not one_host:
                log.info("rank %d: ranks span several machines: NCCL collectives only", self.spec.rank)
            self.switcher.open_paths(peers_mapped=one_host)
            if one_host:
                self._enable_symmetric_comm()
        if self.device.type == "cuda" and not ecfg.disable_cuda_graph:
            self._capture_graphs(min(ecfg.cuda_graph_max_bs, ecfg.max_running_requests, ecfg.max_num_batched_tokens))

    def _enable_symmetric_comm(self) -> None:
        """TP's all-reduce and EP's exchange through symmetric memory (collective: every rank, same order; ranks of
        one machine)."""
        ecfg = self.spec.engine
        if (self.device.type != "cuda" or ecfg.disable_custom_all_reduce or self.dtype != torch.bfloat16
                or not symmetric_memory_available()):
            return
        from moebius.kernels.symmetric import EPExchange

        for rt in self.modes.values():
            comm = rt.runner.comm
            if isinstance(comm, TPComm):
                numel = ecfg.max_num_batched_tokens * self.cfg.hidden_size
                comm.symmetric = SymmetricAllReduce(self.groups.device, numel, self.dtype, self.device)
            elif isinstance(comm, EPComm):
                # decode batches and small prefill chunks; larger steps exchange through NCCL
                capacity = min(ecfg.max_num_batched_tokens, self.EP_SYMMETRIC_MAX_TOKENS)
                comm.symmetric = EPExchange(self.groups.device, capacity, self.cfg.hidden_size, self.cfg.top_k,
                                            self.dtype, self.device)

    def _capture_graphs(self, cap: int) -> None:
        """Both modes' decode graphs, once, into one memory pool. Capture only records addresses: it needs no
        switch, and its warm-up writes land in the reserved page 0 of either layout."""
        pool = torch.cuda.graph_pool_handle()
        for m, rt in self.modes.items():
            rt.runner.graphs = CudaGraphs(rt.runner, default_buckets(cap), pool)
            secs = rt.runner.graphs.capture()
            log.info("rank %d: captured %d %s decode graphs (batch <= %d) in %.1f s", self.spec.rank,
                     len(rt.runner.graphs.buckets), m, cap, secs)

    def destroy_graphs(self) -> None:
        for rt in self.modes.values():
            if rt.runner.graphs is not None:
                rt.runner.graphs.destroy()
                rt.runner.graphs = None

    @property
    def layout(self) -> Layout:
        return self.modes[self.mode].layout

    @property
    def runner(self) -> ModelRunner:
        return self.modes[self.mode].runner

    def _num_pages(self, fixed_bytes: int, expert_bytes: int, page_bytes: int, num_slots: int) -> int:
        ecfg = self.spec.engine
        if ecfg.max_total_tokens is not None:
            return ecfg.max_total_tokens // ecfg.block_size
        if self.device.type != "cuda":
            return CPU_DEFAULT_KV_TOKENS // ecfg.block_size
        free, total = torch.cuda.mem_get_info(self.device)
        budget = min(free, int(total * ecfg.mem_fraction)) - fixed_bytes - num_slots * expert_bytes
        pages = budget // (num_slots * page_bytes)
        if pages <= 0:
            raise MemoryError(f"the model needs {(fixed_bytes + num_slots * expert_bytes) / 2**30:.1f} GiB per rank, "
                              f"more than --mem-fraction {ecfg.mem_fraction} of this GPU leaves for the KV cache")
        return int(pages)

    @property
    def kv_capacity(self) -> int:
        """KV tokens one request may reach: what a rank holds in the smaller of the two layouts (the front end's
        admission limit, so every admitted request fits in either layout after any switch)."""
        return min(rt.kv.num_pages - 1 for rt in self.modes.values()) * self.spec.engine.block_size

    def step(self, plan: StepPlan) -> tuple[list[TokenDelta], list[TokenDelta], dict[str, Any] | None]:
        """Apply the plan: admit, abort, maybe switch, maybe run one forward step. Returns the deltas from before
        the switch (aborts), those of the step, and the switch outcome (None when the plan did not switch)."""
        sched = self.scheduler
        # times of a switch that rode on the step before this one (its pass is over by now, or nearly)
        self.late_switch_times = self.switcher.pass_times()
        # a switch moves requests and a query looks at them: both need every token on the host
        t = time.perf_counter()
        aborted = self.drain() if plan.switch_to or not plan.run else []
        drain_ms = (time.perf_counter() - t) * 1e3
        mine = self.layout.mode == "tp" or self.groups.world_size == 1
        for i, spec in enumerate(plan.new):
            if mine or plan.owners[i] == self.groups.rank:
                sched.add(Request(spec))
            else:
                self.others[spec.request_id] = spec
        for rid in plan.retired:
            self.others.pop(rid, None)
        for rid in plan.aborts:
            self.others.pop(rid, None)
            req = sched.find(rid)
            if req is not None:
                sched.finish(req)
                req.finish_reason = "abort"
                aborted.append(TokenDelta(rid, [], "abort"))
        outcome = self.switcher.switch(plan.switch_to) if plan.switch_to else None
        deltas = self._forward_step() if plan.run else []
        if outcome is not None:
            outcome["drain_ms"] = drain_ms  # waiting for the step in flight (overlap) before the switch could start
            if outcome.get("done") and not plan.run:  # nothing rides on it: report its times now
                outcome.update(self.switcher.pass_times() or {})
        return aborted, deltas, outcome

    def query(self, q: dict[str, Any]) -> Any:
        """Diagnostics and benchmarks run inside a plan, on every rank (JSON-able answers)."""
        if q["name"] == "fingerprint":
            return fingerprint(self)
        if q["name"] == "memory":
            return self.memory_report()
        if q["name"] == "requests":  # ids of what this rank holds, and of the specs it keeps of others' requests
            return {"running": [r.request_id for r in self.scheduler.running],
                    "waiting": [r.request_id for r in self.scheduler.waiting], "others": sorted(self.others)}
        if q["name"] == "bench_decode":
            return self.bench_decode(q["batch"], q["context"], q["steps"], q["warmup"], q["graphs"])
        if q["name"] == "comm":  # how each layout's collectives run
            out = {}
            for m, rt in self.modes.items():
                sym = getattr(rt.runner.comm, "symmetric", None)
                out[m] = {"comm": type(rt.runner.comm).__name__, "symmetric": sym is not None,
                          "symmetric_calls": sym.calls() if sym is not None else 0}
            return out
        raise ValueError(f"unknown query {q['name']!r}")

    def memory_report(self) -> dict[str, Any]:
        kv = sum(t.numel() * t.element_size() for t in self.modes[self.mode].kv.layers)
        out: dict[str, Any] = {"umm_bytes": self.umm.plan.total_bytes, "kv_bytes": kv,
                               "kv_tokens": (self.modes[self.mode].kv.num_pages - 1) * self.spec.engine.block_size}
        if self.device.type == "cuda":
            out["peak_allocated"] = torch.cuda.max_memory_allocated(self.device)
            out["peak_reserved"] = torch.cuda.max_memory_reserved(self.device)
            out["non_kv_bytes"] = out["peak_reserved"] - kv
        return out

    def bench_decode(self, batch: int, context: int, steps: int, warmup: int, graphs: bool) -> dict[str, Any]:
        """Time steady-state decode steps of `batch` requests (global) with `context` cached tokens each, through
        the real runner (graph or eager) but without prefill: the requests' KV pages hold whatever is there."""
        P, rank = self.groups.world_size, self.groups.rank
        ep = self.mode == "ep" and P > 1
        local = batch // P + (1 if rank < batch % P else 0) if ep else batch
        bs = self.spec.engine.block_size
        need = local * -(-(context + 1) // bs)
        ok = need <= self.allocator.num_free and local <= self.spec.engine.max_num_batched_tokens
        if P > 1 and not all(v for (v,) in all_gather_ints([int(ok)], self.groups)):
            return {"error": "does not fit on every rank"}
        if not ok:
            return {"error": f"needs {need} KV pages, {self.allocator.num_free} free"}
        chunks = []
        params = SamplingParams(temperature=0.0, max_tokens=1)
        V = self.cfg.vocab_size
        for i in range(local):
            # distinct tokens per request, so the batch routes like real traffic (not all to the same experts)
            ids = [(rank * 7919 + i * 104729 + j * 31) % V for j in range(context + 1)]
            req = Request(RequestSpec(f"bench{i}", ids, params, i, context + 2))
            req.pages, req.num_computed = self.allocator.allocate(-(-(context + 1) // bs)), context
            chunks.append(ScheduledChunk(req, context, 1))
        sync = StepSync(-(-batch // P) if ep else batch, True)
        saved = self.runner.graphs
        if not graphs:
            self.runner.graphs = None
        used_graph = self.runner.graphs is not None and self.runner.graphs.bucket_for(sync.max_tokens) is not None
        times, meta = [], []
        try:
            for _ in range(warmup + steps):
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                t = time.perf_counter()
                self.runner.execute(chunks, [], sync)  # ends with the sampled tokens on the host: a full step
                times.append(time.perf_counter() - t)
                meta.append(self.runner.last_metadata_s)
            overlapped = self._time_overlapped(chunks, sync, steps, warmup)
            replay_ms = self._time_replay(sync.max_tokens, steps) if used_graph else None
        finally:
            self.runner.graphs = saved
            for c in chunks:
                self.allocator.free(c.req.pages)
        sync_ms = statistics.median(times[warmup:]) * 1e3
        return {"step_ms": overlapped if self.overlap else sync_ms, "step_ms_overlap": overlapped,
                "step_ms_no_overlap": sync_ms, "local_batch": local, "cuda_graph": used_graph,
                "replay_ms": replay_ms, "metadata_ms": statistics.median(meta[warmup:]) * 1e3}

    def _time_overlapped(self, chunks: list[ScheduledChunk], sync: StepSync, steps: int, warmup: int) -> float:
        """Steady-state ms per step as overlap scheduling runs them: each step is launched with its input tokens
        taken on the device from the step before, and only then is the step before read back."""
        rows = np.arange(len(chunks))
        prev: PendingStep | None = None
        arrived = []  # when each step's tokens reached the host
        for _ in range(max(warmup, 1) + steps):
            cur = self.runner.launch(chunks, [], sync, prev, rows if prev is not None else None)
            if prev is not None:
                prev.result()
                arrived.append(time.perf_counter())
            prev = cur
        prev.result()
        arrived.append(time.perf_counter())
        # between the last warm-up step's arrival and the last step's, exactly `steps` steps completed (timing from
        # a launch instead would count the step already in flight then)
        return (arrived[-1] - arrived[-1 - steps]) / steps * 1e3

    def _time_replay(self, n: int, steps: int) -> float:
        """GPU time of the decode graph alone (same metadata as the last step): step_ms minus this is host work."""
        graphs = self.runner.graphs
        b = graphs.bucket_for(n)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            graphs.replay(b)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / steps

    def _forward_step(self) -> list[TokenDelta]:
        """Schedule and launch a step, then resolve the step before it (overlap) or this one. Returns the deltas
        of the step resolved."""
        sched = self.scheduler
        batch = sched.schedule()
        n_tokens = sum(c.num_tokens for c in batch)
        decode = all(c.num_tokens == 1 and c.samples for c in batch)
        if self.layout.mode == "ep" and self.groups.world_size > 1:
            # EP: attention is per rank, but every rank joins each layer's collectives while any rank has work,
            # and all must agree on the dispatch size (and on the graph bucket).
            everyone = all_gather_ints([n_tokens, int(decode)], self.groups)
            sync = StepSync(max(n for n, _ in everyone), all(d for _, d in everyone))
        else:
            sync = StepSync(n_tokens, decode)
        if sync.max_tokens == 0:
            return self.drain()
        sampling = [c.req for c in batch if c.samples]
        stop_masks = [(row, self._banned(r)) for row, r in enumerate(sampling)
                      if len(r.output_token_ids) < r.params.min_tokens]
        prev = self.inflight
        prev_rows = None
        if prev is not None:
            prev_rows = np.array([prev.rows.get(c.req.request_id, -1)
                                  if c.samples and c.req.output_token_ids[-1:] == [PLACEHOLDER] else -1
                                  for c in batch], dtype=np.int64)
        pending = self.runner.launch(batch, [(row, ids) for row, ids in stop_masks if ids], sync,
                                     prev.pending if prev else None, prev_rows)
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
        tokens, _ = flight.pending.result()
        sched = self.scheduler
        deltas: list[TokenDelta] = []
        for row, req in enumerate(flight.sampling):
            if req.finished:
                continue  # finished (or aborted) before this step was resolved: its row is dropped
            req.output_token_ids[-1] = tokens[row]
            self.stop.check(req)
            logits = None
            if req.finish_reason is not None:
                sched.finish(req)
                if req.params.prompt_logits:
                    logits = torch.cat(req.prompt_logits)
            deltas.append(TokenDelta(req.request_id, [tokens[row]], req.finish_reason, req.stop_reason, logits))
        return deltas

    def _banned(self, req: Request) -> list[int]:
        """Tokens that would stop the request before min_tokens."""
        banned = set(req.params.stop_token_ids or ())
        if not req.params.ignore_eos:
            banned |= self.stop.eos
        return sorted(banned)


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def fingerprint(w: Worker) -> dict[str, Any]:
    """Buffer address, every resident view's data_ptr, and digests of the active layout's expert weights and of
    each live request's KV (by request, in token order, all local heads): what a switch must preserve."""
    ptrs = [w.umm.buffer.data_ptr()]
    for rt in w.modes.values():
        for lw in rt.weights.layers:
            ptrs += [lw.attn.qkv_QD.data_ptr(), lw.attn.o_DQ.data_ptr()]
            if isinstance(lw.mlp, MoEWeights):
                ptrs += [lw.mlp.w13_EFD.data_ptr(), lw.mlp.w2_EDF.data_ptr()]
        ptrs += [t.data_ptr() for t in rt.kv.layers]
        ptrs += [rt.runner.bufs.input_ids.data_ptr(), rt.runner.bufs.block_tables.data_ptr()]
    rt = w.modes[w.mode]
    experts = [_digest(torch.cat([lw.mlp.w13_EFD.flatten(), lw.mlp.w2_EDF.flatten()]))
               for lw in rt.weights.layers if isinstance(lw.mlp, MoEWeights)]
    bs = w.spec.engine.block_size
    kv = {}
    for r in w.scheduler.running:
        slots = torch.arange(r.num_computed)
        pages = torch.tensor(r.pages, dtype=torch.int64)[slots // bs]
        kv[r.request_id] = _digest(torch.stack([c[pages, :, slots % bs] for c in rt.kv.layers]))
    return {"mode": w.mode, "ptrs": ptrs, "experts": experts, "kv": kv}
