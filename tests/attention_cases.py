"""Cases shared by the kernel tests (tests/test_gpu.py, tests/test_kernels_interpreter.py): attention metadata
(sequences over shuffled pages, as the paged KV allocator leaves them) and the q/k norm + RoPE + cache write."""

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


def qk_norm_rope_kv_errors(heads: int, kv_heads: int, T: int, d: int, dev: str, dtype: torch.dtype,
                           norm: bool = True) -> tuple[float, float, bool]:
    """kernels.fused.qk_norm_rope_kv against the torch reference: relative errors of q and of the cached k, and
    whether v went into the cache unchanged. norm False: no q/k norms (GPT-OSS's, Mixtral's attention)."""
    from moebius.kernels.fused import qk_norm_rope_kv
    from moebius.layers.norm import rms_norm
    from moebius.layers.rotary import apply_rope, rope_table

    torch.manual_seed(0)
    bs = 16
    rope = rope_table(d, 4096, 1e6, dev)
    qkv = torch.randn(T, (heads + 2 * kv_heads) * d, device=dev, dtype=dtype)
    qn, kn = (torch.rand(d, device=dev, dtype=dtype) + 0.5 for _ in range(2))
    pos = torch.randint(0, 4096, (T,), device=dev)
    slots = torch.randperm(64 * bs, device=dev)[:T]
    cache = torch.full((64, 2, bs, kv_heads, d), float("nan"), device=dev, dtype=dtype)
    if not norm:
        qn = kn = None
    q = qk_norm_rope_kv(qkv, qn, kn, rope, pos, slots, cache, heads, 1e-6)
    rq, rk, rv = qkv.float().split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    normed = (lambda x, w: rms_norm(x, w.float(), 1e-6)) if norm else (lambda x, w: x)  # noqa: E731
    want_q = apply_rope(normed(rq.unflatten(-1, (-1, d)), qn), pos, rope)
    want_k = apply_rope(normed(rk.unflatten(-1, (-1, d)), kn), pos, rope)
    rel = lambda a, b: ((a.float() - b).norm() / b.norm()).item()  # noqa: E731
    k, v = cache[slots // bs, 0, slots % bs], cache[slots // bs, 1, slots % bs]
    return rel(q, want_q), rel(k, want_k), torch.equal(v, rv.unflatten(-1, (-1, d)).to(dtype))
