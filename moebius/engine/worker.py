"""One rank of the engine: its unified memory, weights, KV pool, scheduler and model runner, driven by StepPlans.

The front end (rank 0's side) turns user calls into a `StepPlan` per iteration; every rank applies the same plan
and runs one step. With one rank the front end calls `Worker.step` directly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from moebius.config import EngineConfig, ModelConfig
from moebius.engine.request import Request, RequestSpec
from moebius.engine.runner import ModelRunner, StaticBuffers
from moebius.engine.scheduler import Scheduler, StopChecker
from moebius.memory.kv_pool import BlockAllocator, KVPool
from moebius.memory.umm import MemoryPlan, UnifiedMemory
from moebius.model.loader import Checkpoint, DummyCheckpoint, load_weights
from moebius.model.weights import build_weights, plan_weights, weight_specs
from moebius.parallel.dispatch import Communicator, EPComm, LocalComm, TPComm
from moebius.parallel.groups import Groups, all_gather_ints
from moebius.parallel.layout import Layout, check_shapes
from moebius.tokenizer import Tokenizer

log = logging.getLogger("moebius")

CPU_DEFAULT_KV_TOKENS = 65536


@dataclass
class StepPlan:
    """What rank 0 tells every rank before a step: requests to admit and requests to abort."""

    new: list[RequestSpec] = field(default_factory=list)
    owners: list[int] = field(default_factory=list)  # rank owning each new request (EP); ignored in TP
    aborts: list[str] = field(default_factory=list)


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
        return TPComm(groups.device)
    return EPComm(groups.device, groups.world_size, layout.num_local_experts)


class Worker:
    def __init__(self, spec: WorkerSpec, groups: Groups | None = None) -> None:
        ecfg, cfg = spec.engine, spec.model
        self.spec = spec
        self.groups = groups or Groups(0, 1, None, None)
        self.device = torch.device(spec.device)
        if self.device.type == "cpu":
            torch.set_num_threads(ecfg.cpu_threads)
        self.dtype = getattr(torch, spec.dtype)
        check_shapes(cfg, spec.world_size)
        self.layout = Layout(cfg, spec.mode, spec.rank, spec.world_size)
        lay, bs = self.layout, ecfg.block_size

        plan = MemoryPlan()
        plan_weights(plan, cfg, [lay], self.dtype)
        max_pages_per_seq = -(-spec.max_model_len // bs)
        StaticBuffers.plan(plan, spec.mode, ecfg.max_num_batched_tokens, ecfg.max_running_requests,
                           max_pages_per_seq)
        elt = self.dtype.itemsize
        expert_bytes = -(-lay.expert_bytes(elt) // 256) * 256
        page_bytes = KVPool.page_bytes(bs, lay.num_kv_heads, cfg.head_dim, self.dtype)
        num_pages = self._num_pages(plan.total_bytes, expert_bytes, page_bytes, cfg.num_layers + 1)
        plan.add_slots(cfg.num_layers + 1, expert_bytes + num_pages * page_bytes)
        self.umm = UnifiedMemory(plan, self.device)

        ckpt = DummyCheckpoint(ecfg.seed, self.device) if spec.checkpoint is None else Checkpoint(spec.checkpoint)
        load_weights(self.umm, weight_specs(cfg, lay, elt), ckpt, self.dtype, cfg)
        self.weights = build_weights(self.umm, cfg, lay, self.dtype)
        slots = [lay.slot_of(i) for i in range(cfg.num_layers)]
        self.kv_pool = KVPool(self.umm, slots, expert_bytes, num_pages, bs, lay.num_kv_heads, cfg.head_dim,
                              self.dtype)
        self.allocator = BlockAllocator(num_pages, bs)
        self.scheduler = Scheduler(self.allocator, ecfg.max_running_requests, ecfg.max_num_batched_tokens)
        tokenizer = (Tokenizer.builtin() if spec.use_builtin_tokenizer
                     else Tokenizer.from_dir(spec.tokenizer_dir) if spec.tokenizer_dir else None)
        self.stop = StopChecker(spec.eos_token_ids, tokenizer)
        bufs = StaticBuffers.build(self.umm, spec.mode, ecfg.max_num_batched_tokens, ecfg.max_running_requests,
                                   max_pages_per_seq)
        self.runner = ModelRunner(cfg, self.weights, self.kv_pool.layers, make_comm(lay, self.groups), bufs, bs,
                                  self.device)
        log.info("rank %d: unified buffer %.1f MiB, %d KV pages of %d tokens", spec.rank,
                 plan.total_bytes / 2**20, num_pages, bs)

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
        return self.allocator.total_tokens

    def step(self, plan: StepPlan) -> list[TokenDelta]:
        """Apply the plan and run one step; deltas of this rank's requests (in TP every rank reports all)."""
        sched = self.scheduler
        deltas: list[TokenDelta] = []
        mine = self.layout.mode == "tp" or self.groups.world_size == 1
        for i, spec in enumerate(plan.new):
            if mine or plan.owners[i] == self.groups.rank:
                sched.add(Request(spec))
        for rid in plan.aborts:
            req = sched.find(rid)
            if req is not None:
                sched.finish(req)
                req.finish_reason = "abort"
                deltas.append(TokenDelta(rid, [], "abort"))
        batch = sched.schedule()
        if not mine:
            # EP: attention is per rank, but every rank must join each layer's all-to-all while any rank has work.
            if not any(n for (n,) in all_gather_ints([len(batch)], self.groups)):
                return deltas
        elif not batch:
            return deltas
        sampling = [c.req for c in batch if c.samples]
        stop_masks = [(row, self._banned(r)) for row, r in enumerate(sampling)
                      if len(r.output_token_ids) < r.params.min_tokens]
        tokens, prompt_logits = self.runner.execute(batch, [(row, ids) for row, ids in stop_masks if ids])
        next_token = iter(tokens)
        for b, chunk in enumerate(batch):
            req = chunk.req
            req.num_computed = chunk.start + chunk.num_tokens
            if b in prompt_logits:
                req.prompt_logits.append(prompt_logits[b])
            if not chunk.samples:
                continue
            req.output_token_ids.append(next(next_token))
            self.stop.check(req)
            logits = None
            if req.finish_reason is not None:
                sched.finish(req)
                if req.params.prompt_logits:
                    logits = torch.cat(req.prompt_logits)
            deltas.append(TokenDelta(req.request_id, [req.output_token_ids[-1]], req.finish_reason,
                                     req.stop_reason, logits))
        return deltas

    def _banned(self, req: Request) -> list[int]:
        """Tokens that would stop the request before min_tokens."""
        banned = set(req.params.stop_token_ids or ())
        if not req.params.ignore_eos:
            banned |= self.stop.eos
        return sorted(banned)
