"""Building one rank: its unified buffer (dense weights of both layouts, static buffers per mode, N + 1 slots of experts
and KV, or more: `parallel.layout.slot_shifts`; a slot of dense layers only holds no experts, `layout.expert_slots`),
the start layout's weights, a runtime per layout, and, once every rank is built, the start-up steps that run
collectives (switch paths, symmetric-memory exchanges, CUDA graph capture).
"""

from __future__ import annotations

import gc
import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from moebius.config import ConfigError, EngineConfig
from moebius.kernels import KernelConfig
from moebius.kernels.flash import use_flash
from moebius.link.lifecycle import StopRules
from moebius.memory.kv_pool import CPU_DEFAULT_KV_TOKENS, MIN_PAGES, KVPool, kv_budget, window_pages
from moebius.memory.umm import MemoryPlan, UnifiedMemory
from moebius.models.loader import Checkpoint, DummyCheckpoint, load_weights
from moebius.models.registry import family_of
from moebius.parallel.dispatch import symmetric_memory_available
from moebius.parallel.groups import Groups, all_gather_json
from moebius.parallel.layout import (
    Layout,
    check_quantized_layouts,
    check_shapes,
    expert_slots,
    slot_groups,
    slot_shifts,
)
from moebius.switch.executor import Switcher, SwitchOptions
from moebius.worker.rank import ModeRuntime, Rank, RankSpec
from moebius.worker.runner import ModelRunner, StaticBuffers
from moebius.worker.warmup import fresh_chunk_lengths, warm_up

log = logging.getLogger("moebius")

GiB = 2**30


@dataclass(frozen=True)
class BufferSizes:
    """Bytes of a rank's unified buffer besides its KV pages, by what asks for them (an error names them)."""

    dense: int  # dense weights of every held layout, the RoPE table
    static: int  # step buffers sized by --max-num-batched-tokens, --max-running-requests, --max-model-len
    expert: int  # one layer slot's expert weights
    slot_experts: tuple[bool, ...]  # whether each layer slot holds experts (`layout.expert_slots`)

    @property
    def experts(self) -> int:
        return self.expert * sum(self.slot_experts)

    def slot_expert_bytes(self) -> list[int]:
        return [self.expert if e else 0 for e in self.slot_experts]


def _num_pages(ecfg: EngineConfig, device: torch.device, sizes: BufferSizes, kv_bytes: Callable[[int], int],
               max_model_len: int) -> int:
    """The first KV group's pages in the start layout: by --max-total-tokens, the CPU default, or the most that
    --mem-fraction of the GPU leaves room for after the weights and step buffers, the slots' KV bytes being
    `kv_bytes(pages)` (`SlotKV.total`); ConfigError naming the setting and the numbers when no page is usable."""
    pages = kv_budget(ecfg.max_total_tokens, ecfg.block_size, device.type)
    if pages is not None:
        return pages
    free, total = torch.cuda.mem_get_info(device)
    allowed = min(free, int(total * ecfg.mem_fraction))
    experts = sizes.experts
    left = allowed - sizes.dense - sizes.static - experts
    pages, more = 0, 1  # the most pages whose KV fits in `left` (kv_bytes grows with pages)
    while kv_bytes(more) <= left:
        pages, more = more, 2 * more
    while more - pages > 1:
        mid = (pages + more) // 2
        pages, more = (mid, more) if kv_bytes(mid) <= left else (pages, mid)
    if pages < MIN_PAGES:
        raise ConfigError(
            f"--mem-fraction {ecfg.mem_fraction} of {device} ({total / GiB:.1f} GiB, {free / GiB:.1f} GiB free) gives "
            f"the unified buffer {allowed / GiB:.2f} GiB; the weights take {(sizes.dense + experts) / GiB:.2f} GiB of "
            f"it ({experts / GiB:.2f} GiB of experts in {sum(sizes.slot_experts)} of {len(sizes.slot_experts)} "
            f"layer slots) and the step buffers "
            f"{sizes.static / GiB:.2f} GiB (--max-num-batched-tokens {ecfg.max_num_batched_tokens}, "
            f"--max-running-requests {ecfg.max_running_requests}, --max-model-len {max_model_len}), leaving "
            f"{left / GiB:.2f} GiB, where {MIN_PAGES} KV pages of --block-size {ecfg.block_size} tokens in every "
            f"layer slot take {kv_bytes(MIN_PAGES) / GiB:.2f} GiB (page 0 is reserved): raise "
            "--mem-fraction, spread the model over more ranks (--num-ranks), or lower --max-num-batched-tokens or "
            "--max-model-len")
    return int(pages)


