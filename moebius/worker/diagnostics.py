"""Questions a plan may ask every rank (`link.messages.Query`), answered without a step: fingerprints of what a
switch must preserve, memory, how the kernels and the collectives run, which requests a rank holds."""

from __future__ import annotations

import dataclasses
import gc
import hashlib
from typing import TYPE_CHECKING, Any

import torch

from moebius.config import first_live_page
from moebius.link.messages import Query
from moebius.models.weights import MoEWeights

if TYPE_CHECKING:
    from moebius.worker.rank import Rank


def answer(rank: Rank, q: Query) -> Any:
    """The rank's JSON-able answer to query `q`."""
    if q is Query.FINGERPRINT:
        return fingerprint(rank)
    if q is Query.MEMORY:
        return memory_report(rank)
    if q is Query.REQUESTS:  # ids of what this rank holds, and of the specs it keeps of others' requests
        sched = rank.scheduler
        return {"running": [r.request_id for r in sched.running],
                "waiting": [r.request_id for r in sched.waiting], "others": sorted(rank.others)}
    if q is Query.RESET_PREFIX_CACHE:  # the prefix cache's pages (a benchmark between its runs)
        return {"pages": rank.kv_pages.clear_cache()}
    if q is Query.HEAP:  # the rank process's objects kept out of garbage collections (freeze_heap)
        return {"frozen": gc.get_freeze_count()}
    if q is Query.KERNELS:  # how the rank's kernels run (its KernelConfig)
        kc = rank.modes[rank.mode].runner.kernels
        return {f.name: sorted(v) if isinstance(v, frozenset) else v
                for f in dataclasses.fields(kc) for v in [getattr(kc, f.name)]}
    assert q is Query.COMM, q  # how each layout's collectives run
    return {m: rt.runner.comm.describe() for m, rt in rank.modes.items()}


def memory_report(rank: Rank) -> dict[str, Any]:
    rt = rank.modes[rank.mode]
    kv = sum(t.numel() * t.element_size() for t in rt.kv.layers)
    out: dict[str, Any] = {"umm_bytes": rank.umm.plan.total_bytes, "kv_bytes": kv,
                           "kv_tokens": (rt.kv.num_pages - 1) * rank.spec.engine.block_size,
                           "releasable_bytes": rank.umm.releasable_bytes(), "released": sorted(rank.umm.released),
                           "host_copy_bytes": rank.umm.host_copy_bytes}
    if rank.device.type == "cuda":
        out["peak_allocated"] = torch.cuda.max_memory_allocated(rank.device)
        out["peak_reserved"] = torch.cuda.max_memory_reserved(rank.device)
        # what the rank holds besides its KV: the buffer's other regions (mapped through the driver, outside torch's
        # allocator) and the allocator's peak (activations, graphs' pools)
        out["non_kv_bytes"] = out["umm_bytes"] - kv + out["peak_reserved"]
    return out


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def fingerprint(rank: Rank) -> dict[str, Any]:
    """Buffer address, every resident view's data_ptr, and digests of the active layout's expert weights and of
    each live request's KV (by request, in token order, all local heads; a sliding-window layer's window): what a
    switch must preserve."""
    ptrs = [rank.umm.buffer.data_ptr()]
    for rt in rank.modes.values():
        for lw in rt.weights.layers:
            ptrs += [lw.attn.qkv_QD.data_ptr(), lw.attn.o_DQ.data_ptr()]
            if isinstance(lw.mlp, MoEWeights):
                ptrs += [lw.mlp.w13_EFD.data_ptr(), lw.mlp.w2_EDF.data_ptr()]
        ptrs += [t.data_ptr() for t in rt.kv.layers]
        ptrs += rt.runner.static_addresses()
    rt = rank.modes[rank.mode]
    experts = [_digest(torch.cat([lw.mlp.w13_EFD.flatten(), lw.mlp.w2_EDF.flatten()]))
               for lw in rt.weights.layers if isinstance(lw.mlp, MoEWeights)]
    bs, cfg = rank.spec.engine.block_size, rank.cfg
    kv = {}
    for r in rank.scheduler.running:  # each layer through its KV group's table, a window layer's live tokens only
        rows = []
        for i, c in enumerate(rt.kv.layers):
            g = cfg.kv_group_of(i)
            slots = torch.arange(first_live_page(r.num_computed, cfg.kv_groups[g].window, bs) * bs, r.num_computed)
            rows.append(c[torch.tensor(r.tables[g], dtype=torch.int64)[slots // bs], :, slots % bs].flatten())
        kv[r.request_id] = _digest(torch.cat(rows))
    return {"mode": rank.mode, "ptrs": ptrs, "experts": experts, "kv": kv}
