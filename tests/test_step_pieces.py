"""Step pieces (worker/cuda_graphs.StepPieces): the parts a CPU can check. The layer's side of the cut, the token
buckets, and the metadata a pieces step writes (token fields padded to the bucket with tokens that touch only page 0;
the attention's query-block table). Capture and replay need a GPU: tests/test_gpu.py
(test_step_pieces_match_eager_steps_in_bf16, test_graph_replay_equals_eager_across_switches)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from moebius.config import EngineConfig
from moebius.frontend.core import EngineCore
from moebius.layers.attention import query_blocks
from moebius.link.request import Request, RequestSpec
from moebius.sampling_params import SamplingParams
from moebius.worker.cuda_graphs import piece_buckets
from moebius.worker.scheduler import ScheduledChunk


@pytest.mark.parametrize("window,sinks", [(None, False), (6, True)], ids=["plain", "window-sinks"])
def test_a_forward_cut_at_attention_gives_the_attention_it_would_have_run(window: int | None, sinks: bool) -> None:
    """With an AttentionCut in the metadata, q goes into the cut's buffer (k and v into the cache as always) and the
    layer's output is whatever the cut hands back; attention run there over the step's metadata (its KV group's, a
    sliding window and sinks as the layer hands them to the cut) gives the uncut layer's output and cache."""
    from dataclasses import replace

    from attention_cases import paged_metadata

    from moebius.layers.attention import paged_attention, qkv_attention
    from moebius.layers.rotary import rope_table

    torch.manual_seed(0)
    bs, kvh, heads, d = 4, 2, 4, 16
    meta = paged_metadata([1, 30, 5], [40, 50, 20], bs, 64, "cpu")
    meta = replace(meta, kv_group=1)  # a layer of the second KV group: the cut is told
    T = 36
    qkv = torch.randn(T, (heads + 2 * kvh) * d)
    qn, kn, rope = torch.rand(d) + 0.5, torch.rand(d) + 0.5, rope_table(d, 256, 1e6, "cpu")
    cache = torch.randn(64, 2, bs, kvh, d)
    sink_logits = torch.randn(heads) if sinks else None

    class Cut:
        def __init__(self) -> None:
            self.q, self.o, self.calls = torch.zeros(64, heads, d), torch.zeros(64, heads, d), 0

        def q_buffer(self, n: int) -> torch.Tensor:
            return self.q[:n]

        def attend(self, q: torch.Tensor, cache: torch.Tensor, scale: float, kc: object, *, group: int = 0,
                   window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
            assert q.data_ptr() == self.q.data_ptr()  # the layer wrote q into the static buffer
            assert group == 1
            self.calls += 1
            return paged_attention(q, cache, meta, scale, out=self.o[: q.shape[0]], window=window, sinks=sinks)

    want_cache, got_cache = cache.clone(), cache.clone()
    want = qkv_attention(qkv, qn, kn, rope, want_cache, meta, 1e-6, d ** -0.5, window=window, sinks=sink_logits)
    cut = Cut()
    got = qkv_attention(qkv, qn, kn, rope, got_cache, replace(meta, cut=cut), 1e-6, d ** -0.5, window=window,
                        sinks=sink_logits)
    assert cut.calls == 1 and got.data_ptr() == cut.o.data_ptr()
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_cache, want_cache)
    if window is not None:  # (the window and sinks change the layer's output)
        assert not torch.allclose(want, qkv_attention(qkv, qn, kn, rope, cache.clone(), meta, 1e-6, d ** -0.5))


def test_step_piece_buckets() -> None:
    assert piece_buckets(2048) == [16, 32, 64, 128, 256, 384, 512, 640, 768, 896, 1024, 1280, 1536, 1792, 2048]
    assert piece_buckets(100) == [16, 32, 64, 100] and piece_buckets(16) == [16] and piece_buckets(0) == []
    assert piece_buckets(3000)[-3:] == [2560, 2816, 3000]