@dataclass(frozen=True)
class SlotKV:
    """How a rank's KV cache spreads over its layer slots: each slot's KV region holds a page table's pages of the
    KV groups whose layers it holds in some held layout (`slot_groups`); a window group after the first holds at
    most `caps[g]` bytes a layer, what its allocator can give out in any layout (`window_pages`), so that the memory
    a sliding layer's slot leaves goes to the first group's pages (GPT-OSS: `parallel.layout.slot_shifts` keeps its
    sliding layers' slots apart from its full layers')."""

    slot_groups: tuple[frozenset[int], ...]
    caps: tuple[int | None, ...]  # a group's most bytes a layer (None: the first's, sized by the budget)
    page_bytes: int  # the start layout's

    def group_bytes(self, pages: int) -> list[int]:
        """One layer's KV bytes in each group, the first group having `pages` pages of the start layout."""
        first = pages * self.page_bytes
        return [first if cap is None else min(first, cap) for cap in self.caps]

    def slot_bytes(self, pages: int) -> list[int]:
        """Each slot's KV bytes (0 in a slot no held layout puts a layer in)."""
        group = self.group_bytes(pages)
        return [max((group[g] for g in held), default=0) for held in self.slot_groups]

    def total(self, pages: int) -> int:
        return sum(self.slot_bytes(pages))


def _slot_layout(ecfg: EngineConfig, device: torch.device, layouts: dict[str, Layout], start: str,
                 page_bytes: dict[str, int], sizes: BufferSizes, max_model_len: int
                 ) -> tuple[dict[str, Layout], SlotKV, int, BufferSizes]:
    """The layouts at the slot shift (`layout.slot_shifts`) that leaves the first KV group the most pages
    (--mem-fraction), or the buffer the fewest bytes (a KV budget in tokens), with their `SlotKV`, the start
    layout's first-group pages and the sizes at that shift (its slots of experts); the first shift's ConfigError
    where none leaves a page."""
    cfg, fixed = layouts[start].cfg, kv_budget(ecfg.max_total_tokens, ecfg.block_size, device.type) is not None
    best: tuple[float, dict[str, Layout], SlotKV, int, BufferSizes] | None = None
    error: ConfigError | None = None
    for shift in slot_shifts(cfg):
        lays = {m: replace(lay, slot_shift=shift) for m, lay in layouts.items()}
        slot_kv = _slot_kv(ecfg, lays, start, page_bytes)
        shifted = replace(sizes, slot_experts=tuple(expert_slots(cfg, lays, shift)))
        try:
            pages = _num_pages(ecfg, device, shifted, slot_kv.total, max_model_len)
        except ConfigError as e:
            error = error or e
            continue
        score = -(shifted.experts + slot_kv.total(pages)) if fixed else pages
        if best is None or score > best[0]:
            best = (score, lays, slot_kv, pages, shifted)
    if best is None:
        assert error is not None
        raise error
    return best[1:]


def _slot_kv(ecfg: EngineConfig, layouts: dict[str, Layout], start: str, page_bytes: dict[str, int]) -> SlotKV:
    cfg = layouts[start].cfg
    shift = layouts[start].slot_shift
    caps = [None if g == 0 or grp.window is None else
            max(b * window_pages(grp.window, ecfg.block_size, ecfg.max_running_requests, ecfg.max_num_batched_tokens)
                for b in page_bytes.values())
            for g, grp in enumerate(cfg.kv_groups)]
    return SlotKV(tuple(slot_groups(cfg, layouts, shift)), tuple(caps), page_bytes[start])


