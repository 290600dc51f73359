"""GPU tests (pytest -m gpu; skipped without CUDA): each fast kernel against its torch reference on random data,
and CUDA-graph replay against eager execution token for token, across layout switches."""

from __future__ import annotations

import pytest
import torch

from moebius import LLM, SamplingParams
from moebius.layers.attention import AttentionMetadata, paged_attention, paged_attention_ref
from moebius.layers.moe import experts, experts_ref

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _metadata(q_lens: list[int], ctx: list[int], bs: int, pages: int, dev: str) -> AttentionMetadata:
    """Random distinct page tables for sequences holding ctx[i] tokens (the last q_lens[i] of them new)."""
    g = torch.Generator().manual_seed(1)
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


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 2, 128), (16, 2, 128), (4, 4, 64), (32, 4, 128)])
@pytest.mark.parametrize("kind", ["decode", "prefill", "mixed"])
def test_paged_attention_matches_reference(heads: int, kv_heads: int, head_dim: int, kind: str) -> None:
    torch.manual_seed(0)
    bs, pages = 16, 512
    if kind == "decode":
        ctx, q_lens = [1, 17, 300, 1000, 64], [1] * 5
    elif kind == "prefill":
        ctx = [5, 70, 257]
        q_lens = list(ctx)
    else:
        ctx, q_lens = [40, 33, 500, 9], [1, 20, 1, 9]
    meta = _metadata(q_lens, ctx, bs, pages, "cuda")
    cache = torch.randn(pages, 2, bs, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(sum(q_lens), heads, head_dim, device="cuda", dtype=torch.bfloat16)
    ref = paged_attention_ref(q.float(), cache.float(), meta, head_dim ** -0.5)
    for splits in ([1, 4, 16] if kind == "decode" else [1]):
        meta.num_splits = splits
        out = paged_attention(q, cache, meta, head_dim ** -0.5)
        assert torch.isfinite(out).all()
        assert _rel(out, ref) < 1e-2, (kind, splits)


@pytest.mark.parametrize("first_expert,local", [(0, 8), (8, 8), (0, 16)])
def test_grouped_experts_match_reference(first_expert: int, local: int) -> None:
    torch.manual_seed(0)
    T, K, D, I, E = 77, 4, 256, 128, 16
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(E, device="cuda")[:K] for _ in range(T)])
    w = torch.rand(T, K, device="cuda").softmax(-1).to(torch.bfloat16)
    w13 = torch.randn(local, 2 * I, D, device="cuda", dtype=torch.bfloat16) * 0.05
    w2 = torch.randn(local, D, I, device="cuda", dtype=torch.bfloat16) * 0.05
    out = experts(x, w, ids, w13, w2, first_expert)
    ref = experts_ref(x.float(), w.float(), ids, w13.float(), w2.float(), first_expert)
    assert torch.isfinite(out).all()
    assert _rel(out, ref) < 2e-2


def _run(llm: LLM, prompts: list[list[int]], switch_at: set[int]) -> dict[int, list[int]]:
    """Greedy + seeded requests arriving over time, with layout switches at the given steps."""
    ids, done, step = {}, {}, 0
    while len(done) < len(prompts):
        if step < len(prompts):
            sp = (SamplingParams(temperature=0, max_tokens=24, ignore_eos=True) if step % 2 else
                  SamplingParams(temperature=0.8, top_p=0.9, seed=step, max_tokens=24, ignore_eos=True))
            ids[llm.add_request(prompts[step], sp)] = step
        if step in switch_at:
            assert llm.switch_mode("ep" if llm.mode == "tp" else "tp")["done"]
        for o in llm.step():
            if o.finished:
                done[ids[o.request_id]] = o.token_ids
        step += 1
    return done


@pytest.mark.parametrize("num_ranks", [1, 2])
def test_graph_replay_equals_eager_across_switches(num_ranks: int) -> None:
    if torch.cuda.device_count() < num_ranks:
        pytest.skip(f"needs {num_ranks} GPUs")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 384, (int(n),), generator=g).tolist() for n in torch.randint(1, 60, (10,), generator=g)]
    kw = dict(num_ranks=num_ranks, max_total_tokens=8192, max_model_len=512, cuda_graph_max_bs=16, dtype="float32")
    # float32 keeps both runs' argmax stable (bf16 reductions in different kernels could flip near-ties)
    with LLM(**kw) as llm:
        graph = _run(llm, prompts, {3, 6, 9, 14, 20, 27})
    with LLM(disable_cuda_graph=True, **kw) as llm:
        eager = _run(llm, prompts, {3, 6, 9, 14, 20, 27})
    assert graph == eager