def test_a_pieces_step_pads_its_token_fields_and_tables_its_query_blocks() -> None:
    """The metadata of a step replayed in pieces: the static token fields up to the bucket hold the step's tokens,
    then padding that reads token 0 at position 0 and writes slot 0 (the reserved page 0), whatever an earlier step
    left there; the metadata handed to attention holds the step's own tokens only, and its query-block table is the
    step's (`query_blocks`)."""
    with EngineCore(EngineConfig.from_kwargs(device="cpu")) as e:
        rank = e.ranks.rank
        runner, alloc, bs = rank.runner, rank.kv_pages.first, rank.spec.engine.block_size
        chunks = []
        for i, (prompt, start, n) in enumerate([(30, 0, 30), (9, 8, 1), (50, 16, 20)]):
            req = Request(RequestSpec(f"r{i}", list(range(1, prompt + 1)), SamplingParams(max_tokens=4), 0, 64))
            req.pages = alloc.allocate(-(-(start + n) // bs))
            chunks.append(ScheduledChunk(req, start, n))
        T, bucket = 51, 64
        for t in runner.bufs.host_meta:
            t.fill_(7)  # what earlier, larger steps left in the host mirrors the fields are uploaded from
        runner.q_block = 8  # the GPU kernel's block (CPU runners build no table)
        try:
            ids, meta, *_ = runner._metadata(chunks, pad_tokens_to=bucket)
        finally:
            runner.q_block = None
            for c in chunks:
                alloc.free(c.req.pages)
        assert ids.shape[0] == meta.positions.shape[0] == meta.slot_mapping.shape[0] == meta.token_seq.shape[0] == T
        assert ids.tolist() == list(range(1, 31)) + [9] + list(range(17, 37))
        for t in (runner.bufs.input_ids, runner.bufs.positions, runner.bufs.slot_mapping):
            assert not t[T:bucket].any() and t[bucket] == 7  # padding up to the bucket, nothing past it
        want = query_blocks(np.array([30, 1, 20]), np.array([30, 9, 36]), 8)
        assert meta.q_blocks is not None and meta.q_blocks.tolist() == want.tolist()


def test_leading_decodes_of_a_step_with_chunks_attend_apart() -> None:
    """--mixed-attention apart: the metadata of a step with prompt chunks says how many of its first sequences are
    decodes (they attend in a decode launch of their own, with the KV splits of a decode batch that size) and its
    query-block table holds only the sequences after them; shared (the default) tables every sequence."""
    from moebius.layers.attention import num_splits_for

    for how in ("apart", "shared"):
        with EngineCore(EngineConfig.from_kwargs(device="cpu", mixed_attention=how)) as e:
            rank = e.ranks.rank
            runner, alloc, bs = rank.runner, rank.kv_pages.first, rank.spec.engine.block_size
            chunks = []
            for i, (prompt, start, n) in enumerate([(9, 8, 1), (12, 11, 1), (30, 0, 30), (20, 19, 1)]):
                req = Request(RequestSpec(f"r{i}", list(range(1, prompt + 1)), SamplingParams(max_tokens=4), 0, 64))
                req.pages = alloc.allocate(-(-(start + n) // bs))
                chunks.append(ScheduledChunk(req, start, n))
            # as on a GPU: its Triton attention runs, with the kernel's query block (CPU runners build no table)
            runner.attn_kernels, runner.q_block = True, 8
            try:
                _, meta, *_ = runner._metadata(chunks)
            finally:
                runner.attn_kernels, runner.q_block = False, None
                for c in chunks:
                    alloc.free(c.req.pages)
            first = 2 if how == "apart" else 0
            want = query_blocks(np.array([1, 1, 30, 1]), np.array([9, 12, 30, 20]), 8, first)
            assert meta.q_blocks is not None and meta.q_blocks.tolist() == want.tolist()
            assert meta.decodes == first
            assert meta.num_splits == (num_splits_for(2, runner.kv[0].shape[3]) if first else 1)


def test_a_family_asking_for_more_programs_splits_its_decodes_further() -> None:
    """`AttentionGeometry.min_programs` (MLA's: kernels/mla.DECODE_MIN_PROGRAMS): where the split table leaves a
    decode launch fewer programs, its keys are split up to that many (a power of two, at most 32); where the table
    gives more it stands, and a family asking nothing (GQA's 0) keeps the table. The runner asks its geometry."""
    from moebius.layers.attention import num_splits_for

    batches = (1, 4, 16, 33, 64, 65, 128, 129, 1024)
    assert [num_splits_for(b, 1, min_programs=256) for b in batches] == [32, 32, 16, 4, 4, 2, 2, 1, 1]
    assert [num_splits_for(b, 1) for b in batches] == [32, 16, 16, 1, 1, 1, 1, 1, 1]
    assert num_splits_for(8, 8, min_programs=256) == 4  # DeepSeek-V3's 128 heads: 8 programs a sequence
    with EngineCore(EngineConfig.from_kwargs(device="cpu")) as e:
        runner = e.ranks.rank.runner
        assert runner.geometry.min_programs == 0
        runner.attn_kernels, plain = True, runner.geometry
        try:
            assert runner._kv_splits(16) == num_splits_for(16, plain.split_units)
            runner.geometry = dataclasses.replace(plain, min_programs=256)
            assert runner._kv_splits(16) == num_splits_for(16, plain.split_units, min_programs=256) > 1
        finally:
            runner.attn_kernels, runner.geometry = False, plain