def _kv_setting(ecfg: EngineConfig, device: torch.device) -> str:
    """The flag that sized the KV cache, with its value."""
    if ecfg.max_total_tokens is not None:
        return f"--max-total-tokens {ecfg.max_total_tokens}"
    if device.type != "cuda":
        return f"the CPU's default KV budget of {CPU_DEFAULT_KV_TOKENS} tokens (--max-total-tokens unset)"
    return f"--mem-fraction {ecfg.mem_fraction}"


def _layout_pages(ecfg: EngineConfig, device: torch.device, layouts: dict[str, Layout], start: str,
                  start_pages: int, page_bytes: dict[str, int], group_bytes: list[int]) -> dict[str, list[int]]:
    """The pages each held layout makes of each KV group's bytes a layer (`group_bytes`; the first group's: the
    start layout's `start_pages`; a layout holding more KV heads a rank makes fewer); ConfigError naming the
    layout, the setting and the numbers when one has no usable page."""
    pages = {m: [n // b for n in group_bytes] for m, b in page_bytes.items()}
    for m, (n, *_) in pages.items():
        if n < MIN_PAGES:
            bs = ecfg.block_size
            least = -(-MIN_PAGES * page_bytes[m] // page_bytes[start]) * bs
            raise ConfigError(
                f"the {m.upper()} layout holds {layouts[m].num_kv_heads} KV heads a rank against the "
                f"{start.upper()} layout's {layouts[start].num_kv_heads}, so the KV bytes of "
                f"{_kv_setting(ecfg, device)} ({start_pages} {start.upper()} pages of --block-size {bs} tokens) make "
                f"{n} {m.upper()} page{'s' if n != 1 else ''}, and page 0 is reserved: no page is left for its "
                f"requests; set --max-total-tokens to at least {least}, lower --block-size, or hold one layout "
                "(--static-layout)")
    return pages


def _available_bytes(device: torch.device) -> int | None:
    """Memory the buffer may take on `device` now: the GPU's free bytes, the machine's MemAvailable on the CPU
    (None where the kernel does not say)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _check_fits(ecfg: EngineConfig, device: torch.device, total: int, kv_bytes: int, slots: int) -> None:
    """A buffer larger than the memory there is, refused before allocating it (on the CPU, zero-filling it would
    bring the out-of-memory killer, not an error), naming the setting that sized its KV cache."""
    available = _available_bytes(device)
    if available is not None and total > available:
        raise ConfigError(
            f"the unified buffer of this rank would take {total / GiB:.2f} GiB ({kv_bytes / GiB:.2f} GiB "
            f"of it the KV cache of {_kv_setting(ecfg, device)} over {slots} layer slots, "
            f"{(total - kv_bytes) / GiB:.2f} GiB weights and step buffers), more than the "
            f"{available / GiB:.2f} GiB {device} has available: lower --max-total-tokens (or cut --num-layers)")


def build_rank(spec: RankSpec, groups: Groups | None = None) -> Rank:
    """Allocate, load and assemble one rank (no collectives: `prepare_rank` runs those once every rank is built)."""
    ecfg, cfg = spec.engine, spec.model
    groups = groups or Groups(0, 1, None, None)
    device = torch.device(spec.device)
    if device.type == "cpu":
        torch.set_num_threads(ecfg.cpu_threads)
    dtype = getattr(torch, spec.dtype)
    check_shapes(cfg, spec.world_size)
    family = family_of(cfg)
    # families whose GPU paths are written but not yet run on a GPU: their GPU tests name them
    unchecked = os.environ.get("MOEBIUS_UNCHECKED_GPU", "").split(",")
    if family.cpu_only and device.type != "cpu" and family.name not in unchecked:
        raise ConfigError(f"the {family.name} family ({', '.join(family.architectures)}) cannot run on {device} yet: "
                          f"{family.cpu_only}; serve it with --device cpu (MOEBIUS_UNCHECKED_GPU={family.name} lets "
                          "its GPU tests run it)")
    # Both layouts resident (the switchable engine), or only the start one (--static-layout, for comparison; a
    # quantized model TP cannot cut: `switch.auto.resolve_mode`).
    held = spec.held
    if spec.mode not in held:
        raise ValueError(f"rank spec starts in {spec.mode} but holds {held}")
    check_quantized_layouts(cfg, spec.world_size, held)
    layouts = {m: Layout(cfg, m, spec.rank, spec.world_size) for m in held}  # (their slot shift: below)
    start, bs, elt = layouts[spec.mode], ecfg.block_size, dtype.itemsize

    # One plan for both modes: dense regions (shared where the shard is equal), static buffers, slots.
    plan = MemoryPlan()
    family.plan_weights(plan, cfg, list(layouts.values()), dtype)
    dense_bytes = plan.total_bytes
    max_pages_per_seq = -(-spec.max_model_len // bs)
    buf_shape = (ecfg.max_num_batched_tokens, ecfg.max_running_requests, max_pages_per_seq, len(cfg.kv_groups))
    for m in held:
        StaticBuffers.plan(plan, m, *buf_shape)
    expert_bytes = -(-start.expert_bytes(elt) // 256) * 256  # the same in both modes
    page_bytes = {m: KVPool.page_bytes(bs, cfg.kv_spec, lay.num_kv_heads, dtype) for m, lay in layouts.items()}
    sizes = BufferSizes(dense_bytes, plan.total_bytes - dense_bytes, expert_bytes, ())  # slots: at each shift below
    layouts, slot_kv, start_pages, sizes = _slot_layout(ecfg, device, layouts, spec.mode, page_bytes, sizes,
                                                        spec.max_model_len)
    pages = _layout_pages(ecfg, device, layouts, spec.mode, start_pages, page_bytes,
                          slot_kv.group_bytes(start_pages))
    # a slot's KV after its experts (none in a slot of dense layers only)
    kv_offsets = sizes.slot_expert_bytes()
    plan.add_slots([[("weights", e), ("kv_cache", kv)] if e else [("kv_cache", kv)]
                    for e, kv in zip(kv_offsets, slot_kv.slot_bytes(start_pages), strict=True)])
    if ecfg.max_total_tokens is not None or device.type != "cuda":  # --mem-fraction sized it to fit already
        _check_fits(ecfg, device, plan.total_bytes, slot_kv.total(start_pages), plan.num_slots)
    umm = UnifiedMemory(plan, device)

    # Weights: dense parts of both layouts, experts in the start layout's slots.
    ckpt = DummyCheckpoint(ecfg.seed, device) if spec.checkpoint is None else Checkpoint(spec.checkpoint)
    load_weights(umm, family.resident_specs(cfg, layouts, spec.mode, elt), ckpt, dtype, cfg)

    kernels = KernelConfig(moe_backend=ecfg.moe_kernel, pdl=not ecfg.disable_pdl,
                           reshard_kernel=not ecfg.disable_reshard_kernel,
                           fp8_activations=ecfg.fp8_activations, shared_stream=not ecfg.disable_shared_experts_stream,
                           decodes_apart=ecfg.mixed_attention == "apart",
                           flash_prefill=use_flash(ecfg.prefill_attention, device, dtype, cfg.head_dim),
                           fresh_chunk_lengths=fresh_chunk_lengths(ecfg.max_num_batched_tokens, spec.max_model_len))
    modes: dict[str, ModeRuntime] = {}
    for m, lay in layouts.items():
        weights = family.build_weights(umm, cfg, lay, dtype)
        slots = [lay.slot_of(i) for i in range(cfg.num_layers)]
        kv = KVPool(umm, slots, [kv_offsets[j] for j in slots], pages[m],
                    [cfg.kv_group_of(i) for i in range(cfg.num_layers)], bs, cfg.kv_spec, lay.num_kv_heads, dtype)
        runner = ModelRunner(cfg, weights, kv.layers, lay.communicator(groups),
                             StaticBuffers.build(umm, m, *buf_shape), bs, device, kernels=kernels)
        modes[m] = ModeRuntime(lay, weights, kv, runner)
    switcher = Switcher(cfg, groups, device, bs, {m: rt.weights for m, rt in modes.items()},
                        {m: rt.kv.layers for m, rt in modes.items()},
                        SwitchOptions(ecfg.switch_overlap, ecfg.switch_transport, kernels.reshard_kernel))
    log.info("rank %d: unified buffer %.1f MiB; KV pages of %d tokens: %s", spec.rank, plan.total_bytes / 2**20,
             bs, {m: rt.kv.group_pages for m, rt in modes.items()})
    return Rank(spec, groups, umm, modes, switcher, StopRules(spec.eos_token_ids))


def prepare_rank(rank: Rank) -> None:
    """The start-up steps that run collectives (graph capture warms up NCCL, the switch paths are opened): every
    rank calls this once all ranks are built, so a rank that failed to build cannot leave the others waiting."""
    ecfg, groups, device = rank.spec.engine, rank.groups, rank.device
    if groups.world_size > 1:
        # peers' memory is mapped over NVLink (symmetric memory) or shared files: one machine only; torchrun
        # across machines keeps NCCL and the collective switch transport
        one_host = len(set(all_gather_json(socket.gethostname(), groups))) == 1
        if not one_host:
            log.info("rank %d: ranks span several machines: NCCL collectives only", groups.rank)
        rank.switcher.open_paths(peers_mapped=one_host)
        dtype = getattr(torch, rank.spec.dtype)
        if (one_host and device.type == "cuda" and not ecfg.disable_custom_all_reduce and dtype == torch.bfloat16
                and symmetric_memory_available()):
            for rt in rank.modes.values():  # a collective: every rank, the same order
                rt.runner.comm.enable_symmetric(ecfg.max_num_batched_tokens, rank.cfg.hidden_size, rank.cfg.top_k,
                                                dtype, device)
    if device.type == "cuda" and not ecfg.disable_cuda_graph:
        # both modes' decode graphs, once, into one memory pool; capture records addresses only: it needs no switch,
        # and its warm-up writes land in the reserved page 0 of either layout
        cap = min(ecfg.cuda_graph_max_bs, ecfg.max_running_requests, ecfg.max_num_batched_tokens)
        pool = torch.cuda.graph_pool_handle()
        for m, rt in rank.modes.items():
            n, secs = rt.runner.capture_graphs(cap, pool)
            log.info("rank %d: captured %d %s decode graphs (batch <= %d) in %.1f s", groups.rank, n, m, cap, secs)
        cap = min(ecfg.cuda_graph_max_tokens, ecfg.max_num_batched_tokens)
        for m, rt in rank.modes.items() if cap > 0 else ():  # into the same pool: no two graphs run at once
            n, secs = rt.runner.capture_pieces(cap, pool)
            log.info("rank %d: captured %s step pieces of %d token buckets (<= %d) in %.1f s", groups.rank, m, n,
                     cap, secs)
    if ecfg.warmup == "full" or (ecfg.warmup == "auto" and device.type == "cuda"):
        steps, secs = warm_up(rank, progress=groups.rank == 0)
        log.info("rank %d: warmed up %d kernel shapes in %.1f s", groups.rank, steps, secs)
    freeze_heap()


def freeze_heap() -> None:
    """Collect what start-up left and keep everything alive now out of later collections. A process that imported
    torch, transformers and triton and built an engine holds a large heap of objects the collector tracks; each
    full collection walks them all, and one falls now and then under a step (docs/performance-history.md). Frozen, a
    collection walks only what serving made since (vLLM does the same after its start-up)."""
    gc.collect()
    gc.freeze()
