"""The front end of the engine: validates and tokenizes requests, assigns seeds, builds each step's plan, drives
the ranks (`frontend/pipeline.py`), and turns their token deltas into outputs (`frontend/output_processor.py`).
"""

from __future__ import annotations

import bisect
import gc
import itertools
import logging
import operator
import os
import random
import sys
import time
import weakref
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from moebius.config import ConfigError, EngineConfig
from moebius.frontend.output_processor import FrontRequest, child_ids, child_seed
from moebius.frontend.pipeline import PlanPipeline
from moebius.frontend.timeline import ModeTimeline
from moebius.link.lifecycle import check_prompt, max_total_len, placement_weight
from moebius.link.messages import (
    Admit,
    KVStats,
    MemoryOrder,
    MemoryOutcome,
    Probe,
    Query,
    RankTimes,
    StepPlan,
    StepReport,
    StepWork,
    SwitchOrder,
    SwitchOutcome,
    UpdateGroupOrder,
    UpdateOutcome,
    WeightUpdate,
)
from moebius.link.request import RequestSpec
from moebius.link.tensor_handles import check_description, check_segment, export_tensors, open_tensors
from moebius.memory.kv_pool import KVPool
from moebius.memory.umm import TAGS
from moebius.models.builtin import BUILTIN_NOTICE
from moebius.models.loader import check_update
from moebius.models.source import check_update_checkpoint, resolve_model
from moebius.outputs import RequestOutput
from moebius.parallel.layout import MODES, Layout, check_shapes, tp_cuts_whole_blocks
from moebius.parallel.placement import Placement
from moebius.sampling_params import RequestOutputKind, SamplingParams
from moebius.switch import calibration as calibration_store
from moebius.switch.auto import AutoMode, engine_tokens, needs_calibration, resolve_mode
from moebius.switch.auto import build as build_auto
from moebius.switch.calibration import Calibration, CalibrationKey, calibrate, weights_label
from moebius.switch.policy import predicted_remaining
from moebius.worker.build import freeze_heap
from moebius.worker.launch import LocalRanks, SpawnedRanks, TorchrunRanks, serve_torchrun_rank, torchrun_env
from moebius.worker.rank import RankSpec
from moebius.worker.update_group import check_broadcast, check_group_order

log = logging.getLogger("moebius")

Prompt = str | list[int]


def _check_version(version: object) -> None:
    if version is not None and not isinstance(version, str):
        raise TypeError(f"weight_version must be a string or None, got {type(version).__name__} {version!r}")


def _check_mode(target: str) -> None:
    if target not in MODES:
        raise ValueError(f"mode must be {' or '.join(map(repr, MODES))}, got {target!r}")


PAUSE_MODES = ("abort", "retract", "keep", "wait")  # vLLM's names; SGLang's "in_place" is "keep"
PAUSE_ALIASES = {"in_place": "keep"}


def pause_mode(mode: object) -> str:
    """A pause mode by vLLM's or SGLang's name, as PAUSE_MODES spells it; ValueError naming any other value."""
    if not isinstance(mode, str) or PAUSE_ALIASES.get(mode, mode) not in PAUSE_MODES:
        raise ValueError(f"mode must be one of {[*PAUSE_MODES, *PAUSE_ALIASES]}, got {mode!r}")
    return PAUSE_ALIASES.get(mode, mode)


def memory_tags(tags: object) -> list[str]:
    """The tags of a memory release or resume: a list of "weights" / "kv_cache" (None: both)."""
    if tags is None:
        return list(TAGS)
    if not isinstance(tags, list | tuple) or not all(isinstance(t, str) for t in tags):
        raise TypeError(f"tags must be a list of strings out of {', '.join(TAGS)} (or None for all), got {tags!r}")
    for t in tags:
        if t not in TAGS:
            raise ValueError(f"memory tag {t!r} is not one of {', '.join(TAGS)}")
    return list(dict.fromkeys(tags))


def is_token_id(v: object) -> bool:
    """An integer that can be a token id: Python's or numpy's, never a bool (True is not token 1)."""
    return isinstance(v, int | np.integer) and not isinstance(v, bool | np.bool_)


def token_ids(prompt: list[Any] | tuple[Any, ...]) -> list[int]:
    """A prompt's token ids as Python ints; TypeError naming the first element that is not an integer."""
    for i, t in enumerate(prompt):
        if not is_token_id(t):
            raise TypeError(f"prompt token id {t!r} (position {i}) must be an integer, got {type(t).__name__}")
    return [operator.index(t) for t in prompt]


class EngineClosedError(RuntimeError):
    """The engine (or the LLM around it) was closed: nothing runs on it any more."""


class EngineStateError(RuntimeError):
    """A call the engine cannot take in its present state (memory released, requests in flight); it changed
    nothing (the server answers 409)."""


