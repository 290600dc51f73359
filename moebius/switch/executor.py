"""Executing a live switch's data plane on one rank, between two steps: one ordered pass over the layers moving each
layer's expert weights and KV pages together.

EP -> TP runs layers in ascending order (TP layer i lands in slot i, whose EP content, layer i - s, already left; s
is `Layout.slot_shift`, usually 1); TP -> EP in descending order (EP layer i lands in slot i + s, whose TP content,
layer i + s, already left). Nothing is recomputed; nothing of the model is held twice: the extra memory is the spare
slots and one layer of staging, taken before anything changes (a device that cannot give it refuses the switch).
Which requests move, where, and into which pages is the engine's side of the switch (`switch/handover.py`); it hands
this pass the `LiveKV` of each.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from moebius.config import ModelConfig
from moebius.link.messages import SwitchTimes
from moebius.models.weights import ModelWeights, MoEWeights
from moebius.parallel.groups import Groups, all_gather_json
from moebius.parallel.layout import Layout
from moebius.switch.plan import KVMove, LiveKV, ep_to_tp_pack, kv_ep_to_tp, kv_tp_to_ep, tp_to_ep_unpack
from moebius.switch.transport import CollectiveTransport, PeerTransport, Transport

log = logging.getLogger("moebius")


def staging_like(w13_EFD: torch.Tensor, w2_EDF: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's expert staging, shaped like these TP views."""
    return torch.empty_like(w13_EFD), torch.empty_like(w2_EDF)


@dataclass
class Staging:
    """One layer's worth of switch buffers, taken before anything changes and reused by every layer."""

    experts: list[tuple[torch.Tensor, torch.Tensor]] | None  # TP-shaped w13, w2, one or two (None: no experts)
    kv_rows: tuple[torch.Tensor, torch.Tensor] | None  # KV rows sent, received (None: no KV to move)


