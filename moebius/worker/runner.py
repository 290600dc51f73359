"""Runs one scheduled batch through the model on a rank: metadata into the static buffers, forward, sample.

Host work is O(batch): one pass over the scheduled chunks builds flat index arrays; everything per token or per
layer is done in batched device ops.

A step is launched and resolved separately (`launch` returns a `PendingStep`), so the rank can launch step N+1
while step N still runs on the device (overlap scheduling): a token that step N has not handed back yet is a
placeholder on the host, and step N+1 takes it from step N's device output instead.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from itertools import chain

import numpy as np
import torch

from moebius.config import ModelConfig
from moebius.kernels import DEFAULT_KERNELS, EARLY, KernelConfig, release_order_for, triton_available
from moebius.layers.attention import (
    AttentionCut,
    AttentionMetadata,
    leading_decodes,
    num_splits_for,
    query_blocks,
)
from moebius.layers.sampler import SamplingBatch, logprobs_of, processed_logits, race_scores, sample
from moebius.link.request import RequestSpec
from moebius.memory.umm import MemoryPlan, UnifiedMemory
from moebius.models.registry import family_of
from moebius.models.weights import ModelWeights
from moebius.parallel.dispatch import Communicator
from moebius.sampling_params import MAX_LOGPROBS, SamplingParams
from moebius.worker.cuda_graphs import AttentionCall, CudaGraphs, StepPieces, default_buckets, piece_buckets
from moebius.worker.scheduler import ScheduledChunk

_FIELDS = ("input_ids", "positions", "slot_mapping", "token_seq", "token_qpos", "fill_dst", "fill_src",
           "query_start_loc", "seq_lens", "q_blocks", "sample_rows")


def _field_sizes(max_tokens: int, max_seqs: int, groups: int) -> list[int]:
    # q_blocks: two ints a query block, and a step has at most a block a token (plus slack of one a sequence);
    # then the slots of each KV group after the first
    return [max_tokens] * 7 + [max_seqs + 1, max_seqs, 2 * (max_tokens + max_seqs), max_seqs] + [max_tokens] * (
        groups - 1)


@dataclass
class StaticBuffers:
    """Per-mode batch metadata at fixed addresses (views of the unified buffer), so graphs can replay them.

    The int64 fields are slices of one region, mirrored in pinned host memory: a step writes a host mirror and
    moves it with one copy (plus one for the block-table rows). The mirrors are double-buffered: with one step in
    flight, the mirror a step writes is never the one an unfinished copy still reads. A model with several KV groups
    (`ModelConfig.kv_groups`: sliding-window layers' own page tables) has a block table and a slot mapping a group,
    the first group's in `block_tables` and `slot_mapping`."""

    input_ids: torch.Tensor  # [max_tokens] int64
    positions: torch.Tensor  # [max_tokens] int64
    slot_mapping: torch.Tensor  # [max_tokens] int64
    token_seq: torch.Tensor  # [max_tokens] int64
    token_qpos: torch.Tensor  # [max_tokens] int64
    fill_dst: torch.Tensor  # [max_tokens] int64: input_ids rows taken from the previous step's device output ...
    fill_src: torch.Tensor  # [max_tokens] int64: ... and the output row each one takes
    query_start_loc: torch.Tensor  # [max_seqs + 1] int64
    seq_lens: torch.Tensor  # [max_seqs] int64
    q_blocks: torch.Tensor  # [2 * (max_tokens + max_seqs)] int64: a step's attention query blocks (GPU, prompts)
    sample_rows: torch.Tensor  # [max_seqs] int64: the token rows a step samples from (outside the decode graphs)
    group_slots: list[torch.Tensor]  # [max_tokens] int64 each: the slots of each KV group after the first
    tables: torch.Tensor  # [groups, max_seqs, max_pages] int32: each KV group's block tables
    table_stage: torch.Tensor  # [groups * max_seqs * max_pages] int32: the step's [groups, B, W] tables, packed
    meta: torch.Tensor  # the int64 region holding the fields above, in order
    host_meta: list[torch.Tensor]  # its two pinned host mirrors
    host_tables: list[torch.Tensor]  # two pinned host mirrors of table_stage
    flip: int = 0  # the mirror the next upload writes

    @property
    def block_tables(self) -> torch.Tensor:
        """The first KV group's [max_seqs, max_pages] block tables."""
        return self.tables[0]

    @staticmethod
    def plan(plan: MemoryPlan, prefix: str, max_tokens: int, max_seqs: int, max_pages: int, groups: int = 1) -> None:
        plan.add(f"{prefix}.meta", (sum(_field_sizes(max_tokens, max_seqs, groups)),), torch.int64)
        plan.add(f"{prefix}.block_tables", (groups, max_seqs, max_pages), torch.int32)
        plan.add(f"{prefix}.table_stage", (groups * max_seqs * max_pages,), torch.int32)

    @staticmethod
    def build(umm: UnifiedMemory, prefix: str, max_tokens: int, max_seqs: int, max_pages: int, groups: int = 1
              ) -> StaticBuffers:
        sizes = _field_sizes(max_tokens, max_seqs, groups)
        meta = umm.view(f"{prefix}.meta", (sum(sizes),), torch.int64)
        parts = meta.split(sizes)
        views = dict(zip(_FIELDS, parts, strict=False))
        tables = umm.view(f"{prefix}.block_tables", (groups, max_seqs, max_pages), torch.int32)
        stage = umm.view(f"{prefix}.table_stage", (groups * max_seqs * max_pages,), torch.int32)
        pin = umm.device.type == "cuda"
        return StaticBuffers(**views, group_slots=list(parts[len(_FIELDS):]), tables=tables, table_stage=stage,
                             meta=meta,
                             host_meta=[torch.zeros(meta.shape, dtype=torch.int64, pin_memory=pin) for _ in "ab"],
                             host_tables=[torch.zeros(stage.shape, dtype=torch.int32, pin_memory=pin) for _ in "ab"])

    def upload(self, fields: dict[str, np.ndarray], table: np.ndarray, group_slots: list[np.ndarray]
               ) -> dict[str, torch.Tensor | list[torch.Tensor]]:
        """Write the step's fields (and each further KV group's slots) into a host mirror, copy it over in one go;
        device views of the used parts. table: [groups, B, W], every group's block tables."""
        host_meta, host_tables = self.host_meta[self.flip], self.host_tables[self.flip]
        self.flip ^= 1
        host = host_meta.numpy()
        named = [(fields[n], getattr(self, n)) for n in _FIELDS]
        views = []  # of each field, in the region's order
        start, end = 0, 0
        for src, view in named + list(zip(group_slots, self.group_slots, strict=False)):
            host[start: start + src.shape[0]] = src
            end = start + src.shape[0]
            views.append(view[: src.shape[0]])
            start += view.shape[0]
        out: dict[str, torch.Tensor | list[torch.Tensor]] = dict(zip(_FIELDS, views, strict=False))
        out["group_slots"] = views[len(_FIELDS):]
        self.meta[:end].copy_(host_meta[:end], non_blocking=True)
        # The [groups, B, W] tables travel packed (one contiguous copy from pinned memory), then a device copy spreads
        # them into the rows: a strided host-to-device copy would be staged through pageable memory, a copy that
        # holds the host and grows with the batch.
        G, B, W = table.shape
        n = G * B * W
        host_tables.numpy()[:n] = table.reshape(-1)
        self.table_stage[:n].copy_(host_tables[:n], non_blocking=True)
        self.tables[:G, :B, :W].copy_(self.table_stage[:n].view(G, B, W))
        out["block_tables"] = self.tables[0, :B, :W]
        out["group_tables"] = [self.tables[g, :B, :W] for g in range(1, G)]
        return out


@dataclass
class StepSync:
    """What all ranks agreed on before a step: the largest local token count and whether every rank is decoding
    only. In TP these are local facts; in EP they come from a small all-gather (ranks must run the same graph)."""

    max_tokens: int
    all_decode: bool


def _group_metadata(meta: AttentionMetadata, tables: Sequence[torch.Tensor], slots: Sequence[torch.Tensor]
                    ) -> tuple[AttentionMetadata, ...]:
    """The metadata of each KV group after the first (`AttentionMetadata.group`): the step's, with the group's block
    tables and slot mapping."""
    return tuple(replace(meta, block_tables=t, slot_mapping=s, kv_group=g)
                 for g, (t, s) in enumerate(zip(tables, slots, strict=True), start=1))


def _page_table(tables: list[list[int]], rows: int) -> np.ndarray:
    """[rows, width] int32: these page tables, a row each, page 0 past them. Only the used columns are written:
    attention reads a row no further than its sequence length, so a graph's full-width view never reaches the stale
    columns beyond."""
    n = np.fromiter((len(t) for t in tables), dtype=np.int64, count=len(tables))
    width = max(int(n.max(initial=0)), 1)
    table = np.zeros((rows, width), dtype=np.int32)
    # one vectorised fill (a row-by-row assignment would cost host time per request)
    table[: len(tables)][np.arange(width) < n[:, None]] = np.fromiter(chain.from_iterable(tables), dtype=np.int32,
                                                                       count=int(n.sum()))
    return table


# A step's log-probabilities, per sampling row: (the sampled token's, then its top k's values; their ids)
Logprobs = tuple[list[float], list[int]]


def sampling_columns(rows: list[tuple[SamplingParams, int, int]], vocab: int
                     ) -> tuple[list[list[float]], list[list[int]]]:
    """A step's sampling values of (params, seed, output index) rows, column by column: the float ones
    (temperature, top_p, min_p) and the integer ones (top_k, seed, output index); top_k off or beyond the vocabulary
    is the vocabulary."""
    floats = [[p.temperature for p, _, _ in rows], [p.top_p for p, _, _ in rows], [p.min_p for p, _, _ in rows]]
    ints = [[min(p.top_k, vocab) if p.top_k > 0 else vocab for p, _, _ in rows], [s for _, s, _ in rows],
            [j for _, _, j in rows]]
    return floats, ints


def admission_error(spec: RequestSpec, vocab: int) -> str | None:
    """Why a rank cannot run this request (None: it can). The per-request conversions a step makes are made once
    here, so that no value a request carries fails inside a step, where the whole batch would fail with it."""
    p = spec.params
    try:
        floats, ints = sampling_columns([(p, spec.seed, 0)], vocab)
        torch.tensor(floats, dtype=torch.float32)
        torch.tensor(ints, dtype=torch.int64)
        bad = [t for t in p.stop_token_ids or () if not 0 <= t < vocab]  # (min_tokens masks them in the logits)
        if bad:
            return f"stop_token_ids {bad[0]} is outside the vocabulary [0, {vocab})"
    except (OverflowError, RuntimeError, TypeError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return None


@dataclass
class RoutedRows:
    """A step's router choices for the requests that asked: (request id, first position, first row in `host`,
    rows) spans over `host`, [rows, MoE layers, K] int32 on the host (pinned on the GPU, read after the step's
    event)."""

    spans: list[tuple[str, int, int, int]]
    host: torch.Tensor


def routed_positions(req: object, start: int, n: int) -> tuple[int, int]:
    """The positions [lo, hi) of a chunk [start, start + n) whose routing a request asks for: every one with
    return_prompt_routed_experts, else those from the prompt's last token on (the forwards that sample its output
    tokens); (0, 0) when it asks for none."""
    p = req.params  # type: ignore[attr-defined]
    if p.return_prompt_routed_experts:
        return start, start + n
    if p.return_routed_experts:
        return max(start, req.num_prompt - 1), start + n  # type: ignore[attr-defined]
    return 0, 0


class PendingStep:
    """A launched step: its sampled tokens on the device ([n] int64, one per sampling chunk, batch order), on their
    way to a pinned host buffer (with their log-probabilities, when the step's requests ask for them); `result()`
    waits for them."""

    def __init__(self, tokens: torch.Tensor, prompt_logits: dict[int, torch.Tensor], host: torch.Tensor,
                 done: torch.cuda.Event | None, logprobs: tuple[torch.Tensor, torch.Tensor] | None = None,
                 routed: RoutedRows | None = None) -> None:
        self.tokens, self.prompt_logits, self._host, self._done = tokens, prompt_logits, host, done
        self._logprobs = logprobs  # host (pinned) [n, 1 + k] values and ids
        self._routed = routed

    def routed_experts(self) -> dict[str, tuple[int, list[list[list[int]]]]]:
        """Per request that asked (SamplingParams.return_routed_experts / return_prompt_routed_experts): the first
        position this step routed for it and the expert ids of each of its positions ([n][MoE layers][k]), after
        `result()`."""
        if self._routed is None:
            return {}
        ids = self._routed.host.tolist()
        return {rid: (pos, ids[at: at + n]) for rid, pos, at, n in self._routed.spans}

    def result(self) -> tuple[list[int], dict[int, torch.Tensor]]:
        if self._done is not None:
            self._done.synchronize()
        return self._host.tolist(), self.prompt_logits

    def logprobs(self) -> list[Logprobs] | None:
        """Per sampling row: the sampled token's log-probability then its top k's, and their ids (after
        `result()`); None when no request of the step asked."""
        if self._logprobs is None:
            return None
        vals, ids = self._logprobs
        return list(zip(vals.tolist(), ids.tolist(), strict=True))


class ModelRunner:
    def __init__(self, cfg: ModelConfig, weights: ModelWeights, kv: list[torch.Tensor], comm: Communicator,
                 bufs: StaticBuffers, block_size: int, device: torch.device,
                 kernels: KernelConfig = DEFAULT_KERNELS) -> None:
        self.cfg, self.weights, self.kv, self.comm = cfg, weights, kv, comm
        self.groups = len(cfg.kv_groups)  # KV groups: a block table and a slot mapping each (StaticBuffers)
        self.model = family_of(cfg).model  # the family's layout-free forward
        self.qkv_elems = weights.layers[0].attn.qkv_QD.numel()  # picks the launch release order (forward)
        # how this runtime's kernels run: a forward in its step's release order (`forward`), the kernels after it
        # (sampling's vocabulary argmax) in the EARLY one (`_kc_sampling`)
        self.kernels = kernels
        self.bufs, self.block_size, self.device = bufs, block_size, device
        self.graphs: CudaGraphs | None = None
        self.pieces: StepPieces | None = None
        # Where sampled tokens come back: two pinned buffers and events, used in turn (a step is resolved before the
        # step after next is launched), so a decode step allocates nothing for its read-back.
        self._readback = [(torch.zeros(bufs.seq_lens.shape[0], dtype=torch.int64, pin_memory=True), torch.cuda.Event())
                          for _ in "ab"] if device.type == "cuda" else []
        n = bufs.seq_lens.shape[0]  # ... and their log-probabilities, when asked for
        self._lp_readback = [(torch.zeros(n, 1 + MAX_LOGPROBS, pin_memory=True),
                              torch.zeros(n, 1 + MAX_LOGPROBS, dtype=torch.int64, pin_memory=True))
                             for _ in "ab"] if device.type == "cuda" else []
        self._turn = 0
        # the router's expert ids of every token of a step, written by every forward (graph replays too) at a fixed
        # address; read only for the requests that ask (`_routed_rows`). Built once, like the graphs that write it.
        moe_layers = self.model.num_moe_layers(weights)
        self.routed: torch.Tensor | None = torch.zeros(
            bufs.input_ids.shape[0], moe_layers, cfg.top_k, dtype=torch.int32, device=device) if moe_layers else None
        self._routed_readback: list[torch.Tensor] = []  # two pinned [max tokens, MoE layers, k], used in turn
        self.logprobs_mode = "raw_logprobs"  # --logprobs-mode (the rank sets it): what `logprobs_of` returns
        self.lm_head_fp32 = False  # --lm-head-dtype float32 (the rank sets it, before any graph is captured)
        self.last_metadata_s = 0.0  # host time of the last step's metadata (diagnostics: bench_decode reports it)
        # the family's attention on this rank: the step pieces' buffers, KV splits, the query-block table
        self.geometry = self.model.attention_geometry(cfg, weights, kv)
        self.attn_kernels = device.type == "cuda" and triton_available()  # the family's Triton attention runs
        # tokens per query block of the GPU attention kernel, for the block tables of steps with prompt chunks
        self.q_block: int | None = None
        if self.attn_kernels and self.geometry.group is not None:
            from moebius.kernels.attention import query_block_tokens

            self.q_block = query_block_tokens(self.geometry.q_dim, self.geometry.group)

    @property
    def decodes_apart(self) -> bool:
        """Whether the leading decodes of a step with prompt chunks attend in a launch of their own (on the GPU, as
        KernelConfig.decodes_apart asks)."""
        return self.kernels.decodes_apart and self.attn_kernels

    # ---- decode graphs ----
    def capture_graphs(self, cap: int, pool: object) -> tuple[int, float]:
        """Capture the decode graphs of batches up to `cap` into `pool`; returns (graphs, seconds)."""
        self.graphs = CudaGraphs(default_buckets(cap), pool)
        return len(self.graphs.buckets), self.graphs.capture(self._graph_inputs, self._graph_step)

    def destroy_graphs(self) -> None:
        if self.graphs is not None:
            self.graphs.destroy()
            self.graphs = None
        if self.pieces is not None:
            self.pieces.destroy()
            self.pieces = None

    # ---- graph pieces of steps with prompt chunks ----
    def capture_pieces(self, cap: int, pool: object) -> tuple[int, float]:
        """Capture the step pieces of up to `cap` tokens into `pool`; returns (buckets, seconds)."""
        g = self.geometry
        self.pieces = StepPieces(piece_buckets(cap), pool, g.heads, g.q_dim, g.o_dim, self.kv[0].dtype, self.device)
        return len(self.pieces.buckets), self.pieces.capture(self._piece_inputs, self._piece_forward)

    def _piece_inputs(self, b: int) -> None:
        """Static inputs a capture of bucket b records: tokens that read and write only the reserved page 0."""
        for t in (self.bufs.input_ids, self.bufs.positions, self.bufs.slot_mapping, *self.bufs.group_slots):
            t[:b].zero_()
        self.comm.begin_step(b)

    def _piece_forward(self, b: int, cut: AttentionCut) -> torch.Tensor:
        """What bucket b's pieces run: the forward over the static token fields, cut at each attention (which reads
        nothing else of the metadata)."""
        buf = self.bufs
        meta = AttentionMetadata(
            positions=buf.positions[:b], slot_mapping=buf.slot_mapping[:b], query_start_loc=buf.query_start_loc[:2],
            seq_lens=buf.seq_lens[:1], block_tables=buf.block_tables[:1], token_seq=buf.token_seq[:b],
            token_qpos=buf.token_qpos[:b], max_query_len=b, max_seq_len=b, block_size=self.block_size, cut=cut)
        meta.groups = _group_metadata(meta, [t[:1] for t in buf.tables[1:]], [x[:b] for x in buf.group_slots])
        return self.forward(buf.input_ids[:b], meta)

    def has_graph(self, n: int) -> bool:
        return self.graphs is not None and self.graphs.bucket_for(n) is not None

    def pieces_bucket(self, n: int) -> int | None:
        """The token bucket whose step pieces a step of n tokens (per rank) that no decode graph holds replays."""
        return self.pieces.bucket_for(n) if self.pieces is not None else None

    def time_replay(self, n: int, steps: int) -> float:
        """ms of the decode graph for n tokens alone, replayed back to back (same metadata as the last step)."""
        assert self.graphs is not None
        b = self.graphs.bucket_for(n)
        assert b is not None
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            self.graphs.replay(b)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / steps

    def static_addresses(self) -> list[int]:
        """Addresses graphs read (diagnostics: they never change)."""
        return [self.bufs.input_ids.data_ptr(), self.bufs.block_tables.data_ptr()]

    def _graph_inputs(self, b: int) -> None:
        """Static inputs a capture of bucket b records: padding rows that read and write only the reserved page 0."""
        ids, meta = self.decode_metadata(b)
        ids.zero_()
        meta.positions.zero_()
        meta.seq_lens.fill_(1)
        for m in (meta, *meta.groups):
            m.slot_mapping.zero_()
            m.block_tables.zero_()
        meta.query_start_loc.copy_(torch.arange(b + 1, device=ids.device))
        self.comm.begin_step(b)

    def _graph_step(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """What a decode graph of bucket b runs: logits of every row and their greedy tokens."""
        logits = self.forward_logits(*self.decode_metadata(b))
        return logits, self.comm.vocab_argmax(logits, kc=self._kc_sampling())

    def _metadata(self, batch: list[ScheduledChunk], pad_to: int | None = None, prev: PendingStep | None = None,
                  prev_rows: np.ndarray | None = None, pad_tokens_to: int | None = None
                  ) -> tuple[torch.Tensor, AttentionMetadata, np.ndarray, torch.Tensor]:
        """Write the batch's metadata into the static buffers. pad_to (decode graphs): pad to that many one-token
        rows that read and write only the reserved page 0. pad_tokens_to (step pieces): the token fields padded to
        that many with tokens that write only page 0 (no sequence holds them; the metadata returned has the step's
        own). prev_rows[b] >= 0: the last token of chunk b is row prev_rows[b] of `prev`'s sampled tokens (still on
        the device; a placeholder on the host). Returns the input ids, the attention metadata, the query start of
        each sequence (host) and the rows the step samples from (device; none for a decode graph, which samples
        every row), all uploaded in the one copy (a host list indexing a device tensor would reach it by a copy
        that waits for the step's kernels)."""
        t0 = time.perf_counter()
        bs, buf = self.block_size, self.bufs
        B = len(batch)
        lens = np.fromiter((c.num_tokens for c in batch), dtype=np.int64, count=B)
        starts = np.fromiter((c.start for c in batch), dtype=np.int64, count=B)
        # chained in C: a Python generator over every token would cost host time in proportion to the prompt
        ids = np.fromiter(chain.from_iterable(c.req.tokens(c.start, c.start + c.num_tokens) for c in batch),
                          dtype=np.int64, count=int(lens.sum()))
        if pad_to:
            extra = pad_to - B
            lens = np.concatenate([lens, np.ones(extra, np.int64)])
            starts = np.concatenate([starts, np.zeros(extra, np.int64)])
            ids = np.concatenate([ids, np.zeros(extra, np.int64)])
            B = pad_to
        qsl = np.zeros(B + 1, dtype=np.int64)
        np.cumsum(lens, out=qsl[1:])
        T = int(qsl[-1])
        token_seq = np.repeat(np.arange(B, dtype=np.int64), lens)
        token_qpos = np.arange(T, dtype=np.int64) - qsl[:-1][token_seq]
        positions = starts[token_seq] + token_qpos
        # every KV group's tables (the first's, then the sliding-window layers' of each further group)
        tables = [_page_table([c.req.pages for c in batch], B),
                  *(_page_table([c.req.group_pages[g] for c in batch], B) for g in range(self.groups - 1))]
        if self.groups == 1:
            table = tables[0][None]
        else:
            table = np.zeros((self.groups, B, max(t.shape[1] for t in tables)), dtype=np.int32)
            for g, t in enumerate(tables):
                table[g, :, : t.shape[1]] = t
        slots, *group_slots = (t[token_seq, positions // bs].astype(np.int64) * bs + positions % bs for t in tables)
        seq_lens = starts + lens
        fill_src = np.zeros(0, np.int64) if prev_rows is None else prev_rows[prev_rows >= 0].astype(np.int64)
        fill_dst = np.zeros(0, np.int64) if prev_rows is None else qsl[1:][: len(batch)][prev_rows >= 0] - 1
        ids[fill_dst] = 0
        if (ids < 0).any():
            raise RuntimeError("a placeholder token reached a step without the step that produces it")
        token_fields = dict(input_ids=ids, positions=positions, slot_mapping=slots, token_seq=token_seq,
                            token_qpos=token_qpos)
        if pad_tokens_to:
            pad = np.zeros(pad_tokens_to - T, np.int64)
            token_fields = {k: np.concatenate([a, pad]) for k, a in token_fields.items()}
            group_slots = [np.concatenate([a, pad]) for a in group_slots]
        max_q = int(lens.max(initial=0))
        rows = (np.zeros(0, np.int64) if pad_to else
                qsl[1:len(batch) + 1][np.fromiter((c.samples for c in batch), dtype=bool, count=len(batch))] - 1)
        # with prompt chunks, the leading decodes in a launch of their own (KernelConfig.decodes_apart)
        decodes = leading_decodes(lens) if self.decodes_apart and max_q > 1 else 0
        # (the Triton kernel's table; FlashAttention schedules its own query blocks)
        blocks = (query_blocks(lens, seq_lens, self.q_block, decodes).reshape(-1)
                  if self.q_block and max_q > 1 and not self.kernels.flash_prefill else np.zeros(0, np.int64))
        v = buf.upload(dict(**token_fields, fill_dst=fill_dst, fill_src=fill_src, query_start_loc=qsl,
                            seq_lens=seq_lens, q_blocks=blocks, sample_rows=rows), table, group_slots)
        if pad_tokens_to:
            v.update({k: v[k][:T] for k in token_fields})
            v["group_slots"] = [x[:T] for x in v["group_slots"]]
        if fill_dst.size:  # tokens the host does not have yet: from the previous step's output, on the device
            v["input_ids"].index_copy_(0, v["fill_dst"], prev.tokens.index_select(0, v["fill_src"]))
        meta = AttentionMetadata(
            positions=v["positions"], slot_mapping=v["slot_mapping"], query_start_loc=v["query_start_loc"],
            seq_lens=v["seq_lens"], block_tables=v["block_tables"], token_seq=v["token_seq"],
            token_qpos=v["token_qpos"], max_query_len=max_q, max_seq_len=int(seq_lens.max(initial=0)),
            block_size=bs, q_blocks=v["q_blocks"].view(-1, 2) if blocks.size else None, decodes=decodes,
            num_splits=self._kv_splits(len(batch) if max_q == 1 else decodes))
        meta.groups = _group_metadata(meta, v["group_tables"], v["group_slots"])
        self.last_metadata_s = time.perf_counter() - t0
        return v["input_ids"], meta, qsl, v["sample_rows"]

    def _kv_splits(self, decodes: int) -> int:
        """KV splits of the Triton attention launch over `decodes` one-token sequences (1 without them, or where
        the Triton kernels do not run)."""
        g = self.geometry
        return num_splits_for(decodes, g.split_units, min_programs=g.min_programs) if decodes and self.attn_kernels \
            else 1

    def decode_metadata(self, b: int) -> tuple[torch.Tensor, AttentionMetadata]:
        """The static-buffer views a decode graph of bucket b reads (contents written before each replay)."""
        buf = self.bufs
        meta = AttentionMetadata(
            positions=buf.positions[:b], slot_mapping=buf.slot_mapping[:b], query_start_loc=buf.query_start_loc[:b + 1],
            seq_lens=buf.seq_lens[:b], block_tables=buf.block_tables[:b], token_seq=buf.token_seq[:b],
            token_qpos=buf.token_qpos[:b], max_query_len=1, max_seq_len=0, block_size=self.block_size,
            num_splits=self._kv_splits(b))
        meta.groups = _group_metadata(meta, [t[:b] for t in buf.tables[1:]], [x[:b] for x in buf.group_slots])
        return buf.input_ids[:b], meta

    def release_order(self, tokens: int) -> int:
        """The release order (EARLY | LATE) the kernels of a forward of `tokens` tokens on this rank launch in."""
        return release_order_for(tokens, self.qkv_elems)

    def forward(self, ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # a few tokens on this rank: projections that stream their weights during the kernel before them, which
        # the LATE order of kernel launches leaves them to (moebius/kernels/linear.py); every kernel of the
        # forward runs in the step's order
        kc = self.kernels.with_release(self.release_order(ids.shape[0]))
        return self.model.forward(ids, meta, self.weights, self.kv, self.cfg, self.comm, kc, self.routed)

    def _attend(self, call: AttentionCall, q: torch.Tensor, out: torch.Tensor, meta: AttentionMetadata) -> None:
        """A layer's attention between two step pieces, over the step's own tokens and sequences (the family's)."""
        extra = {} if call.window is None and call.sinks is None else dict(window=call.window, sinks=call.sinks)
        self.model.attend(q, call.cache, meta.group(call.group), call.scale, call.kc, out, **extra)

    def _kc_sampling(self) -> KernelConfig:
        return self.kernels.with_release(EARLY)

    def forward_logits(self, ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Logits [T, V] of every new token (used by decode graphs, where every row samples)."""
        return self.model.logits(self.forward(ids, meta), self.weights, self.lm_head_fp32)

    def launch(self, batch: list[ScheduledChunk], stop_masks: list[tuple[int, list[int]]], sync: StepSync,
               prev: PendingStep | None = None, prev_rows: np.ndarray | None = None, graphs: bool = True
               ) -> PendingStep:
        """Enqueue the batch's step on the device; the sampled tokens come back through the returned PendingStep.
        Prompt logits (rare) are copied to the host here.

        stop_masks: (sampling-row, token ids) whose logits are forbidden this step (min_tokens).
        prev, prev_rows: see `_metadata` (overlap scheduling: `prev` is still in flight).
        graphs: False runs even a decode step eagerly (benchmarks compare the two).
        """
        use = graphs and self.graphs is not None and sync.all_decode
        bucket = self.graphs.bucket_for(sync.max_tokens) if use and self.graphs is not None else None
        # steps a decode graph does not hold replay the pieces of their token bucket (every rank alike: the
        # choice rests on what the ranks agreed)
        pieces = self.pieces_bucket(sync.max_tokens) if bucket is None and graphs else None
        prompt_logits: dict[int, torch.Tensor] = {}
        reqs = [c.req for c in batch if c.samples]
        k_lp = max((r.params.logprobs for r in reqs if r.params.logprobs is not None), default=None)
        greedy = not stop_masks and k_lp is None and all(r.params.temperature == 0 for r in reqs)
        if bucket is not None:  # every rank decodes only: replay the bucket's graph
            _, _, qsl, _ = self._metadata(batch, pad_to=bucket, prev=prev, prev_rows=prev_rows)
            logits, tokens = self.graphs.replay(bucket)
            routed = self._routed_rows(batch, qsl)
            if greedy:  # the graph's own argmax: no logits leave it. Its static output is read (copy to the host,
                # the next step's input fill) before the next replay overwrites it: both are enqueued before that
                return self._pending(tokens[: len(batch)], prompt_logits, routed=routed)
            logits = logits[: len(batch)]
        else:
            self.comm.begin_step(sync.max_tokens)
            ids, meta, qsl, rows = self._metadata(batch, prev=prev, prev_rows=prev_rows, pad_tokens_to=pieces)
            if pieces is not None:
                hidden = self.pieces.replay(pieces, ids.shape[0], lambda c, q, o: self._attend(c, q, o, meta))
            else:
                hidden = self.forward(ids, meta)
            routed = self._routed_rows(batch, qsl)
            for b, c in enumerate(batch):
                if c.req.wants_prompt_logits:
                    # positions not collected yet (a preempted request recomputes ones it already has)
                    lo = max(c.start, sum(x.shape[0] for x in c.req.prompt_logits))
                    hi = min(c.start + c.num_tokens, c.req.num_prompt)
                    if hi > lo:
                        h = hidden[int(qsl[b]) + lo - c.start: int(qsl[b]) + hi - c.start]
                        whole = self.comm.gather_vocab(self.model.logits(h, self.weights, self.lm_head_fp32))
                        prompt_logits[b] = whole.float().cpu()
            if not rows.numel():
                return self._pending(torch.zeros(0, dtype=torch.int64, device=self.device), prompt_logits,
                                     routed=routed)
            logits = self.model.logits(hidden.index_select(0, rows), self.weights, self.lm_head_fp32)
            if greedy:  # no sampling tensors to build and copy, no whole logits to gather
                return self._pending(self.comm.vocab_argmax(logits, kc=self._kc_sampling()), prompt_logits,
                                     routed=routed)
        tokens, whole = self._sample(logits, reqs, stop_masks)
        if k_lp is None:
            return self._pending(tokens, prompt_logits, routed=routed)
        whole = whole if whole is not None else self.comm.gather_vocab(logits)
        if self.logprobs_mode.startswith("processed"):  # the distribution the tokens were drawn from
            whole = processed_logits(whole, self._sampling_batch(reqs))
        return self._pending(tokens, prompt_logits, logprobs_of(whole, tokens, k_lp, self.logprobs_mode),
                             routed=routed)

    def _routed_rows(self, batch: list[ScheduledChunk], qsl: np.ndarray) -> RoutedRows | None:
        """The router's choices of the step's tokens whose requests ask for them, on their way to the host (one
        gather and one copy; nothing for a step where none asks)."""
        if self.routed is None:
            return None
        spans, rows, at = [], [], 0
        for b, c in enumerate(batch):
            lo, hi = routed_positions(c.req, c.start, c.num_tokens)
            if hi > lo:
                spans.append((c.req.request_id, lo, at, hi - lo))
                rows.append(np.arange(hi - lo, dtype=np.int64) + int(qsl[b]) + lo - c.start)
                at += hi - lo
        if not spans:
            return None
        picked = self.routed.index_select(0, self._to_device(np.concatenate(rows).tolist(), torch.int64))
        if self.device.type != "cuda":
            return RoutedRows(spans, picked)
        if not self._routed_readback:  # pinned once, on the first step that asks (a step allocates nothing)
            self._routed_readback = [torch.empty(self.routed.shape, dtype=self.routed.dtype, pin_memory=True)
                                     for _ in "ab"]
        host = self._routed_readback[self._turn][: picked.shape[0]]  # this turn's, as the tokens' (`_pending`)
        host.copy_(picked, non_blocking=True)  # complete once the step's event (recorded after it) is
        return RoutedRows(spans, host)

    def _sample(self, logits: torch.Tensor, reqs: list, stop_masks: list[tuple[int, list[int]]]
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The sampled tokens, and the whole vocabulary's logits where they were gathered for it (TP: else each
        rank holds a slice)."""
        if not stop_masks and all(r.params.top_k <= 0 and r.params.top_p >= 1.0 and r.params.min_p == 0
                                  for r in reqs):
            # greedy or temperature only: every vocab id is scored on its own, so each rank scores its slice and
            # the best across ranks wins (no whole logits to gather)
            scores = race_scores(logits, self._sampling_batch(reqs), self.comm.vocab_first(logits.shape[1]))
            return self.comm.vocab_argmax(scores, kc=self._kc_sampling()), None
        logits = self.comm.gather_vocab(logits)
        if stop_masks:
            at = self._to_device([(row, t) for row, banned in stop_masks for t in banned], torch.int64)  # [n, 2]
            logits.index_put_((at[:, 0], at[:, 1]), logits.new_full((at.shape[0],), -math.inf))
        if all(r.params.temperature == 0 for r in reqs):
            return logits.argmax(dim=-1), logits
        return sample(logits, self._sampling_batch(reqs)), logits

    def _pending(self, tokens: torch.Tensor, prompt_logits: dict[int, torch.Tensor],
                 logprobs: tuple[torch.Tensor, torch.Tensor] | None = None, routed: RoutedRows | None = None
                 ) -> PendingStep:
        """Start the tokens' copy to the host (into this turn's pinned buffer) and mark when it is done."""
        if not self._readback:
            return PendingStep(tokens, prompt_logits, tokens, None, logprobs, routed)
        host, done = self._readback[self._turn]
        host = host[: tokens.shape[0]]
        host.copy_(tokens, non_blocking=True)
        lp_host = None
        if logprobs is not None:
            n, width = logprobs[0].shape
            lp_host = tuple(buf[:n, :width] for buf in self._lp_readback[self._turn])
            for dst, src in zip(lp_host, logprobs, strict=True):
                dst.copy_(src, non_blocking=True)
        self._turn ^= 1
        done.record()
        return PendingStep(tokens, prompt_logits, host, done, lp_host, routed)

    def _to_device(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        """Small host values on the device without waiting for the GPU: staged through pinned memory (from pageable
        memory the copy may wait for the stream's queued kernels, the previous step's and this one's, and the
        host's work for the next step would no longer overlap them)."""
        t = torch.tensor(values, dtype=dtype)
        return t.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda" else t

    def _sampling_batch(self, reqs: list) -> SamplingBatch:
        V = self.cfg.vocab_size
        floats, ints = sampling_columns([(r.params, r.spec.seed, len(r.output_token_ids)) for r in reqs], V)
        (temp, top_p, min_p), top_k = floats, ints[0]
        # two copies: the float parameters, the integer ones
        f = self._to_device(floats, torch.float32)
        i = self._to_device(ints, torch.int64)
        return SamplingBatch(
            temperature=f[0], top_k=i[0], top_p=f[1], seeds=i[1], steps=i[2],
            all_greedy=all(t == 0 for t in temp), any_top_k=any(k < V for k in top_k),
            any_top_p=any(p < 1.0 for p in top_p), min_p=f[2] if any(p > 0 for p in min_p) else None)
