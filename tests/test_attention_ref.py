"""The reference paged attention never lets unwritten cache bytes into a result: positions past a sequence's end
(the rest of its last page, padding pages of the block table) may hold anything, NaN included."""

from __future__ import annotations

import torch

from moebius.layers.attention import AttentionMetadata, paged_attention_ref


def test_garbage_past_sequence_end_does_not_leak() -> None:
    torch.manual_seed(0)
    bs, kvh, d = 4, 2, 16
    cache = torch.full((8, 2, bs, kvh, d), float("nan"))
    cache[1, :, :3] = torch.randn(2, 3, kvh, d)  # sequence 0: 3 tokens in page 1
    cache[2] = torch.randn(2, bs, kvh, d)  # sequence 1: 6 tokens in pages 2, 3
    cache[3, :, :2] = torch.randn(2, 2, kvh, d)
    meta = AttentionMetadata(
        positions=torch.tensor([2, 5]), slot_mapping=torch.tensor([6, 13]), query_start_loc=torch.tensor([0, 1, 2]),
        seq_lens=torch.tensor([3, 6]), block_tables=torch.tensor([[1, 0], [2, 3]], dtype=torch.int32),
        token_seq=torch.tensor([0, 1]), token_qpos=torch.tensor([0, 0]), max_query_len=1, max_seq_len=6, block_size=bs)
    q = torch.randn(2, 4, d)
    out = paged_attention_ref(q, cache, meta, d ** -0.5)
    assert torch.isfinite(out).all()
    # sequence 0 alone gives the same answer as in the batch
    alone = AttentionMetadata(
        positions=torch.tensor([2]), slot_mapping=torch.tensor([6]), query_start_loc=torch.tensor([0, 1]),
        seq_lens=torch.tensor([3]), block_tables=torch.tensor([[1]], dtype=torch.int32), token_seq=torch.tensor([0]),
        token_qpos=torch.tensor([0]), max_query_len=1, max_seq_len=3, block_size=bs)
    torch.testing.assert_close(paged_attention_ref(q[:1], cache, alone, d ** -0.5), out[:1])


def test_mixed_step_equals_each_sequence_alone(monkeypatch) -> None:
    """Decodes and prompt chunks in one step (the reference takes them apart so that a decode is not padded to a
    chunk's length): every token's output equals dense causal attention over its own sequence."""
    from attention_cases import paged_metadata

    torch.manual_seed(0)
    bs, kvh, heads, d = 4, 2, 4, 16
    q_lens, ctx = [1, 30, 1, 5, 1], [40, 50, 9, 20, 3]
    meta = paged_metadata(q_lens, ctx, bs, 64, "cpu")
    cache = torch.randn(64, 2, bs, kvh, d)
    q = torch.randn(sum(q_lens), heads, d)
    import moebius.layers.attention as A

    calls = []
    inner = A.paged_attention_ref

    def spy(q, cache, meta, scale, **opts):
        calls.append((meta.seq_lens.numel(), meta.max_query_len))
        return inner(q, cache, meta, scale, **opts)

    monkeypatch.setattr(A, "paged_attention_ref", spy)
    out = A.paged_attention_ref(q, cache, meta, d ** -0.5)
    assert calls == [(5, 30), (3, 1), (2, 30)]  # the 3 decodes apart: none padded to 30 query rows
    for b, (n, L) in enumerate(zip(q_lens, ctx, strict=True)):
        j = torch.arange(L)
        kv = cache[meta.block_tables[b, j // bs].long(), :, j % bs]  # [L, 2, kvh, d]
        k, v = (x.repeat_interleave(heads // kvh, dim=1) for x in (kv[:, 0], kv[:, 1]))  # [L, heads, d]
        rows = slice(int(meta.query_start_loc[b]), int(meta.query_start_loc[b + 1]))
        s = torch.einsum("thd,lhd->htl", q[rows], k) * d ** -0.5
        s = s.masked_fill(j[None, None, :] > (L - n + torch.arange(n))[None, :, None], float("-inf"))
        torch.testing.assert_close(out[rows], torch.einsum("htl,lhd->thd", s.softmax(-1), v))


def test_query_blocks_cover_every_chunk_once_longest_key_walk_first() -> None:
    """The attention launch's table for steps with prompt chunks: every (sequence, block) of each chunk once, none
    past a chunk's end (a decode is one block), ordered by the keys the block's last query sees, most first."""
    import numpy as np

    from moebius.layers.attention import query_blocks

    q_lens, seq_lens = np.array([1, 40, 1, 16, 17]), np.array([90, 40, 5, 116, 17])
    got = query_blocks(q_lens, seq_lens, 16)
    want = {(0, 0), (1, 0), (1, 1), (1, 2), (2, 0), (3, 0), (4, 0), (4, 1)}
    assert {tuple(r) for r in got.tolist()} == want and len(got) == len(want)
    keys = [seq_lens[b] - q_lens[b] + min((m + 1) * 16, q_lens[b]) for b, m in got.tolist()]
    assert keys == sorted(keys, reverse=True) and got[0].tolist() == [3, 0]
    # the leading decodes attending apart: the table holds the sequences after them, a later decode included
    rest = query_blocks(q_lens, seq_lens, 16, first=1)
    assert rest.tolist() == [r for r in got.tolist() if r[0] >= 1]


def test_leading_decodes() -> None:
    import numpy as np

    from moebius.layers.attention import leading_decodes

    assert leading_decodes(np.array([1, 1, 1, 40, 1])) == 3
    assert leading_decodes(np.array([40, 1])) == 0 and leading_decodes(np.array([1, 1])) == 2


def test_flash_lens_start_past_the_leading_decodes_and_are_made_once_a_step() -> None:
    """FlashAttention's varlen arguments cover the sequences after the decodes that attend apart: int32 query starts
    from 0, their KV lengths; a step's metadata makes them on first use and hands the same tensors to every layer."""
    meta = AttentionMetadata(
        positions=torch.zeros(24, dtype=torch.int64), slot_mapping=torch.zeros(24, dtype=torch.int64),
        query_start_loc=torch.tensor([0, 1, 2, 22, 24]), seq_lens=torch.tensor([40, 500, 33, 9]),
        block_tables=torch.zeros(4, 40, dtype=torch.int32), token_seq=torch.zeros(24, dtype=torch.int64),
        token_qpos=torch.zeros(24, dtype=torch.int64), max_query_len=20, max_seq_len=500, block_size=16, decodes=2)
    starts, lens = meta.chunk_lens
    assert starts.dtype == lens.dtype == torch.int32
    assert starts.tolist() == [0, 20, 22] and lens.tolist() == [33, 9]
    assert meta.chunk_lens[0] is starts