class EngineCore:
    def __init__(self, ecfg: EngineConfig) -> None:
        self.config = ecfg
        resolved = resolve_model(ecfg)
        self.model_config = cfg = resolved.config
        self.tokenizer = resolved.tokenizer
        if resolved.is_builtin:
            log.warning(BUILTIN_NOTICE)
        device = ecfg.device if ecfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        if device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("--device cuda, but torch sees no CUDA GPU here (use --device cpu or auto)")
        dtype = ecfg.dtype if ecfg.dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")
        self.max_model_len = ecfg.max_model_len or cfg.max_position_embeddings
        if self.max_model_len > cfg.max_position_embeddings:
            raise ConfigError(f"max_model_len {self.max_model_len} exceeds the model's max_position_embeddings "
                              f"{cfg.max_position_embeddings}")
        env = torchrun_env()
        self.world_size = env[1] if env else ecfg.num_ranks
        check_shapes(cfg, self.world_size)
        start, auto, self.held_layouts = resolve_mode(ecfg, self.world_size, tp_cuts_whole_blocks(cfg, self.world_size))
        spec = RankSpec(
            engine=ecfg, model=cfg, checkpoint=resolved.checkpoint, device=device, dtype=dtype,
            eos_token_ids=resolved.eos_token_ids, max_model_len=self.max_model_len, mode=start, held=self.held_layouts)
        if env and env[1] > 1:
            if env[0] != 0:  # a torchrun rank other than 0 follows rank 0's plans until it shuts down
                serve_torchrun_rank(spec)
                # Skip interpreter teardown: C++ destructors of the communication threads can race rank 0's exit
                # (it hosts the rendezvous store) and abort an otherwise finished rank.
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(0)
            self.ranks: LocalRanks | SpawnedRanks | TorchrunRanks = TorchrunRanks(spec)
        elif self.world_size > 1 or ecfg.rank_process == "on":
            self.ranks = SpawnedRanks(spec, self.world_size)
        else:
            self.ranks = LocalRanks(spec)
        # an engine dropped without close() still ends its ranks in order (and at interpreter exit)
        self._close_ranks = weakref.finalize(self, self.ranks.close)
        self.kv_capacity = self.ranks.kv_capacity
        self.layout = Layout(cfg, start, 0, self.world_size)  # the active layout, as rank 0 holds it
        self._kv_stats: list[KVStats] = []
        self.placement = Placement(self.world_size)  # which rank runs each live request, where the layout places them
        self.device, self.dtype = device, dtype
        self.eos_token_ids = resolved.eos_token_ids
        self._rng = random.Random(ecfg.seed)
        self._ids = itertools.count()
        self._arrivals = itertools.count()
        self._requests: dict[str, FrontRequest] = {}  # live: admitted, not finished
        self._child_to_parent: dict[str, tuple[FrontRequest, int]] = {}  # a rank-side request -> its request, sample
        self._pending = StepPlan()  # the next plan's admissions and switch order
        self._ends: list[str] = []  # rank-side requests the front end ended (abort, stop string): the ranks run them
        self._retired: list[str] = []  # requests placed on an EP rank that finished: the others forget their specs
        self._pipeline = PlanPipeline(self.ranks, ecfg.plans_ahead)
        self.last_switch: SwitchOutcome | None = None  # outcome of the last switch (the policy's or an operator's)
        self.weight_version: str | None = None  # the caller's name for the weights held (update_weights)
        self.update_groups: set[str] = set()  # trainers' process groups every rank joined (update_group.py)
        self.closed = False
        self.paused = False  # pause_generation: no step runs until resume_generation (requests are still taken)
        self.released: frozenset[str] = frozenset()  # memory tags released (no step runs while any is)
        self._undelivered: list[RequestOutput] = []  # outputs the next step() returns
        self.timeline = ModeTimeline(time.perf_counter())
        self.last_work = StepWork()  # what the step launched by the last step() computes (benchmarks price it)
        self._preemptions = 0  # requests preempted so far (KV freed to make room; they recompute)
        self._steps = self._tokens = 0  # steps run and output tokens made so far (the timeline's samples)
        self.last_times = RankTimes()  # rank 0's times for the last step() (benchmarks: host-bound or device-bound)
        self._rank_total = RankTimes()  # ... summed over every step so far (the timeline's samples)
        self._times_taken: deque[RankTimes] = deque(maxlen=64)  # ... of each step taken in, for take_times()
        self._switch_reason = ""  # why the pending switch was asked for
        self._finished_lengths: list[int] = []  # output lengths of finished samples, sorted (the cost policy's)
        # KV tokens each held layout holds a rank and engine-wide (the start layout's pool asked once; see
        # _layout_kv_tokens): what kv_stats reports and auto mode's policy checks a switch's target against
        self.kv_rank_tokens = self._layout_kv_tokens(ecfg.block_size, getattr(torch, dtype))
        self.kv_capacity_by_layout = {m: engine_tokens([n] * self.world_size, Layout(cfg, m, 0, self.world_size)
                                                       .data_parallel) for m, n in self.kv_rank_tokens.items()}
        self.auto: AutoMode | None = None
        if auto:
            self.set_auto(build_auto(ecfg, self.calibration() if needs_calibration(ecfg) else None))
            assert self.auto is not None
            log.info("auto mode, starting in %s: %s", start, self.auto.note)
        freeze_heap()  # the front end's start-up, as each rank froze its own

    @property
    def mode(self) -> str:
        """The active layout: "tp" or "ep"."""
        return self.layout.mode

    def set_auto(self, auto: AutoMode | None) -> None:
        """Let `auto` decide the layout from the next step on (None: only explicit switches). Its capacities are
        this engine's pools' (a kept calibration's may predate them, or lack them)."""
        if auto is not None:
            auto.capacity = dict(self.kv_capacity_by_layout)
        self.auto = auto

    def _layout_kv_tokens(self, block_size: int, dtype: torch.dtype) -> dict[str, int]:
        """KV tokens a rank's pool holds in each held layout (page 0 reserved): the start layout's pool as the ranks
        report it, and the other's pages cut from the same bytes as worker/build.py cuts them (a layout holding
        more KV heads a rank makes fewer pages)."""
        start = self.layout
        held = self.held_layouts
        cfg, P = self.model_config, self.world_size
        page_bytes = {m: KVPool.page_bytes(block_size, cfg.kv_spec, Layout(cfg, m, 0, P).num_kv_heads, dtype)
                      for m in held}
        start_pages = min(a["kv_tokens"] for a in self.query(Query.MEMORY)) // block_size + 1
        kv_bytes = start_pages * page_bytes[start.mode]
        return {m: (kv_bytes // b - 1) * block_size for m, b in page_bytes.items()}

    def kept_calibration(self) -> Calibration | None:
        """The calibration profile kept for this model, ranks, GPU, dtype and step settings, if any (nothing is
        measured)."""
        return calibration_store.load(self.config.calibration_dir or calibration_store.default_dir(),
                                      self._calibration_key())

    def _calibration_key(self) -> CalibrationKey:
        c = self.config
        graphs = ("eager" if c.disable_cuda_graph or self.device != "cuda"
                  else f"graphs to batch {c.cuda_graph_max_bs} / {c.cuda_graph_max_tokens} tokens")
        return CalibrationKey(c.model or "builtin", self.model_config.num_layers, self.world_size,
                              torch.cuda.get_device_name() if self.device == "cuda" else "cpu",
                              weights_label(self.dtype, c.quantization, c.fp8_activations, c.quantization_scope),
                              f"budget {c.max_num_batched_tokens}, {graphs}, experts {c.moe_kernel}, mixed "
                              f"attention {c.mixed_attention}")

    def calibration(self, fresh: bool = False, batches: tuple[int, ...] | None = None, context: int = 256
                    ) -> Calibration:
        """The calibration profile of this model, ranks, GPU, dtype and step settings: the one kept from an earlier
        start, or measured now (the engine must be idle; at these global batches and cached tokens a request) and
        kept. fresh: measure again."""
        ecfg = self.config
        key = self._calibration_key()
        directory = ecfg.calibration_dir or calibration_store.default_dir()
        cal = None if fresh else calibration_store.load(directory, key)
        if cal is None:
            auto, self.auto = self.auto, None  # no switches but calibration's own while it times
            try:
                cal = calibrate(self, key, max_batch=min(ecfg.max_running_requests, ecfg.max_num_batched_tokens),
                                max_context=self.max_model_len, vocab=self.model_config.vocab_size,
                                kv_tokens=self.kv_capacity, budget=ecfg.max_num_batched_tokens, context=context,
                                capacity=self.kv_capacity_by_layout,
                                **({"batches": batches} if batches else {}))
            finally:
                self.auto = auto
            path = calibration_store.save(directory, cal)
            log.info("calibration kept in %s: %s", path, cal.summary())
        return cal

    # ---- requests ----
    def _tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(f"prompt is not valid text: character {e.start} ({prompt[e.start]!r}) has no UTF-8 "
                                 "form") from None
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer (the model directory has no tokenizer.json nor "
                                 "tiktoken.model); pass token ids or --tokenizer")
            ids = self.tokenizer.encode(prompt)
            if not ids:
                raise ValueError("prompt is empty after tokenization")
            return prompt, ids
        if not isinstance(prompt, list | tuple):
            raise TypeError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        ids = token_ids(prompt)
        if not ids:
            raise ValueError("prompt is empty (no token ids)")
        V = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < V]
        if bad:
            raise ValueError(f"prompt token id {bad[0]!r} is outside the vocabulary [0, {V})")
        return None, ids

    def _check_open(self) -> None:
        if self.closed:
            raise EngineClosedError("this engine was closed (close()): it runs nothing any more; build a new one")

    def validate(self, prompt: Prompt, params: SamplingParams) -> tuple[str | None, list[int]]:
        """Check one request without admitting it; returns (prompt text, prompt token ids)."""
        self._check_open()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        text, ids = self._tokenize(prompt)
        self._check_params(params, len(ids))
        return text, ids

    def _check_params(self, params: SamplingParams, num_prompt: int) -> None:
        """What a request's parameters must satisfy on this engine: room for max_tokens in the context, a tokenizer
        for stop strings, stop token ids in the vocabulary."""
        check_prompt(num_prompt, params.max_tokens, self.max_model_len, self.kv_capacity)
        if (params.return_routed_experts or params.return_prompt_routed_experts) \
                and not self.config.enable_return_routed_experts:
            raise ValueError("routed experts are recorded only on an engine started with "
                             "--enable-return-routed-experts (enable_return_routed_experts=True)")
        if params.stop_strings and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer (the model directory has no tokenizer.json nor "
                             "tiktoken.model)")
        V = self.model_config.vocab_size
        bad = [t for t in params.stop_token_ids or () if t >= V]
        if bad:  # (min_tokens masks them in the logits: an id beyond them would fail inside a rank)
            raise ValueError(f"stop_token_ids {bad[0]} is outside the vocabulary [0, {V})")

    def _free_id(self, n: int) -> str:
        """The next generated id that no live request (nor its n samples) uses: a caller's own ids may look alike."""
        while True:
            rid = str(next(self._ids))
            if rid not in self._requests and not any(c in self._child_to_parent for c in child_ids(rid, n)):
                return rid

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    validated: tuple[str | None, list[int]] | None = None,
                    output_kind: RequestOutputKind | None = None) -> str:
        """Admit one request (it goes to the ranks with the next step). output_kind: the outputs it returns, in
        place of its params' (`LLM.generate` asks for the final ones only)."""
        self._check_open()
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        text, ids = validated or self.validate(prompt, params)
        if request_id is not None and not isinstance(request_id, str):
            raise TypeError(f"request_id must be a string, got {type(request_id).__name__} {request_id!r}")
        # the request runs on a checked copy: the caller's object may change later (even in place), the copy not
        params = params.clone()
        self._check_params(params, len(ids))
        rid = request_id if request_id is not None else self._free_id(params.n)
        if rid in self._requests:
            raise ValueError(f"request id {rid!r} is already in use")
        children = child_ids(rid, params.n)
        taken = [c for c in children if c in self._child_to_parent]
        if taken:  # two requests with one id on the ranks would mix their tokens
            owner = self._child_to_parent[taken[0]][0].request_id
            raise ValueError(f"request id {rid!r} is already in use: its sample id {taken[0]!r} is one of request "
                             f"{owner!r}'s")
        base_seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        limit = max_total_len(self.max_model_len, self.kv_capacity)
        fr = FrontRequest.make(rid, text, ids, params, time.perf_counter(), output_kind or params.output_kind,
                               self.tokenizer)
        for i, child in enumerate(fr.children):
            self._child_to_parent[child] = (fr, i)
            owner = None
            if self.layout.data_parallel:
                beside = fr.children[0] if i and not self.config.disable_prefix_caching else None
                owner = self.placement.place(child, placement_weight(len(ids), params), beside)
            spec = RequestSpec(child, ids, params, child_seed(base_seed, i), limit, next(self._arrivals))
            self._pending.admit.append(Admit(spec, owner))
        self._requests[rid] = fr
        return rid

    def abort(self, request_id: str) -> None:
        """End a request now: its output (finish_reason "abort") comes with the next step(), which also frees its
        pages on the ranks. An id no live request has is ignored (it may have just finished)."""
        self._check_open()
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a string, got {type(request_id).__name__} {request_id!r}")
        fr = self._requests.get(request_id)
        if fr is None:
            return
        for child in fr.abort():
            self._end_on_ranks(child)
        self._collect([fr])

    def abort_all(self) -> list[str]:
        """Abort every live request (their outputs, finish_reason "abort" with the tokens they had, come with the
        next step() or pause_generation); returns their ids."""
        self._check_open()
        self._settle()  # the tokens of the steps in flight belong to the partial outputs
        ids = list(self._requests)
        for rid in ids:
            self.abort(rid)
        return ids

    def pause_generation(self, mode: str = "abort") -> list[RequestOutput]:
        """Stop stepping until resume_generation (new requests are still admitted and wait), around a weight update.
        mode "abort": every live request ends now with finish_reason "abort" and the tokens it had; "retract": every
        request goes back to waiting on its rank, its KV freed, and recomputes prompt + output so far after resume
        (under the weights of then); "keep" (SGLang's "in_place"): requests keep their KV and continue after resume;
        "wait" (vLLM's): steps run here until every request has finished, then the pause. Returns the outputs produced
        by the steps in flight (for "wait": every step's) and the aborts."""
        self._check_open()
        mode = pause_mode(mode)
        self._settle()  # no step of before the pause runs on after it
        if mode == "wait":
            if self.released and self.has_unfinished():
                self.check_resident("pause_generation(mode='wait') would wait forever")
            self.paused = False  # (from a pause already in place too: its requests run to their end)
            outs: list[RequestOutput] = []
            while self.has_unfinished():
                outs += self.step()
            self._undelivered[:0] = outs
        elif mode == "abort":
            self.abort_all()
            self._release_ended()  # their pages are free before any update
        elif mode == "retract":
            plan = self._next_plan(with_switch=False)
            plan.run, plan.retract = False, True
            self._call(plan)
        self.paused = True
        return self._deliver()

    def resume_generation(self) -> None:
        """Steps run again from the next step() on (a no-op when not paused)."""
        self._check_open()
        self.paused = False

    @property
    def held(self) -> bool:
        """Whether step() runs no step now: generation paused, or memory released."""
        return self.paused or bool(self.released)

    def check_resident(self, what: str, tags: Iterable[str] = TAGS) -> None:
        """A call that touches the buffer's memory under `tags` is refused while it is released (on the GPU the
        addresses are unmapped: a read would be an illegal address)."""
        gone = sorted(self.released.intersection(tags))
        if gone:
            raise EngineStateError(f"{what}: the engine's memory is released ({', '.join(gone)}): call "
                                   "resume_memory_occupation first")

    def release_memory_occupation(self, tags: Sequence[str] | None = None, keep_weights: bool = True
                                  ) -> MemoryOutcome:
        """Give back the memory of the unified buffer under `tags` ("weights", "kv_cache"; None: both) while
        keeping its addresses, so that after resume_memory_occupation every view and captured graph is valid
        (colocated training: the trainer takes the GPU meanwhile). keep_weights: the weights are kept in (pinned)
        host memory and restored on resume; False drops them (an update must write them after resume). No step runs
        while anything is released (requests are still taken and wait). Releasing the KV cache needs no request in
        flight (it flushes the prefix cache); a tag released already is left as it is."""
        self._check_open()
        tags = memory_tags(tags)
        if not isinstance(keep_weights, bool):
            raise TypeError(f"keep_weights must be a bool, got {keep_weights!r}")
        if "kv_cache" in tags and self._requests:
            raise EngineStateError(f"releasing the KV cache with {len(self._requests)} request(s) in flight would "
                                   "lose them: let them finish, or pause_generation(mode='abort') first")
        return self._memory(MemoryOrder(True, [t for t in tags if t not in self.released], keep_weights))

    def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> MemoryOutcome:
        """Map memory again under the released `tags` (None: all), at the same addresses: kept weights restored,
        the KV cache empty. Steps run again once nothing is released (and generation is not paused)."""
        self._check_open()
        tags = memory_tags(tags)
        return self._memory(MemoryOrder(False, [t for t in tags if t in self.released]))

    def _memory(self, order: MemoryOrder) -> MemoryOutcome:
        if not order.tags:
            return MemoryOutcome(True)
        self._settle()  # (before the plan is taken: what the steps in flight end is released with it)
        plan = self._next_plan(with_switch=False)  # a switch asked for rides on the next step after the resume
        plan.run, plan.memory = False, order
        outcome = self._call(plan).memory
        assert outcome is not None, "the ranks did not report the memory order"
        what = "release" if order.release else "resume"
        if not outcome.done:
            raise RuntimeError(f"memory {what} of {', '.join(order.tags)} failed on the ranks (every rank is as "
                               f"before): {outcome.reason}")
        self.released = (self.released | set(order.tags)) if order.release else (self.released - set(order.tags))
        log.info("memory %s of %s: %.2f GiB on rank 0 (%.2f GiB through the host) in %.2f s", what,
                 ", ".join(order.tags), outcome.nbytes / 2**30, outcome.host_bytes / 2**30, outcome.seconds)
        return outcome

    def discard(self, request_ids: Iterable[str]) -> None:
        """Abort these requests, and return none of their outputs, not even the final ones (a caller that gave up on
        them: an interrupted generate)."""
        gone = set(request_ids)
        for rid in gone:
            self.abort(rid)
        self._undelivered = [o for o in self._undelivered if o.request_id not in gone]

    def has_unfinished(self) -> bool:
        """Whether step() has work: live requests, requests ended here that the ranks still run, or outputs not
        returned yet."""
        return bool(self._requests or self._ends or self._undelivered)

    # ---- the loop ----
    def step(self) -> list[RequestOutput]:
        """Run one step on the ranks and return the outputs it (and any call since the last step) produced. With
        rank processes, the next step's plan (with --plans-ahead 2, the next two's) goes out as soon as this step's
        report is in, so the ranks schedule and launch it while this one's tokens become outputs here. A switch is
        never sent ahead, and nothing goes ahead of a switch's step (requests added in between are placed by the
        layout in use when they are added)."""
        self._check_open()
        if self.held:  # no step; what the front end ended is still released on the ranks
            self._release_ended()
            return self._deliver()
        if not (self._requests or self._ends or len(self._pipeline) or self._pending.switch is not None):
            return self._deliver()  # nothing for the ranks to do
        if len(self._pipeline) and self._pending.switch is not None:
            self._settle()  # a switch asked for rides on this call's step, as without a step in flight
        if not len(self._pipeline):
            self._pipeline.send(self._next_plan())
        plan, report = self._pipeline.receive()
        busy = bool(report.running or report.waiting or self._pending.admit or self._pipeline.admits_out())
        if plan.switch is None and busy:
            self._pipeline.top_up(self._plan_ahead)
        self._finish(plan, report)
        if not self._requests:  # idle: no plan is left out (a request added next starts with the next call), and
            self._release_ended()  # the ranks run nothing the front end ended
        return self._deliver()

    def _release_ended(self) -> None:
        """Read the steps in flight, then release on the ranks what the front end ended and they still run, in a
        plan without a step (before an idle engine waits, or a probe times steps)."""
        self._settle()
        if self._ends:
            plan = self._next_plan(with_switch=False)
            plan.run = False
            self._call(plan)

    def _deliver(self) -> list[RequestOutput]:
        outs, self._undelivered = self._undelivered, []
        return outs

    def take_times(self) -> list[RankTimes]:
        """Rank 0's times of each step taken in since the last call (the newest 64), for a reader that records every
        step: one step() may take in several (a settle before a switch, idle ranks with plans still out), and
        last_times holds only the last."""
        out = list(self._times_taken)
        self._times_taken.clear()
        return out

    @property
    def steps_taken(self) -> int:
        """Steps whose reports were taken in so far."""
        return self._steps

    @property
    def steps_in_flight(self) -> int:
        """Plans sent to the ranks whose reports are not read yet (0 when idle; between steps with rank processes,
        --plans-ahead)."""
        return len(self._pipeline)

    def _next_plan(self, with_switch: bool = True) -> StepPlan:
        """The pending plan, with the requests to release and, for a switch into EP, every live request placed."""
        plan, self._pending = self._pending, StepPlan()
        plan.release, self._ends, self._retired = self._ends + self._retired, [], []
        if not with_switch:  # (a query) a switch asked for rides on the next step
            plan.switch, self._pending.switch = None, plan.switch
        elif plan.switch is not None:
            to = Layout(self.model_config, plan.switch.target, 0, self.world_size)
            if to.data_parallel and not self.layout.data_parallel:
                weights = {c: placement_weight(len(fr.prompt_token_ids), fr.params)
                           for c, (fr, _) in self._child_to_parent.items()}
                plan.switch.owners = self.placement.repartition(weights)
        return plan

    def _plan_ahead(self) -> StepPlan | None:
        """The next plan to send ahead, unless a switch is asked for (it rides on a step of its own)."""
        return None if self._pending.switch is not None else self._next_plan()

    def settle(self) -> list[RequestOutput]:
        """Read the steps on their way to or on the ranks (rank processes get plans ahead) and return their outputs:
        afterwards no step runs until the next step() (a pause for an RL weight update)."""
        self._check_open()
        self._settle()
        return self._deliver()

    def _settle(self) -> None:
        """Read the steps in flight, if any, before a call that is not a step: their outputs go out with the next
        step()."""
        for plan, report in self._pipeline.drain():
            self._finish(plan, report)

    def _finish(self, plan: StepPlan, report: StepReport) -> None:
        """Take in a step's report: its tokens into the requests, stats, a switch it carried, the auto policy."""
        self.last_work, self.last_times = report.work, report.times
        self._rank_total += report.times
        self._times_taken.append(report.times)
        self._preemptions += report.work.preempted
        self._steps += 1
        self._take(plan, report)
        now = time.perf_counter()
        if self.timeline.due(now, self.mode):
            total = sum(k.total_tokens for k in report.kv)
            used = 1.0 - sum(k.free_tokens for k in report.kv) / total if total else 0.0
            self.timeline.sample(now, self.mode, report.running, report.waiting, used, self._steps, self._tokens,
                                 self._rank_total)
        if self.auto is not None and self._pending.switch is None:
            # the signal: requests in flight, running or queued (a burst counts before its prefill is through); a
            # target that cannot hold the live KV is declined by the policy before the ranks would refuse it
            decision = self.auto.observe(now, self.mode, report.running + report.waiting, self._remaining,
                                         self._kv_held)
            if decision is not None:
                self.request_switch(decision.target, reason=decision.reason)

    def _take(self, plan: StepPlan, report: StepReport) -> None:
        """What every report brings, a step's or not: KV statistics, switch outcomes, and the token deltas (of the
        step, or of the step in flight that a plan without one resolved), into outputs."""
        self._kv_stats = report.kv
        if report.switch_times is not None and self.last_switch is not None:  # a switch that rode on a step
            self.last_switch.device = report.switch_times
            self.timeline.complete(report.switch_times)
        if plan.switch is not None:  # the policy's (it rode on a step) or an operator's (a plan of its own)
            assert report.switch is not None, "the ranks did not report the switch"
            self.last_switch = self._switched(plan.switch.target, report.switch)
        now = time.perf_counter()
        touched: dict[str, FrontRequest] = {}
        for d in report.deltas:
            entry = self._child_to_parent.get(d.request_id)
            if entry is None or entry[0].ended(entry[1]):  # ended here (abort, stop string) while a step was on its way
                continue
            fr, i = entry
            try:
                if fr.take(i, d, now):
                    self._end_on_ranks(d.request_id)
            except Exception as e:  # noqa: BLE001 - this request's failure ends it with an error, not the engine
                log.warning("request %s failed and ends with finish_reason 'error': %s: %s", fr.request_id,
                            type(e).__name__, e)
                for child in fr.fail(i, f"{type(e).__name__}: {e}"):
                    self._end_on_ranks(child)
            touched[fr.request_id] = fr
            self._tokens += len(d.new_token_ids)
        self._collect(touched.values())

    def _kv_held(self) -> int:
        """KV tokens the live requests hold engine-wide, in whole pages (what a switch moves; cached pages no
        request holds are free), as of the last report."""
        return engine_tokens([k.total_tokens - k.free_tokens for k in self._kv_stats], self.layout.data_parallel)

    def _remaining(self) -> list[int]:
        """Predicted remaining output tokens of every request in flight (the cost policy's input)."""
        max_left, produced = [], []
        for fr, i in self._child_to_parent.values():
            n = len(fr.samples[i].out.token_ids)
            limit = fr.params.max_tokens or (max_total_len(self.max_model_len, self.kv_capacity)
                                             - len(fr.prompt_token_ids))
            max_left.append(limit - n)
            produced.append(n)
        return predicted_remaining(max_left, produced, self._finished_lengths)

    def _collect(self, touched: Iterable[FrontRequest]) -> None:
        """The outputs of the requests that changed; the finished ones leave the front end."""
        for fr in touched:
            out = fr.output()
            if out is not None:
                out.weight_version = self.weight_version
                self._undelivered.append(out)
            if fr.finished:
                self._retire(fr)

    def _end_on_ranks(self, child: str) -> None:
        """The front end ended this rank-side request (abort, stop string): the next plan releases it."""
        fr, i = self._child_to_parent[child]
        fr.samples[i].released = True
        self._ends.append(child)

    def _retire(self, fr: FrontRequest) -> None:
        del self._requests[fr.request_id]
        for c, s in zip(fr.children, fr.samples, strict=True):
            if s.out.finish_reason not in ("abort", "error"):  # (the cost policy's lengths of requests that ran out)
                bisect.insort(self._finished_lengths, len(s.out.token_ids))
            del self._child_to_parent[c]
            if self.placement.release(c) is not None and not s.released:  # an EP rank's: the others forget its spec
                self._retired.append(c)

    def switch_mode(self, target: str, reason: str = "operator") -> SwitchOutcome:
        """Switch every rank to `target` ("tp" | "ep") between two steps, keeping every request in flight, and
        return its outcome (`SwitchOutcome`: done, or why it was refused, and where its time went). reason: why (the
        mode timeline keeps it)."""
        self._check_open()
        _check_mode(target)
        self.check_resident(f"switch to {target}")
        self._settle()  # the switch moves what the step in flight leaves
        self._switch_reason = reason
        self._pending.switch = SwitchOrder(target)
        plan = self._next_plan()
        plan.run = False
        report = self._call(plan)
        assert report.switch is not None, "the ranks did not report the switch"
        return report.switch

    def _call(self, plan: StepPlan | Probe) -> StepReport:
        """A call that is not a step (a switch alone, a query, a probe), with no step in flight."""
        self._settle()
        if isinstance(plan, StepPlan):
            self._pipeline.send(plan)
            _, report = self._pipeline.receive()
            self._take(plan, report)
            return report
        self.ranks.send(plan)
        return self.ranks.receive()

    def request_switch(self, target: str, reason: str = "operator") -> None:
        """Switch at the start of the next step(), in the same round trip to the ranks as that step (the lowest
        latency from decision to the first step in the new layout). The outcome lands in `last_switch`; its device
        times join it with the step after, so that neither the first step in the new layout nor its tokens wait on
        the host for the end of the transfers."""
        self._check_open()
        _check_mode(target)
        self._pending.switch, self._switch_reason = SwitchOrder(target), reason

    def _switched(self, target: str, outcome: SwitchOutcome) -> SwitchOutcome:
        now, source = time.perf_counter(), self.mode
        if outcome.done:
            self.layout = Layout(self.model_config, target, 0, self.world_size)
            log.info("switch %s -> %s (%s)", source, target, self._switch_reason)
        else:
            log.warning("switch to %s (%s) refused: %s", target, self._switch_reason, outcome.reason)
        if not self.layout.data_parallel:  # nothing placed (a refused switch into EP placed its requests in vain)
            self.placement.clear()
        if source != target:  # (a switch to the layout in use is refused at once: no event)
            self.timeline.switch(now, outcome, self._switch_reason if outcome.done else str(outcome.reason))
            if self.auto is not None:
                (self.auto.switched if outcome.done else self.auto.refused)(now)
        return outcome

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                       weight_version: str | None = None) -> UpdateOutcome:
        """Write new values of some or all of the model's weights, by their Hugging Face checkpoint names (experts
        one by one or fused, any floating dtype, any device), into the running engine between two steps. Every name,
        shape and dtype is checked first: a bad one raises naming it and nothing is written. The prefix cache is
        flushed; requests in flight continue on the new weights; `weight_version` is reported on every output from
        now on."""
        self._check_open()
        _check_version(weight_version)
        tensors = check_update(self.model_config, named_tensors)
        update = WeightUpdate()
        if isinstance(self.ranks, LocalRanks):
            update.local = tensors  # the rank is in this process: it reads them where they are
            return self._update(update, weight_version)
        # rank processes: CUDA tensors by IPC handle (no copy), CPU ones copied once into shared memory
        with export_tensors(tensors) as update.handles:  # (kept alive until every rank has read them)
            return self._update(update, weight_version)

    def update_weights_from_handles(self, description: Mapping[str, Any], weight_version: str | None = None
                                    ) -> UpdateOutcome:
        """`update_weights` with tensors another process of this machine exported by handle
        (`link/tensor_handles.export_tensors`: CUDA IPC handles, a shared-memory segment), read where they lie. The
        description and every name, shape and dtype are checked before anything is opened (ValueError naming the
        first bad one); a handle a rank cannot open (another machine, a GPU it does not see) refuses the update on
        every rank, naming why. The exporter keeps its tensors until this returns."""
        self._check_open()
        _check_version(weight_version)
        description = self.check_handles(description)
        if not isinstance(self.ranks, LocalRanks):  # every rank opens them itself
            return self._update(WeightUpdate(handles=description), weight_version)
        tensors, opener = open_tensors(description)
        update = WeightUpdate()
        update.local = check_update(self.model_config, tensors)
        try:
            return self._update(update, weight_version)
        finally:  # the copies out of the exporter's memory are done before it may change it
            opener.synchronize(torch.device(self.device))

    def check_handles(self, description: Mapping[str, Any]) -> dict[str, Any]:
        """A description of tensors by handle checked, field by field, then every name, shape and dtype against the
        model and its segment on this machine, without opening anything (ValueError naming the first bad one)."""
        description = check_description(description)
        # stand-ins of the described shapes and dtypes (one element each, expanded): the checks read nothing else
        check_update(self.model_config, [
            (t["name"], torch.empty([1] * len(t["shape"]), dtype=getattr(torch, t["dtype"])).expand(t["shape"]))
            for t in description["tensors"]])
        check_segment(description)
        return description

    def update_weights_from_disk(self, path: str, weight_version: str | None = None) -> UpdateOutcome:
        """`update_weights` from a safetensors directory of the model's architecture and shapes (its config.json,
        where there is one, and every tensor's header checked before a byte is written); every rank reads its own
        cut of the files."""
        self._check_open()
        _check_version(weight_version)
        check_update_checkpoint(path, self.model_config)
        return self._update(WeightUpdate(path=os.path.abspath(path)), weight_version)

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str, backend: str = "gloo") -> None:
        """Join a trainer's process group (SGLang's protocol, `worker/update_group.py`): rank 0 is the trainer's, the
        engine's rank r is `rank_offset + r` of `world_size`. Blocks until the trainer and every rank joined; the
        trainer calls its side at the same time. ValueError naming a bad argument; RuntimeError if a rank failed
        (then no rank is in the group)."""
        self._check_open()
        order = UpdateGroupOrder(group_name, True, master_address, int(master_port), int(rank_offset),
                                 int(world_size), backend)
        check_group_order(order, self.world_size, self.device == "cuda")
        if group_name in self.update_groups:
            raise ValueError(f"process group {group_name!r} is joined already (destroy it first)")
        self._group_call(order)
        self.update_groups.add(group_name)

    def destroy_weights_update_group(self, group_name: str) -> None:
        """Leave a trainer's process group joined by `init_weights_update_group`; ValueError if none by that name."""
        self._check_open()
        if group_name not in self.update_groups:
            raise ValueError(f"no process group {group_name!r} joined (joined: {sorted(self.update_groups)})")
        self.update_groups.discard(group_name)  # (gone on the front end even if a rank failed to leave it cleanly)
        self._group_call(UpdateGroupOrder(group_name, init=False))

    def update_weights_from_distributed(self, names: Sequence[str], dtypes: Sequence[str],
                                        shapes: Sequence[Sequence[int]], group_name: str | None = None,
                                        weight_version: str | None = None, load_format: str | None = None
                                        ) -> UpdateOutcome:
        """`update_weights` with tensors the trainer's rank 0 broadcasts in the group, one broadcast each in the
        order of `names`. Every name, shape and dtype is checked here first: a bad one raises ValueError naming it
        before any rank waits for a byte, so a trainer that learns of the refusal must not broadcast (SGLang's
        contract: the trainer issues this call, and broadcasts only while it has not returned an error).
        `group_name`: which group (may be left out when one is joined). load_format "flattened_bucket": SGLang's
        bucket, every tensor's bytes back to back in one uint8 broadcast."""
        self._check_open()
        _check_version(weight_version)
        if group_name is None and len(self.update_groups) == 1:
            group_name = next(iter(self.update_groups))
        if group_name not in self.update_groups:
            raise ValueError(f"no process group {group_name!r} joined (joined: {sorted(self.update_groups)}): "
                             "call init_weights_update_group first")
        meta = check_broadcast(self.model_config, group_name, names, dtypes, shapes, load_format)
        return self._update(WeightUpdate(broadcast=meta), weight_version)

    def _group_call(self, order: UpdateGroupOrder) -> None:
        self._settle()
        plan = self._next_plan(with_switch=False)
        plan.run, plan.update = False, WeightUpdate(group=order)
        outcome = self._call(plan).update
        assert outcome is not None, "the ranks did not report the process group order"
        if not outcome.done:
            raise RuntimeError(f"{'joining' if order.init else 'leaving'} process group {order.group_name!r} "
                               f"failed: {outcome.reason}")
        log.info("%s the trainer's process group %r", "joined" if order.init else "left", order.group_name)

    def _update(self, update: WeightUpdate, weight_version: str | None) -> UpdateOutcome:
        """Send a checked update in a plan of its own (after the steps in flight) and take in its outcome."""
        self.check_resident("weight update", ["weights"])
        self._settle()  # (before the plan is taken: what the steps in flight end is released with it)
        plan = self._next_plan(with_switch=False)  # a switch asked for rides on the next step, after the update
        plan.run, plan.update = False, update
        outcome = self._call(plan).update
        assert outcome is not None, "the ranks did not report the weight update"
        if not outcome.done:
            raise RuntimeError(f"weight update refused on the ranks: {outcome.reason}")
        self.weight_version = weight_version
        log.info("weights updated (version %r): %d views rewritten, %d cached pages dropped", weight_version,
                 outcome.views, outcome.flushed_pages)
        return outcome

    def query(self, query: Query | str) -> list[Any]:
        """Each rank's answer to a diagnostic question without a step (`Query`: fingerprint, memory, requests,
        kernels, comm, heap, reset_prefix_cache)."""
        self._check_open()
        q = query if isinstance(query, Query) else Query(query)
        if q is Query.FINGERPRINT:  # (reads the weights and the KV pages)
            self.check_resident("fingerprint query")
        self._settle()  # (before the plan is taken: what the steps in flight end is released with it)
        plan = self._next_plan(with_switch=False)
        plan.run, plan.query = False, q
        report = self._call(plan)
        return report.answers or []

    def probe(self, probe: Probe) -> list[dict[str, Any]]:
        """Time steps on every rank outside the serving path (a benchmark's hook: `DecodeProbe`, `PrefillProbe`);
        the engine must be idle. Each rank's timings."""
        self._check_open()
        if self._requests:
            raise RuntimeError("probe: the engine is serving requests; time steps on an idle engine")
        self.check_resident("probe")
        self._release_ended()
        return self._call(probe).answers or []

    def reset_prefix_cache(self) -> int:
        """Forget every cached page on every rank (later requests compute their prompts in full until steps cache
        them again); returns the pages dropped, summed over ranks."""
        return sum(r["pages"] for r in self.query(Query.RESET_PREFIX_CACHE))

    def kv_stats(self) -> dict[str, object]:
        """The KV cache as of the last report from the ranks.

        free_tokens / total_tokens: tokens engine-wide in the active layout: in EP the ranks' sum (each request's
        cache on one rank); in TP one rank's (every request's cache on every rank: its share of the KV heads, or
        all of a replicated cache, MLA's latent or GQA's heads below P), so TP's total is what TP can hold.
        capacity: total_tokens each held layout has engine-wide ("tp", "ep"; MLA's TP 1/P of EP's).
        per_rank: each rank's pool, free_tokens / total_tokens (pages but the reserved one, in tokens).
        preemptions: requests preempted so far to make room (they recompute their tokens)."""
        self._check_open()
        n = self.kv_rank_tokens[self.mode]
        per_rank = self._kv_stats or [KVStats(n, n)] * self.world_size
        dp = self.layout.data_parallel
        return {"free_tokens": engine_tokens([r.free_tokens for r in per_rank], dp),
                "total_tokens": engine_tokens([r.total_tokens for r in per_rank], dp),
                "capacity": dict(self.kv_capacity_by_layout), "preemptions": self._preemptions,
                "per_rank": [{"free_tokens": r.free_tokens, "total_tokens": r.total_tokens} for r in per_rank]}

    def close(self) -> None:
        """Stop the ranks; every later call but close() raises EngineClosedError."""
        self.closed = True
        self._close_ranks()
        # what start-up froze may now be garbage (an engine's objects hold cycles, and its tensors with them): the
        # collector walks it again, so another engine built in this process finds the memory free
        gc.unfreeze()

    def __enter__(self) -> EngineCore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
