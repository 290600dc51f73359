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
