"""Attention metadata for kernel tests (tests/test_gpu.py, tests/test_kernels_interpreter.py): sequences over
shuffled pages, as the paged KV allocator leaves them."""

from __future__ import annotations

import torch

from moebius.layers.attention import AttentionMetadata


def paged_metadata(q_lens: list[int], ctx: list[int], bs: int, pages: int, dev: str, seed: int = 1
                   ) -> AttentionMetadata:
    """Random distinct page tables for sequences holding ctx[i] tokens (the last q_lens[i] of them new); page 0,
    the padding page, is never used."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(pages - 1, generator=g) + 1
    width = max(-(-c // bs) for c in ctx)
    table = torch.zeros(len(ctx), width, dtype=torch.int32)
    used = 0
    for i, c in enumerate(ctx):
        n = -(-c // bs)
        table[i, :n] = perm[used: used + n].int()
        used += n
    qsl = torch.tensor([0] + q_lens).cumsum(0)
    seq = torch.repeat_interleave(torch.arange(len(ctx)), torch.tensor(q_lens))
    qpos = torch.arange(int(qsl[-1])) - qsl[:-1][seq]
    positions = torch.tensor(ctx)[seq] - torch.tensor(q_lens)[seq] + qpos
    slots = table[seq, positions // bs].long() * bs + positions % bs
    t = lambda x: x.to(dev)  # noqa: E731
    return AttentionMetadata(t(positions), t(slots), t(qsl), t(torch.tensor(ctx)), t(table), t(seq), t(qpos),
                             max(q_lens), max(ctx), bs)