@dataclass(frozen=True)
class _KVLayerMove:
    """A KV group's plan, with the (page, offset-in-page) device vectors of the slots it sends to and receives from
    each peer: the same for every layer of the group."""

    plan: KVMove
    send: list[tuple[torch.Tensor, torch.Tensor]]
    recv: list[tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class PassLaunch:
    """The host's side of a pass launched (ms): `requests_ms` the caller's request side plus the KV index plan and
    the staging, `kv_plan_ms`, `staging_ms` (buffers and the ranks' agreement), `prep_ms` (index vectors),
    `enqueue_ms` (the loop over the layers); which pass and transport ran, and how many exchanges went as peer
    copies; the bytes this rank sends to the others, by the plan (`sent_bytes`)."""

    requests_ms: float
    kv_plan_ms: float
    staging_ms: float
    prep_ms: float
    enqueue_ms: float
    pipelined: bool
    transport: str
    peer_exchanges: int
    weight_bytes: int = 0
    kv_bytes: int = 0


@dataclass(frozen=True)
class _Unresolved:
    """What pass_times needs of the last pass until it reports."""

    source: str
    target: str
    running: int
    waiting: int
    requests_ms: float
    prep_ms: float


@dataclass(frozen=True)
class SwitchOptions:
    """How a switch's pass runs (engine flags and kernel settings)."""

    overlap: bool = False  # --switch-overlap: the double-buffered pass
    transport: str = "collective"  # --switch-transport
    row_kernel: bool = True  # the Triton row copy for the permutes on GPUs (KernelConfig.reshard_kernel)


class Switcher:
    """The data plane of the switches of one rank: the weight and KV views of both layouts, the transport, and the
    pass (`move`), whose device times `pass_times` reads once it is over."""

    def __init__(self, cfg: ModelConfig, groups: Groups, device: torch.device, block_size: int,
                 weights: dict[str, ModelWeights], caches: dict[str, list[torch.Tensor]], options: SwitchOptions
                 ) -> None:
        self.cfg, self.groups, self.device, self.block_size = cfg, groups, device, block_size
        self.weights, self.caches, self.options = weights, caches, options
        self.P, self.rank = groups.world_size, groups.rank
        self.transport: Transport = CollectiveTransport(groups.device)  # --switch-transport peer: set in open_paths
        self.tp_layouts = [Layout(cfg, "tp", q, self.P) for q in range(self.P)]
        self._marks: list[tuple[Any, Any, Any]] = []  # the last pass's (start, weights done, KV done) per layer
        self._unresolved: _Unresolved | None = None  # the last pass, until pass_times reports it
        # --switch-overlap on the GPU: the stream the pipelined pass's exchanges go out from
        self._side = torch.cuda.Stream(device) if device.type == "cuda" and options.overlap else None

    def open_paths(self, peers_mapped: bool) -> None:
        """One tiny all-to-all at start, so the first switch does not pay the communicator's connection set-up, and
        (--switch-transport peer, where every rank can map its peers' memory: one machine) the expert staging every
        rank addresses. A collective: every rank calls it, after all ranks were built."""
        probe = torch.zeros(self.P, dtype=torch.uint8, device=self.device)
        self.transport.all_to_all(torch.empty_like(probe), probe, [1] * self.P, [1] * self.P)
        moe = self._tp_moe()
        if self.options.transport != "peer" or moe is None or "ep" not in self.weights:
            return
        if not peers_mapped:
            log.warning("rank %d: ranks span several machines: switches keep the collective transport", self.rank)
            return
        self.transport = PeerTransport.build(self.groups, self.device, [moe.w13_EFD.shape, moe.w2_EDF.shape],
                                             moe.w13_EFD.dtype, 2 if self.options.overlap else 1)

    def _tp_moe(self) -> MoEWeights | None:
        """The first MoE layer's TP expert views (their shapes are every layer's, and the staging's)."""
        return next((layer.mlp for layer in self.weights["tp"].layers if isinstance(layer.mlp, MoEWeights)),
                    None) if "tp" in self.weights else None

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def move(self, src: str, dst: str, live: list[list[LiveKV]], running: int, waiting: int, host_ms: float
             ) -> PassLaunch | str:
        """Move every layer's experts, and the KV of the live requests (their target pages allocated already), from
        layout `src` to `dst`. A collective. live: the requests' KV in each KV group (`ModelConfig.kv_groups`; a
        group's layers move by its plan). Returns why not when a rank cannot give the staging (nothing has changed
        then), else where the host's time went. The pass is launched, not waited for (`pass_times`). running /
        waiting: counts for the log line; host_ms: the caller's time on the switch before this (requests, capacity,
        page tables)."""
        t0 = time.perf_counter()
        plans = [(kv_ep_to_tp if dst == "tp" else kv_tp_to_ep)(g, self.rank, self.tp_layouts, self.block_size)
                 for g in live]
        # every rank knows every live request's KV length, so all agree whether there is KV to move
        move_kv = any(x.num_tokens for g in live for x in g)
        # One layer's staging (experts, KV rows), before anything changes: a device that cannot give it refuses the
        # switch here instead of failing half-way through the layers. Every rank agrees, so none starts alone.
        t_plan = time.perf_counter()
        staging, why = self._staging(plans if move_kv else None, self.caches[src][0])
        agreed = all_gather_json([not why, why], self.groups, self.device)
        if not all(ok for ok, _ in agreed):
            return ("no device memory for one layer of switch staging ("
                    + "; ".join(f"rank {r}: {m}" for r, (ok, m) in enumerate(agreed) if not ok) + ")")
        self._sync()
        t1 = time.perf_counter()
        peer0 = self.transport.peer_exchanges
        prep_ms, enqueue_ms, pipelined = self._move_layers(src, dst, plans, move_kv, staging)
        launch = PassLaunch(host_ms + (t1 - t0) * 1e3, (t_plan - t0) * 1e3, (t1 - t_plan) * 1e3, prep_ms, enqueue_ms,
                            pipelined, self.transport.name, self.transport.peer_exchanges - peer0,
                            *self.sent_bytes(src, dst, plans if move_kv else []))
        self._unresolved = _Unresolved(src, dst, running, waiting, launch.requests_ms, prep_ms)
        return launch

    def sent_bytes(self, src: str, dst: str, plans: list[KVMove]) -> tuple[int, int]:
        """(weight, KV) bytes this rank sends to the other ranks in a pass from layout `src` to `dst` by these KV plans
        (one a KV group): each MoE layer's experts but the share that stays on this rank, and every KV row for a peer
        at the heads it takes, in every layer of its group."""
        weights = sum(t.numel() * t.element_size() for i in range(self.cfg.num_layers)
                      if (pair := self._experts(src, dst, i)) is not None
                      for t in (pair[0].w13_EFD, pair[0].w2_EDF)) * (self.P - 1) // self.P
        cache = self.caches[src][0]
        row = cache.shape[1] * cache.shape[-1] * cache.element_size()  # a token's parts of one head
        layers = [len(g.layers) for g in self.cfg.kv_groups]
        kv = sum(n * row * len(p.send_heads[q]) * len(p.send_slots[q])
                 for p, n in zip(plans, layers, strict=False) for q in range(self.P) if q != self.rank)
        return weights, kv

    def _staging(self, plans: list[KVMove] | None, cache: torch.Tensor) -> tuple[Staging, str]:
        """Buffers for one layer, reused by every layer: experts shaped like the TP views ([E, 2I/P, D], [E, D, I/P]:
        what TP -> EP receives and EP -> TP packs, either way, as P * El = E; two with --switch-overlap, if the device
        has the memory; the peer transport's own, kept from the start, where it has them), and (plans: KV to move)
        the KV rows sent and received (the most of any KV group's plan). (Staging, why): why is "" unless the device
        cannot give them."""
        moe = self._tp_moe()
        try:
            experts = self.transport.staging()  # the peer transport's, kept from the start
            if experts is None and moe is not None:
                experts = [staging_like(moe.w13_EFD, moe.w2_EDF)]
            if experts is not None and len(experts) == 1 and self.options.overlap:
                try:  # the second buffer only speeds the pass up: without it, the one-buffer pass
                    experts.append(staging_like(moe.w13_EFD, moe.w2_EDF))
                except torch.OutOfMemoryError:
                    log.warning("rank %d: no memory for a second layer of switch staging; switching unpipelined",
                                self.rank)
            rows = None
            if plans is not None:  # cache [pages, parts, block, heads, d]: rows [n, parts, heads moved, d]
                n_send = max(sum(len(x) for x in p.send_slots) for p in plans)
                n_recv = max(sum(len(x) for x in p.recv_slots) for p in plans)
                parts = cache.shape[1]  # the KV spec's: K and V, or MLA's one latent
                rows = (cache.new_empty((n_send, parts, max(map(len, plans[0].send_heads)), cache.shape[-1])),
                        cache.new_empty((n_recv, parts, len(plans[0].recv_heads[0]), cache.shape[-1])))
            return Staging(experts, rows), ""
        except torch.OutOfMemoryError as e:
            return Staging(None, None), str(e).splitlines()[0]

    def _move_layers(self, src: str, dst: str, plans: list[KVMove], move_kv: bool, staging: Staging
                     ) -> tuple[float, float, bool]:
        """The ordered pass, launched without waiting for it. Returns where the host's time went (ms): the index
        vectors, its loop over the layers, and whether the pipelined pass ran; keeps each layer's marks
        for pass_times (the pipelined pass: one mark, its expert part counted as weights and the KV after the last
        expert byte as KV).
        On the GPU nothing waits between layers (one stream orders every copy and exchange; the phases are timed
        with events), so host launches of the next layer overlap the transfers of this one."""
        hp = time.perf_counter()
        order = range(self.cfg.num_layers) if dst == "tp" else reversed(range(self.cfg.num_layers))
        bs = self.block_size
        # (page, offset-in-page) of every slot moved, per peer: the same for every layer of a KV group
        moves = [_KVLayerMove(p, [self._page_offset(s, bs) for s in p.send_slots],
                              [self._page_offset(r, bs) for r in p.recv_slots]) for p in plans]
        cuda = self.device.type == "cuda"
        h0 = time.perf_counter()
        if staging.experts is not None and len(staging.experts) == 2:
            self._marks = self._pipelined(src, dst, list(order), moves, move_kv, staging)
            return (h0 - hp) * 1e3, (time.perf_counter() - h0) * 1e3, True
        marks: list[tuple[Any, Any, Any]] = []  # (start, weights done, KV done) of each layer
        for i in order:
            m0 = self._mark(cuda)
            pair = self._experts(src, dst, i)
            if pair is not None:
                assert staging.experts is not None  # a layer with experts: _staging made them
                self._move_experts(*pair, dst, staging.experts[0])
            m1 = self._mark(cuda)
            if move_kv:
                assert staging.kv_rows is not None  # KV to move: _staging made them
                self._move_kv(self.caches[src][i], self.caches[dst][i], moves[self.cfg.kv_group_of(i)],
                              staging.kv_rows)
            marks.append((m0, m1, self._mark(cuda)))
        # no wait for the device here: the first step in the new layout is launched right behind the pass on the
        # same stream (its host work overlaps the transfers); pass_times waits for the pass's end
        self._marks = marks
        return (h0 - hp) * 1e3, (time.perf_counter() - h0) * 1e3, False

    def _pipelined(self, src: str, dst: str, layers: list[int], moves: list[_KVLayerMove], move_kv: bool,
                   staging: Staging) -> list[tuple[Any, Any, Any]]:
        """The pass with two expert buffers (the j-th layer in pass order uses buffer j % 2): the exchanges go out from
        a side stream, so the compute stream permutes one layer while the exchange of the layer before it is on the
        wire. EP -> TP: pack j, finish j-1, exchange j (pack j+1 then overlaps exchange j). TP -> EP: exchange j, finish
        j-1 (unpack j-1 overlaps exchange j). Finishing j waits for exchange j, unpacks (TP -> EP) and moves the layer's
        KV on the compute stream (over the collective transport, whose expert exchanges share the KV's NCCL
        communicator, after the last exchange queued: the two streams never run it at once). Buffer j % 2 is free again
        for layer j + 2: EP -> TP packs it after finishing j (which waited for exchange j); TP -> EP's exchange j + 2
        waits for what the compute stream queued before it, unpack j included. Slots (see the module docstring) are read
        before they are written for the same reasons as in the one-stream pass: each exchange waits for everything the
        compute stream queued before it. Returns one (start, last expert byte, end) mark for pass_times."""
        P, to_tp = self.P, dst == "tp"
        assert staging.experts is not None
        cuda = self._side is not None  # on the CPU the same order, run as it is queued
        compute, side = (torch.cuda.current_stream(self.device), self._side) if cuda else (None, None)
        done: list[Any] = []  # exchange j finished (an event on the side stream)
        start = self._mark(cuda)
        # the collective transport's expert exchanges (side stream) and the KV's (compute stream) share one NCCL
        # communicator, whose operations must not overlap; the peer transport's expert copies use none
        nccl_both = isinstance(self.transport, CollectiveTransport)

        def experts(i: int) -> tuple[MoEWeights, MoEWeights] | None:
            return self._experts(src, dst, i)

        def exchange(j: int) -> None:
            pair = experts(layers[j])
            with torch.cuda.stream(side) if cuda else contextlib.nullcontext():
                if cuda:
                    side.wait_stream(compute)  # everything queued so far: permutes, unpacks, KV moves
                if pair is not None:
                    self._exchange_experts(*pair, dst, staging.experts[j % 2])
                done.append(self._mark(cuda))

        def finish(j: int) -> None:
            if cuda:
                compute.wait_event(done[j])
            i, pair = layers[j], experts(layers[j])
            if pair is not None and not to_tp:
                r13, r2 = staging.experts[j % 2]
                tp_to_ep_unpack(r13, r2, P, pair[1].w13_EFD, pair[1].w2_EDF, self.options.row_kernel)
            if move_kv:
                assert staging.kv_rows is not None  # KV to move: _staging made them
                if cuda and nccl_both:  # TP -> EP queues exchange j + 1 before finishing j: the KV's all-to-all
                    compute.wait_event(done[-1])  # waits for it, so that one communicator never runs on two streams
                self._move_kv(self.caches[src][i], self.caches[dst][i], moves[self.cfg.kv_group_of(i)],
                              staging.kv_rows)

        last_expert: Any = start
        for j, i in enumerate(layers):
            pair = experts(i)
            if to_tp:
                if pair is not None:
                    ep_to_tp_pack(pair[0].w13_EFD, pair[0].w2_EDF, P, staging.experts[j % 2], self.options.row_kernel)
                if j:
                    finish(j - 1)
                exchange(j)
                last_expert = done[-1] if pair is not None else last_expert
            else:
                exchange(j)
                if j:
                    finish(j - 1)
                    if experts(layers[j - 1]) is not None:
                        last_expert = self._mark(cuda)
        if layers:
            finish(len(layers) - 1)
            if not to_tp and experts(layers[-1]) is not None:
                last_expert = self._mark(cuda)
        if cuda:
            compute.wait_stream(side)  # the next step, and any reuse of the staging, after every exchange
        return [(start, last_expert, self._mark(cuda))]

    def pass_times(self) -> SwitchTimes | None:
        """The last pass's times, once (None when there is none to report): waits for its end on the device, then
        the weights' and the KV's (summed over the layers), the span (first layer's start to last layer's end; minus
        weights and KV: the device idle between layers) and the total (requests, index vectors and the span: the
        switch on this rank from its start to its last byte landing). Off the switch's critical path: a switch that
        rides on a step is reported with the step after it, so that the first step in the new layout is launched,
        and its tokens come back, without waiting for the pass on the host (nor for reading a hundred events)."""
        if self._unresolved is None:
            return None
        head, self._unresolved = self._unresolved, None
        marks, self._marks = self._marks, []
        if marks and not isinstance(marks[-1][2], float):
            marks[-1][2].synchronize()
        weights_ms = sum(self._elapsed(a, b) for a, b, _ in marks) * 1e3
        kv_ms = sum(self._elapsed(b, c) for _, b, c in marks) * 1e3
        span_ms = self._elapsed(marks[0][0], marks[-1][2]) * 1e3 if marks else 0.0
        times = SwitchTimes(weights_ms, kv_ms, span_ms, head.requests_ms + head.prep_ms + span_ms)
        log.info("rank %d: switched %s -> %s with %d running, %d waiting requests in %.1f ms (weights %.1f, KV %.1f)",
                 self.rank, head.source, head.target, head.running, head.waiting, times.total_ms, weights_ms, kv_ms)
        return times

    def _page_offset(self, slots: np.ndarray, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
        # on the host: a first switch would otherwise pay the lazy load of the device's integer-division kernels
        page, off = np.divmod(np.asarray(slots, dtype=np.int64), bs)
        return torch.from_numpy(page).to(self.device), torch.from_numpy(off).to(self.device)

    @staticmethod
    def _mark(cuda: bool) -> Any:
        """A point in time: a recorded CUDA event on the GPU, the host clock on the CPU (where work is synchronous)."""
        if not cuda:
            return time.perf_counter()
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    @staticmethod
    def _elapsed(a: Any, b: Any) -> float:
        """Seconds between two marks (events are read after the pass's final synchronisation)."""
        return b - a if isinstance(a, float) else a.elapsed_time(b) / 1e3

    def _experts(self, src: str, dst: str, i: int) -> tuple[MoEWeights, MoEWeights] | None:
        """Layer i's experts in the source and target layouts (None: a dense layer, nothing to move)."""
        a, b = self.weights[src].layers[i].mlp, self.weights[dst].layers[i].mlp
        return (a, b) if isinstance(a, MoEWeights) and isinstance(b, MoEWeights) else None

    def _move_experts(self, src: MoEWeights, dst: MoEWeights, target: str,
                      staging: tuple[torch.Tensor, torch.Tensor]) -> None:
        """staging: one layer's TP-shaped expert buffers, reused by every layer (one stream orders the reuse).
        EP -> TP: permute, then exchange straight into the TP views; TP -> EP: exchange the TP views' expert blocks,
        then interleave the shards into whole experts."""
        if target == "tp":
            ep_to_tp_pack(src.w13_EFD, src.w2_EDF, self.P, staging, self.options.row_kernel)
        self._exchange_experts(src, dst, target, staging)
        if target != "tp":
            tp_to_ep_unpack(*staging, self.P, dst.w13_EFD, dst.w2_EDF, self.options.row_kernel)

    def _exchange_experts(self, src: MoEWeights, dst: MoEWeights, target: str,
                          staging: tuple[torch.Tensor, torch.Tensor]) -> None:
        """The exchange alone: EP -> TP from the packed staging into the TP views, TP -> EP from the TP views into
        the staging."""
        splits = [(src if target == "tp" else dst).w13_EFD.shape[0]] * self.P
        views = (dst.w13_EFD, dst.w2_EDF) if target == "tp" else (src.w13_EFD, src.w2_EDF)
        pairs = zip(views, staging, strict=True) if target == "tp" else zip(staging, views, strict=True)
        self.transport.all_to_all_many([(out, inp, splits, splits) for out, inp in pairs])

    def _move_kv(self, src: torch.Tensor, dst: torch.Tensor, move: _KVLayerMove,
                 rows: tuple[torch.Tensor, torch.Tensor]) -> None:
        """src/dst caches [pages, parts, bs, heads, d]: gather by source (page, offset) into the staging rows,
        exchange, scatter by target (page, offset). rows: (sent [n_send, parts, w, d], received [n_recv, parts, w,
        d]), reused (the leading rows: a KV group's plan may move fewer than the staging holds)."""
        plan, send, recv = move.plan, move.send, move.recv
        send_counts = [len(s) for s in plan.send_slots]
        recv_counts = [len(r) for r in plan.recv_slots]
        out, got = rows[0][: sum(send_counts)], rows[1][: sum(recv_counts)]
        start = 0
        for (pg, off), h, n in zip(send, plan.send_heads, send_counts, strict=True):
            if n:  # [n, parts, heads, d] of src written straight into the rows (no temporary)
                torch.ops.aten.index.Tensor_out(src[:, :, :, h.start: h.stop], [pg, None, off],
                                                out=out[start: start + n])
            start += n
        self.transport.all_to_all(got, out, recv_counts, send_counts)
        start = 0
        for (pg, off), h, n in zip(recv, plan.recv_heads, recv_counts, strict=True):
            if n:
                dst[pg, :, off, h.start: h.stop] = got[start: start + n]
            start += n
