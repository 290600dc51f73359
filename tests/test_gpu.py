"""GPU tests (pytest -m gpu; skipped without CUDA): each fast kernel against its torch reference on random data,
and CUDA-graph replay against eager execution token for token, across layout switches."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch
from attention_cases import paged_metadata, qk_norm_rope_kv_errors

from moebius import LLM, SamplingParams
from moebius.kernels import DEFAULT_KERNELS, LATE, KernelConfig
from moebius.kernels.pairs import PairRows
from moebius.layers.attention import paged_attention, paged_attention_ref
from moebius.layers.moe import experts, experts_ref
from moebius.link.messages import DecodeProbe, PrefillProbe

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


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
    meta = paged_metadata(q_lens, ctx, bs, pages, "cuda")
    cache = torch.randn(pages, 2, bs, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(sum(q_lens), heads, head_dim, device="cuda", dtype=torch.bfloat16)
    ref = paged_attention_ref(q.float(), cache.float(), meta, head_dim ** -0.5)
    for splits in ([1, 4, 16, 32] if kind == "decode" else [1]):  # every decode tile shape
        meta.num_splits = splits
        out = paged_attention(q, cache, meta, head_dim ** -0.5)
        assert torch.isfinite(out).all()
        assert _rel(out, ref) < 1e-2, (kind, splits)


@pytest.mark.parametrize("heads,kv_heads", [(32, 4), (16, 2)])
def test_fresh_chunk_attention_matches_reference(heads: int, kv_heads: int) -> None:
    """A long first chunk alone in its step goes to cuDNN (kernels.attention.fresh_chunk): the reference's output,
    and the paged kernel's within bf16 noise."""
    from moebius.kernels import attention as A

    torch.manual_seed(0)
    T, bs, d = 2500, 16, 128
    kc = KernelConfig(fresh_chunk_lengths=frozenset({T}))
    meta = paged_metadata([T], [T], bs, 200, "cuda")
    cache = torch.randn(200, 2, bs, kv_heads, d, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(T, heads, d, device="cuda", dtype=torch.bfloat16)
    assert A.fresh_chunk(meta.block_tables, meta.max_query_len, meta.max_seq_len, kc.fresh_chunk_lengths)
    assert A.cudnn_attention_works(0), "cuDNN attention failed on this GPU: every step takes the paged kernel"
    out = paged_attention(q, cache, meta, d ** -0.5, kc=kc)
    kernel = A.paged_attention(q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, T, d ** -0.5)
    ref = paged_attention_ref(q.float(), cache.float(), meta, d ** -0.5)
    assert _rel(out, ref) < 1e-2 and _rel(out, kernel) < 1e-2


def _flash_or_skip() -> None:
    from moebius.kernels.flash import unavailable_reason

    reason = unavailable_reason(0)
    if reason is not None:
        pytest.skip(reason)


def _flash_compiled() -> int:
    """Kernels FlashAttention-4 has compiled (or loaded) in this process; 0 where it is not installed."""
    try:
        from flash_attn.cute import interface
    except ImportError:
        return 0
    return sum(len(f.compile_cache.cache) for f in (interface._flash_attn_fwd, interface._compute_tile_cumsum,
                                                   interface._compute_blocks_to_batch))


def test_flash_attention_only_where_it_runs() -> None:
    """FlashAttention-4 takes half precision on Hopper or newer: auto falls back to the Triton kernel elsewhere (the
    float32 oracle runs), flash names why it cannot, triton never takes it."""
    from moebius.config import ConfigError
    from moebius.kernels.flash import unavailable_reason, use_flash

    cuda = torch.device("cuda", 0)
    assert not use_flash("auto", cuda, torch.float32, 128) and not use_flash("triton", cuda, torch.bfloat16, 128)
    assert not use_flash("auto", cuda, torch.bfloat16, 12)
    with pytest.raises(ConfigError, match="takes bfloat16 or float16, not torch.float32"):
        use_flash("flash", cuda, torch.float32, 128)
    with pytest.raises(ConfigError, match="head_dim of 8 to 256 in steps of 8, not 12"):
        use_flash("flash", cuda, torch.bfloat16, 12)
    assert use_flash("auto", cuda, torch.bfloat16, 128) == (unavailable_reason(0) is None)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(32, 4, 128), (16, 2, 128), (8, 4, 16)])
@pytest.mark.parametrize("kind", ["prefill", "prefix", "apart", "shared", "fresh"])
def test_flash_attention_matches_reference(heads: int, kv_heads: int, head_dim: int, kind: str,
                                           monkeypatch) -> None:
    """Steps with prompt chunks through FlashAttention-4 (kc.flash_prefill): whole prompts, chunks after a cached
    prefix, leading decodes in their Triton launch (apart) or in FlashAttention's (shared), and a lone fresh chunk
    (K and V gathered contiguous) all give the reference's output, written into the given buffer, by one
    FlashAttention launch (the Triton kernel alone would give the same output)."""
    _flash_or_skip()
    from moebius.kernels import flash

    calls = []
    forward = flash._forward
    monkeypatch.setattr(flash, "_forward", lambda q, *a, **kw: (calls.append(q.shape), forward(q, *a, **kw))[1])
    torch.manual_seed(0)
    bs, pages = 16, 512
    q_lens, ctx = {"prefill": ([5, 70, 257], [5, 70, 257]), "prefix": ([64, 500, 3], [300, 1000, 40]),
                   "apart": ([1, 1, 20, 9], [40, 500, 33, 9]), "shared": ([1, 1, 20, 9], [40, 500, 33, 9]),
                   "fresh": ([2500], [2500])}[kind]
    kc = KernelConfig(flash_prefill=True, fresh_chunk_lengths=frozenset({2500}))
    meta = paged_metadata(q_lens, ctx, bs, pages, "cuda")
    if kind == "apart":
        meta.decodes, meta.num_splits = 2, 4
    cache = torch.randn(pages, 2, bs, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(sum(q_lens), heads, head_dim, device="cuda", dtype=torch.bfloat16)
    ref = paged_attention_ref(q.float(), cache.float(), meta, head_dim ** -0.5)
    out = torch.full_like(q, float("nan"))
    assert paged_attention(q, cache, meta, head_dim ** -0.5, kc=kc, out=out) is out
    assert torch.isfinite(out).all()  # (apart: the decodes' rows come from the Triton launch)
    assert _rel(out, ref) < 1e-2
    skipped = meta.decodes  # the tokens of the decodes attending apart
    assert [s[-3] for s in calls] == [sum(q_lens) - skipped]  # (the fresh chunk: the batch form [1, T, H, d])


@pytest.mark.parametrize("backend", ["triton", "grouped_mm"])
@pytest.mark.parametrize("T", [1, 77, 600])
@pytest.mark.parametrize("first_expert,local", [(0, 8), (8, 8), (0, 16)])
def test_experts_match_reference(first_expert: int, local: int, T: int, backend: str) -> None:
    torch.manual_seed(0)
    K, D, I, E = 4, 256, 192, 16
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(E, device="cuda")[:K] for _ in range(T)])
    w = torch.rand(T, K, device="cuda").softmax(-1).to(torch.bfloat16)
    w13 = torch.randn(local, 2 * I, D, device="cuda", dtype=torch.bfloat16) * 0.05
    w2 = torch.randn(local, D, I, device="cuda", dtype=torch.bfloat16) * 0.05
    out = experts(x, w, ids, w13, w2, first_expert, kc=KernelConfig(moe_backend=backend))
    ref = experts_ref(x.float(), w.float(), ids, w13.float(), w2.float(), first_expert)
    assert torch.isfinite(out).all()
    assert _rel(out, ref) < 2e-2


@pytest.mark.parametrize("bm", [32, 64, 128])
def test_half_blocks_match_reference(bm: int) -> None:
    """The fused MoE with half blocks (`TileConfig.halves`) at each sorted table row's tiles of its BM (TMA ones
    included: down's activation tiles then through pointers) against float32 math, 150 pairs an expert: an expert's
    last block whole or half, as its count falls."""
    from moebius.kernels import fused_moe as fm

    torch.manual_seed(0)
    K, D, I, E, T = 4, 512, 384, 16, 600
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(E, device="cuda")[:K] for _ in range(T)])
    w = torch.rand(T, K, device="cuda").softmax(-1).to(torch.bfloat16)
    w13 = torch.randn(E, 2 * I, D, device="cuda", dtype=torch.bfloat16) * 0.05
    w2 = torch.randn(E, D, I, device="cuda", dtype=torch.bfloat16) * 0.05
    ref = experts_ref(x.float(), w.float(), ids, w13.float(), w2.float(), 0)
    for c in [c for _, c in fm.CONFIGS if c.BM == bm]:
        cfg = fm.MoEConfig(bm, *(replace(t, halves=True) for t in (c.gate_up, c.down)))
        out = fm.fused_experts(x, w, ids, w13, w2, 0, E, config=cfg)
        assert torch.isfinite(out).all() and _rel(out, ref) < 2e-2, (cfg, _rel(out, ref))


@pytest.mark.parametrize("pairs", [32, 64, 128])
def test_gpt_oss_shape_table_matches_reference(pairs: int) -> None:
    """bf16 experts of GPT-OSS's shape (2880 x 2880) through their own table's launches (`SHAPE_CONFIGS`: 64-row
    blocks at 32 pairs an expert, one 128-row block an expert with half blocks at 64, 128-row half blocks at 128)
    against float32 math."""
    from moebius.kernels import fused_moe as fm

    torch.manual_seed(0)
    K, D, I, E = 4, 2880, 2880, 8
    T = pairs * E // K
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(E, device="cuda")[:K] for _ in range(T)])
    w = torch.rand(T, K, device="cuda").softmax(-1).to(torch.bfloat16)
    w13 = torch.randn(E, 2 * I, D, device="cuda", dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(E, D, I, device="cuda", dtype=torch.bfloat16) * 0.02
    assert fm.config_for(T * K, E, 1, fm.table_for(w13, D)) == fm.pick_config(pairs, fm.SHAPE_CONFIGS[(I, D)])
    out = fm.fused_experts(x, w, ids, w13, w2, 0, E)
    ref = experts_ref(x.float(), w.float(), ids, w13.float(), w2.float(), 0)
    assert torch.isfinite(out).all() and _rel(out, ref) < 2e-2, _rel(out, ref)


@pytest.mark.parametrize("act8", [True, False])
@pytest.mark.parametrize("T", [1, 77, 600, 2100])
def test_fp8_rows_experts_and_projections_match_reference(T: int, act8: bool) -> None:
    """--quantization fp8's kernels on FP8 rows (the fused MoE and `linear_fp8`, direct and sorted blocks) against
    float32 math on the dequantized weights: W8A8 (kc.fp8_activations) on the activations as `quantize_groups`
    rounds them, W8A16 on the activations as they are; each nearer its own reference than the other one. W8A16 at
    2100 rows takes the prompt sizes' paths: the projection's weight unpacked for cuBLAS, the experts unpacked for the
    plain kernels (525 pairs an expert; 600 rows: 150, the FP8 kernels' 128-row blocks)."""
    import torch.nn.functional as F

    from moebius.kernels.fp8_rows import pack_rows, quantize_groups, unpack_rows
    from moebius.layers.linear import linear

    torch.manual_seed(0)
    K, D, I, E, N = 4, 512, 256, 16, 384
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(E, device="cuda")[:K] for _ in range(T)])
    w = torch.rand(T, K, device="cuda").softmax(-1).to(torch.bfloat16)
    # (as the engine holds them where TP over ranks may cut down's columns: gate|up and q|k|v in one segment a row)
    w13 = pack_rows(torch.randn(E, 2 * I, D, device="cuda") * 0.05, whole=True)
    w2 = pack_rows(torch.randn(E, D, I, device="cuda") * 0.05)
    wp = pack_rows(torch.randn(N, D, device="cuda") * 0.05, whole=True)
    kc = KernelConfig(fp8_activations=act8)
    out = experts(x, w, ids, w13, w2, 0, kc=kc)
    proj = linear(x, wp, kc=kc)
    def fused_act(gu: torch.Tensor) -> torch.Tensor:  # the fused kernel's roundings of what the second GEMM reads
        g, u = gu.bfloat16().float().chunk(2, dim=-1)
        return (F.silu(g).bfloat16().float() * u).bfloat16().float()

    refs = {}
    for a8, q in ((True, quantize_groups), (False, lambda t: t)):
        refs[a8] = (experts_ref(q(x.float()), w.float(), ids, w13, w2, 0, act=lambda gu, q=q: q(fused_act(gu))),
                    F.linear(q(x.float()), unpack_rows(wp, D, torch.float32)))
    # a row or two in the LATE order: `linear_fp8_rows` (weights held in registers), the same statements
    late = linear(x, wp, kc=kc.with_release(LATE))
    for got, want, other in zip((out, proj, late), (*refs[act8], refs[act8][1]), (*refs[not act8], refs[not act8][1]),
                                strict=True):
        print(T, act8, _rel(got, want), _rel(got, other))
        assert torch.isfinite(got).all()
        # (float8 activations round to 3 mantissa bits: a value the kernel and the reference round on either side of
        # a step differs by up to 1/16, so W8A8's own error is above bf16's; still well below the other form's)
        assert _rel(got, want) < min(2e-2, _rel(got, other) / 2)


def test_fp8_rows_unpacked_in_one_launch_equal_unpack_rows() -> None:
    """`linear.unpack_fp8` (W8A16's weight past UNPACK_ROWS rows, multiplied by cuBLAS) is `unpack_rows` bit for bit
    in bf16 and float16, either row layout (Qwen3-30B-A3B's o projection; a ragged chunk and a partial row block)."""
    from moebius.kernels.fp8_rows import pack_rows, unpack_rows
    from moebius.kernels.linear import unpack_fp8

    torch.manual_seed(0)
    for N, K in ((2048, 4096), (77, 300)):
        for whole in (False, True):  # (a segment a chunk, and one a row: kernels/fp8_rows.py)
            w = pack_rows(torch.randn(N, K, device="cuda") * 0.05, whole=whole)
            for dt in (torch.bfloat16, torch.float16):
                assert torch.equal(unpack_fp8(w, K, dt), unpack_rows(w, K, dt)), (N, K, dt, whole)


@pytest.mark.parametrize("gpt_oss", [False, True])
@pytest.mark.parametrize("first_expert,local", [(0, 16), (8, 8)])
@pytest.mark.parametrize("T", [1, 2, 8, 77, 600, 4096])
def test_mxfp4_rows_experts_match_reference(T: int, first_expert: int, local: int, gpt_oss: bool) -> None:
    """--quantization mxfp4's fused MoE on MXFP4 rows (W4A16: each weight tile decoded to bf16 in registers) against
    float32 math on the rows `unpack_rows` dequantizes: each launch on its own input (gate_up's rows of h; down's
    outputs per pair, on the kernel's h) and the whole `experts` against `experts_ref`. Decode sizes (direct blocks)
    to sizes whose bf16 configs take TMA (T = 600, 4096: MXFP4 rows go without); GPT-OSS's hidden size 2880 (whole
    K steps) and a TP-2 shard of its intermediate, 1440 (22.5 K steps); GPT-OSS's biases and clamped activation."""
    from moebius.kernels import fused_moe as fm
    from moebius.kernels.mxfp4_rows import pack_rows, unpack_rows
    from moebius.layers.moe import ClampedSwiGLU, swiglu

    torch.manual_seed(0)
    K, D, I, E = 4, 2880, 1440, 16
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(E, device="cuda")[:K] for _ in range(T)])
    w = torch.rand(T, K, device="cuda").softmax(-1).to(torch.bfloat16)
    w13 = pack_rows(torch.randn(local, 2 * I, D, device="cuda") * 0.02)
    w2 = pack_rows(torch.randn(local, D, I, device="cuda") * 0.02)
    act = ClampedSwiGLU(alpha=1.702, limit=7.0) if gpt_oss else swiglu
    b13 = torch.randn(local, 2 * I, device="cuda", dtype=torch.bfloat16) * 0.5 if gpt_oss else None
    b2 = torch.randn(local, D, device="cuda", dtype=torch.bfloat16) * 0.1 if gpt_oss else None
    clamp = (act.alpha, act.limit) if gpt_oss else None
    b13_f = torch.zeros(local, 2 * I, device="cuda") if b13 is None else b13.float()  # (the reference's: 0 for none)
    b2_f = torch.zeros(local, D, device="cuda") if b2 is None else b2.float()
    c = fm.config_for(T * K, E, E // local)
    blocks = (fm.direct(ids, first_expert, c.BM) if T * K <= fm.DIRECT_MAX_PAIRS
              else fm.align(ids, first_expert, local, c.BM))
    h = fm.gate_up(x, w13, blocks, K, c.gate_up, b13_EF=b13, clamp=clamp)
    y = fm.down(h, w2, blocks, w.reshape(-1), c.down, b2_ED=b2)
    row = torch.arange(T * K, device="cuda")  # each pair's row of h (direct: its own; sorted: where the align put it)
    if not blocks.direct:
        used = blocks.rows < T * K
        row[blocks.rows[used].long()] = torch.nonzero(used).flatten()
    got_h, want_h, got_y, want_y = [], [], [], []
    for e in range(local):
        p = torch.nonzero(ids.flatten() - first_expert == e).flatten()
        w13_e, w2_e = unpack_rows(w13[e], D, torch.float32), unpack_rows(w2[e], I, torch.float32)
        got_h.append(h[row[p]])
        want_h.append(act(x[p // K].float() @ w13_e.T + b13_f[e]))
        got_y.append(y[p])
        want_y.append(w.flatten()[p, None].float() * (h[row[p]].float() @ w2_e.T + b2_f[e]))
    out = experts(x, w, ids, w13, w2, first_expert, E, act=act, b13_EF=b13, b2_ED=b2)
    ref = experts_ref(x.float(), w.float(), ids, w13, w2, first_expert, act=act, b13_EF=b13_f, b2_ED=b2_f)
    for got, want in ((torch.cat(got_h), torch.cat(want_h)), (torch.cat(got_y), torch.cat(want_y)), (out, ref)):
        assert torch.isfinite(got).all()
        assert _rel(got, want) < 1e-2, (T, first_expert, gpt_oss, _rel(got, want))


def _run(llm: LLM, prompts: list[list[int]], switch_at: set[int]) -> dict[int, list[int]]:
    """Greedy and seeded requests (top-p: whole logits; temperature only: TP's per-slice scores) arriving over time,
    with layout switches at the given steps: on their own (switch_mode) or riding on the step (request_switch)."""
    kinds = [dict(temperature=0), dict(temperature=0.8, top_p=0.9), dict(temperature=1.1)]
    ids, done, step = {}, {}, 0
    while len(done) < len(prompts):
        if step < len(prompts):
            sp = SamplingParams(seed=step, max_tokens=24, ignore_eos=True, **kinds[step % 3])
            ids[llm.add_request(prompts[step], sp)] = step
        target = "ep" if llm.mode == "tp" else "tp"
        deferred = step in switch_at and step % 2 == 0
        if step in switch_at and not deferred:
            assert llm.switch_mode(target).done
        elif deferred:  # rides on this step: the step is queued right behind the pass, no wait between them
            llm.engine.request_switch(target)
        for o in llm.step():
            if o.finished:
                done[ids[o.request_id]] = o.token_ids
        if deferred:
            assert llm.engine.last_switch is not None and llm.engine.last_switch.done and llm.mode == target
        step += 1
    return done


@pytest.mark.parametrize("num_ranks", [1, 2])
def test_graph_replay_equals_eager_across_switches(num_ranks: int) -> None:
    """Graphs (overlap scheduling on, the default) = eager = graphs with each step resolved first; every engine
    warmed up at start (the default on a GPU; the other tests here skip it for time)."""
    if torch.cuda.device_count() < num_ranks:
        pytest.skip(f"needs {num_ranks} GPUs")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 384, (int(n),), generator=g).tolist() for n in torch.randint(1, 60, (10,), generator=g)]
    kw = dict(num_ranks=num_ranks, mode="tp", max_total_tokens=8192, max_model_len=512, cuda_graph_max_bs=16,
              dtype="float32")
    # float32 keeps both runs' argmax stable (bf16 reductions in different kernels could flip near-ties)
    with LLM(**kw) as llm:
        used = llm.engine.probe(DecodeProbe(batch=2, context=8, steps=1, warmup=0, graphs=True))
        assert all(r["cuda_graph"] for r in used)  # decode steps of this engine do replay graphs
        used = llm.engine.probe(PrefillProbe(tokens=40, context=8, steps=1, warmup=0))
        assert all(r["pieces"] for r in used)  # ... and steps with prompt chunks their pieces
        graph = _run(llm, prompts, {3, 6, 9, 14, 20, 27})
    with LLM(disable_cuda_graph=True, **kw) as llm:
        eager = _run(llm, prompts, {3, 6, 9, 14, 20, 27})
    # graphs with every step resolved before the next (the runs above overlap: input tokens come from the device)
    with LLM(disable_overlap_schedule=True, **kw) as llm:
        resolved = _run(llm, prompts, {3, 6, 9, 14, 20, 27})
    assert graph == eager == resolved


def test_prefix_cache_gives_the_tokens_of_prompts_computed_in_full() -> None:
    """Requests sharing prefixes (a system prompt, four copies of each prompt admitted in one step, a second wave
    after the first finished, then arrivals one a step with layout switches between them, which keep shared pages
    shared) give through the prefix cache the tokens they give computed in full, with step pieces (the paged kernel
    between graphs) and eagerly: a page shared in the step that computes it is written before any attention reads
    it, on the GPU's paths too."""
    g = torch.Generator().manual_seed(2)
    system = torch.randint(0, 384, (100,), generator=g).tolist()
    prompts = [system + torch.randint(0, 384, (n,), generator=g).tolist() for n in (30, 7, 64)]
    jobs = [p for p in prompts for _ in range(4)]
    kw = dict(mode="tp", max_total_tokens=8192, max_model_len=512, dtype="float32")
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def run(llm: LLM) -> tuple[list[list[int]], list[int]]:
        outs = llm.generate(jobs, sp) + llm.generate(prompts, sp)
        switched = _run(llm, jobs, {3, 6, 9, 14})
        return [o.token_ids for o in outs] + [switched[i] for i in range(len(jobs))], [o.num_cached_tokens
                                                                                       for o in outs]

    with LLM(**kw) as llm:
        pieces, cached = run(llm)
    with LLM(disable_cuda_graph=True, **kw) as llm:
        eager, cached_eager = run(llm)
    with LLM(disable_prefix_caching=True, **kw) as llm:
        full, none = run(llm)
    # 16-token pages: the system prompt fills 6 (96 tokens); a copy takes every full page short of its last token
    assert cached == cached_eager == [0, 128, 128, 128, 96, 96, 96, 96, 96, 160, 160, 160, 128, 96, 160]
    assert not any(none)
    assert pieces == eager == full


@pytest.mark.parametrize("mixed", ["shared", "apart"])
def test_step_pieces_match_eager_steps_in_bf16(mixed: str) -> None:
    """Steps with prompt chunks replay graph pieces around eager attention: a fresh 2048-token chunk alone (cuDNN,
    writing into the pieces' static output) and chunks beside decodes (the paged kernel, over padded buckets; with
    --mixed-attention apart the decodes in a launch of their own) give the prompt logits and tokens of the same
    steps run eagerly with the decodes in the chunks' launch."""
    with LLM(mixed_attention=mixed, **_MIXED_KW) as llm:
        assert all(r["pieces"] for r in llm.engine.probe(PrefillProbe(tokens=2048, context=0, steps=1, warmup=0)))
        pieces = _mixed_run(llm)
    with LLM(disable_cuda_graph=True, mixed_attention="shared", **_MIXED_KW) as llm:
        eager = _mixed_run(llm)
    _assert_same_logits(pieces, eager)


def test_flash_prefill_gives_the_logits_of_the_triton_kernel() -> None:
    """The engine with --prefill-attention flash (FlashAttention-4 for every step with prompt chunks, in pieces and
    eagerly) against triton (the paged kernel, cuDNN for the lone fresh chunk): the same prompt logits and tokens."""
    _flash_or_skip()
    with LLM(prefill_attention="flash", **_MIXED_KW) as llm:
        assert llm.engine.query("kernels")[0]["flash_prefill"]
        flash = _mixed_run(llm)
    with LLM(prefill_attention="triton", **_MIXED_KW) as llm:
        triton_kernel = _mixed_run(llm)
    _assert_same_logits(flash, triton_kernel)


_MIXED_KW = dict(mode="tp", max_total_tokens=16384, max_model_len=4096, max_num_batched_tokens=4096, dtype="bfloat16")


def _mixed_run(llm: LLM) -> list[tuple[torch.Tensor, list[int]]]:
    """A 2048-token prompt alone, then a 300- and a 45-token one arriving while it decodes (mixed steps): each
    one's prompt logits and greedy tokens."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 384, (n,), generator=g).tolist() for n in (2048, 300, 45)]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logits=True)
    ids = [llm.add_request(prompts[0], sp)]
    outs = {}
    for step in range(40):
        if step in (1, 3):
            ids.append(llm.add_request(prompts[(step + 1) // 2], sp))
        outs.update({o.request_id: o for o in llm.step() if o.finished})
    return [(outs[i].prompt_logits, outs[i].token_ids) for i in ids]


def _assert_same_logits(a: list[tuple[torch.Tensor, list[int]]], b: list[tuple[torch.Tensor, list[int]]]) -> None:
    for (la, ta), (lb, tb) in zip(a, b, strict=True):
        assert la.shape == lb.shape and _rel(la, lb) < 1e-2
        assert ta[:2] == tb[:2]  # bf16: later tokens may part at a near-tie


def test_served_steps_compile_no_kernel_after_the_warmup() -> None:
    """Start-up's warm-up (the default on a GPU) runs every kernel variant the engine's steps launch, on the path each
    step is served on: afterwards, prompts arriving one a step beside 1 to ~30 decoding requests (decodes attending
    apart, with KV splits by their count), decode batches past the decode graphs, steps past the step pieces and
    short of the budget, greedy, temperature-only and top-p sampling, in both layouts,
    make Triton compile (or load from disk) no kernel, nor FlashAttention-4 where it is installed: the first
    requests run at steady-state speed."""
    import triton

    g = torch.Generator().manual_seed(2)
    kw = dict(mode="tp", max_model_len=512, max_num_batched_tokens=512, cuda_graph_max_bs=8,
              cuda_graph_max_tokens=256, dtype="bfloat16")
    compiled: dict[str, list[str]] = {}
    with LLM(**kw) as llm:
        flash = _flash_compiled()
        for layout in ("tp", "ep"):
            if llm.mode != layout:
                assert llm.switch_mode(layout).done  # a switch's own kernels are not the steps' (not counted)
            seen = compiled.setdefault(layout, [])
            triton.knobs.runtime.jit_cache_hook = lambda seen=seen, **kw: seen.append(
                f"{kw['repr'].split('(')[0]} {kw['compile']['key']}")
            try:
                for i in range(30):
                    n = int(torch.randint(2, 400, (1,), generator=g))
                    how = [dict(temperature=0.0), {}, dict(temperature=0.8, top_p=0.9, seed=i)][i % 3]  # {}: the
                    # default parameters (temperature 1)
                    sp = SamplingParams(max_tokens=int(torch.randint(20, 60, (1,), generator=g)), ignore_eos=True,
                                        **how)
                    llm.add_request(torch.randint(0, 384, (n,), generator=g).tolist(), sp)
                    llm.step()
                while llm.has_unfinished():
                    llm.step()
            finally:
                triton.knobs.runtime.jit_cache_hook = None
        assert _flash_compiled() == flash  # nor FlashAttention-4 (where installed) any of its kernels
        if llm.engine.query("kernels")[0]["flash_prefill"]:
            assert flash > 0  # ... which the warm-up compiled (or loaded)
    assert compiled == {"tp": [], "ep": []}


def test_steps_launch_without_waiting_for_the_gpu(monkeypatch) -> None:
    """Launching a step never waits for the GPU: a sync there (e.g. a host list indexing a device tensor) holds the
    host until the step before and this one have run, so the host's work for the next step no longer overlaps the
    GPU's (at ~1000 running requests that work is milliseconds). Under torch's sync debug mode set to raise: prompt
    chunks alone and beside decodes (in step pieces, and eagerly past them), decode batches past the decode graphs
    and inside them, greedy, temperature-only, top-p, min_tokens (banned tokens) and logprobs rows, both layouts."""
    from moebius.worker.runner import ModelRunner

    launch = ModelRunner.launch

    def strict(self, *args, **kwargs):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return launch(self, *args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    g = torch.Generator().manual_seed(3)
    kinds = [dict(temperature=0.0), {}, dict(temperature=0.8, top_p=0.9), dict(temperature=0.0, min_tokens=4),
             dict(temperature=0.7, logprobs=2)]
    with LLM(mode="tp", max_model_len=512, max_num_batched_tokens=512, cuda_graph_max_bs=8,
             cuda_graph_max_tokens=256, dtype="bfloat16") as llm:
        monkeypatch.setattr(ModelRunner, "launch", strict)
        for layout in ("tp", "ep"):
            if llm.mode != layout:
                assert llm.switch_mode(layout).done
            for i in range(20):
                n = int(torch.randint(2, 400, (1,), generator=g))
                llm.add_request(torch.randint(0, 384, (n,), generator=g).tolist(),
                                SamplingParams(max_tokens=12, ignore_eos=i % 5 != 3, seed=i, **kinds[i % 5]))
                llm.step()
            while llm.has_unfinished():
                llm.step()


def test_add_rmsnorm_matches_reference() -> None:
    from moebius.kernels.fused import add_rmsnorm
    from moebius.layers.norm import rms_norm

    torch.manual_seed(0)
    for n in (128, 2048, 4096):
        x = torch.randn(37, n, device="cuda", dtype=torch.bfloat16)
        res = torch.randn(37, n, device="cuda", dtype=torch.bfloat16)
        w = torch.rand(n, device="cuda", dtype=torch.bfloat16) + 0.5
        want_res = res + x
        want = rms_norm(want_res, w, 1e-6)
        got_res = res.clone()
        got = add_rmsnorm(x, got_res, w, 1e-6)
        assert torch.equal(got_res, want_res)
        assert _rel(got, want) < 1e-2
        assert _rel(add_rmsnorm(x, None, w, 1e-6), rms_norm(x, w, 1e-6)) < 1e-2


def test_pairs_summed_inside_the_norm_match_the_two_launches() -> None:
    """PairRows.add_rms_norm (sum over k, residual add, norm in one launch) gives sum_k then add_rmsnorm's bits,
    the rows of another rank's experts (never written: NaN here) left out."""
    from moebius.kernels.fused import add_rmsnorm

    torch.manual_seed(0)
    for T, D, first, local in ((1, 128, 0, 128), (300, 2048, 0, 128), (77, 2048, 32, 64)):
        ids = torch.randint(0, 128, (T, 8), device="cuda")
        y = torch.randn(T * 8, D, device="cuda", dtype=torch.bfloat16)
        y[((ids < first) | (ids >= first + local)).flatten()] = float("nan")
        pairs = PairRows(y, ids, first, local)
        res = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
        w = torch.rand(D, device="cuda", dtype=torch.bfloat16) + 0.5
        want_res, got_res = res.clone(), res.clone()
        want = add_rmsnorm(pairs.sum(), want_res, w, 1e-6)
        got = pairs.add_rms_norm(got_res, w, 1e-6)
        assert torch.equal(got, want) and torch.equal(got_res, want_res), (T, D, first)


def test_shared_experts_added_inside_the_pair_sum_match_the_unfused_add() -> None:
    """Pairs carrying the shared experts' output (`PairRows.plus`) sum to sum_k then `+`'s bits, and their sum inside
    the next norm's launch (`add_rms_norm`, a rank's combine) to those bits then `add_rmsnorm`'s."""
    from moebius.kernels.fused import add_rmsnorm

    torch.manual_seed(0)
    for T, D, first, local in ((1, 2048, 0, 64), (1024, 2048, 0, 64), (77, 5120, 32, 64)):
        ids = torch.randint(0, 64 + first, (T, 6), device="cuda")
        y = torch.randn(T * 6, D, device="cuda", dtype=torch.bfloat16)
        y[((ids < first) | (ids >= first + local)).flatten()] = float("nan")
        pairs, shared = PairRows(y, ids, first, local), torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
        assert torch.equal(pairs.plus(shared).sum(), pairs.sum() + shared), (T, D, first)
        res, w = torch.randn(T, D, device="cuda", dtype=torch.bfloat16), torch.rand(D, device="cuda") + 0.5
        got_res, want_res = res.clone(), res.clone()
        got = pairs.plus(shared).add_rms_norm(got_res, w.bfloat16(), 1e-6)
        want = add_rmsnorm(pairs.sum() + shared, want_res, w.bfloat16(), 1e-6)
        assert torch.equal(got, want) and torch.equal(got_res, want_res), (T, D, first)


@pytest.mark.parametrize("T,I", [(1, 1408), (64, 1408), (1024, 1408), (33, 10944), (5, 100)])
def test_swiglu_launch_matches_torch(T: int, I: int) -> None:
    """kernels.fused.swiglu (the dense MLPs' and shared experts' activation in one launch) against torch's silu and
    product in bf16: the same roundings, so the same bits but where the two exps differ in their last bit."""
    import torch.nn.functional as F

    from moebius.kernels.fused import swiglu

    torch.manual_seed(0)
    h = torch.randn(T, 2 * I, device="cuda", dtype=torch.bfloat16) * 3
    got, want = swiglu(h), F.silu(h[:, :I]) * h[:, I:]
    assert (got == want).float().mean() > 0.995 and _rel(got, want) < 1e-2


@pytest.mark.parametrize("heads,kv_heads", [(16, 2), (8, 4), (4, 1)])
@pytest.mark.parametrize("T", [1, 45, 100, 700])  # one head a program, a few, all of a token's
@pytest.mark.parametrize("norm", [True, False])  # False: no q/k norms (GPT-OSS, Mixtral)
def test_qk_norm_rope_kv_matches_reference(heads: int, kv_heads: int, T: int, norm: bool) -> None:
    q_err, k_err, v_same = qk_norm_rope_kv_errors(heads, kv_heads, T, 128, "cuda", torch.bfloat16, norm)
    assert q_err < 1e-2 and k_err < 1e-2 and v_same


@pytest.mark.parametrize("heads,kv_heads,splits", [(16, 2, 32), (32, 4, 16), (8, 4, 1), (16, 2, 4)])
def test_decode_attention_from_qkv_matches_two_launches(heads: int, kv_heads: int, splits: int) -> None:
    """kernels.attention.qk_decode_attention (q/k norm, RoPE and the cache write inside the attention launch)
    against qk_norm_rope_kv then paged_attention: the same cache contents and outputs."""
    from moebius.kernels.attention import qk_decode_attention
    from moebius.layers.attention import qk_norm_rope_kv
    from moebius.layers.rotary import rope_table

    torch.manual_seed(0)
    d, bs, pages = 128, 16, 512
    ctx = [1, 17, 300, 1000, 64, 513]
    meta = paged_metadata([1] * len(ctx), ctx, bs, pages, "cuda")
    meta.num_splits = splits
    rope = rope_table(d, 4096, 1e6, "cuda")
    qkv = torch.randn(len(ctx), (heads + 2 * kv_heads) * d, device="cuda", dtype=torch.bfloat16)
    qn, kn = (torch.rand(d, device="cuda", dtype=torch.bfloat16) + 0.5 for _ in range(2))
    cache = torch.randn(pages, 2, bs, kv_heads, d, device="cuda", dtype=torch.bfloat16)
    want_cache = cache.clone()
    want = paged_attention(qk_norm_rope_kv(qkv, qn, kn, rope, want_cache, meta, 1e-6), want_cache, meta, d ** -0.5)
    got = qk_decode_attention(qkv, qn, kn, rope, meta.positions, meta.slot_mapping, cache, heads, 1e-6,
                              meta.block_tables, meta.seq_lens, meta.query_start_loc, d ** -0.5, splits)
    new = meta.slot_mapping
    assert _rel(cache[new // bs, :, new % bs], want_cache[new // bs, :, new % bs]) < 1e-2  # the new k and v
    assert torch.equal(cache[new // bs, 1, new % bs], want_cache[new // bs, 1, new % bs])  # v: copied as it is
    assert _rel(got, want) < 1e-2


@pytest.mark.parametrize("norm", [True, False])
def test_topk_softmax_matches_reference(norm: bool) -> None:
    from moebius.kernels.fused import topk_softmax

    torch.manual_seed(0)
    logits = torch.randn(300, 128, device="cuda", dtype=torch.bfloat16) * 3
    w, ids = topk_softmax(logits, 8, norm)
    p = logits.float().softmax(-1)
    rw, rids = p.topk(8, dim=-1)
    if norm:
        rw = rw / rw.sum(-1, keepdim=True)
    # bf16 logits tie often: compare the chosen probabilities (order of equal ones may differ), then the weights
    assert torch.equal(p.gather(1, ids), p.gather(1, rids))
    assert torch.allclose(w, rw, atol=1e-6)


def test_router_matches_linear_then_topk() -> None:
    """The few-token router (K-split logits summed by the top-k kernel) against cuBLAS logits then top-k."""
    import torch.nn.functional as F

    from moebius.kernels.fused import route, router_fits, topk_softmax

    torch.manual_seed(0)
    for T, D in [(1, 2048), (7, 4096), (16, 2048)]:
        x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
        gate = torch.randn(128, D, device="cuda", dtype=torch.bfloat16) * 0.02
        assert router_fits(x, gate)
        w, ids = route(x, gate, 8, True)
        rw, rids = topk_softmax(F.linear(x, gate), 8, True, x.dtype)
        p = F.linear(x.float(), gate.float()).softmax(-1)
        # both round the logits to bf16, from sums in another order: compare the chosen probabilities
        assert torch.allclose(p.gather(1, ids), p.gather(1, rids), atol=1e-3)
        assert torch.allclose(w.float(), rw.float(), atol=1e-2)


def test_few_row_linear_matches_float32_product() -> None:
    """The prefetching projection (kernels/linear.py) at 30B / 235B shard shapes, 1-3 rows, in a CUDA graph after
    another kernel (its weight loads run before it waits; or after, wait_first), in both release orders: within
    bf16 rounding of the float32 product."""
    from moebius import kernels
    from moebius.kernels.fused import add_rmsnorm
    from moebius.kernels.linear import fits, linear

    torch.manual_seed(0)
    ones = torch.ones(8192, device="cuda", dtype=torch.bfloat16)
    for N, K in [(2560, 2048), (5120, 2048), (2048, 4096), (4608, 4096), (4096, 8192), (100, 300)]:
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02
        b = torch.randn(N, device="cuda", dtype=torch.bfloat16)
        LATE, EARLY = kernels.LATE, kernels.EARLY
        assert fits(torch.zeros(2, K, device="cuda", dtype=torch.bfloat16), w, DEFAULT_KERNELS.with_release(LATE))
        # EARLY: it would hold the SMs
        assert not fits(torch.zeros(1, K, device="cuda", dtype=torch.bfloat16), w, DEFAULT_KERNELS.with_release(EARLY))
        for T, bias, order, first in [(1, None, LATE, False), (1, b, EARLY, False), (2, b, LATE, False),
                                      (3, b, LATE, False), (2, None, LATE, True)]:
            x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
            kc = DEFAULT_KERNELS.with_release(order)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):  # its input written by the kernel just before
                h = add_rmsnorm(x, None, ones[:K], 1e-6, kc=kc)
                y = linear(h, w, bias, wait_first=first, kc=kc)
            g.replay()
            torch.cuda.synchronize()
            want = torch.nn.functional.linear(h.float(), w.float(), None if bias is None else bias.float())
            assert torch.allclose(y.float(), want, rtol=1e-2, atol=1e-2), (N, K, T, first,
                                                                          (y.float() - want).abs().max())


def test_few_row_tensor_core_linear_matches_float32_product() -> None:
    """The tensor-core projection for 3-32 rows (kernels/linear.py linear_mma) at 30B / 235B shard shapes and ragged
    ones, in a CUDA graph after another kernel, in both release orders; the model's linear picks it where `fits`
    (one or two rows, LATE) does not: within bf16 rounding of the float32 product."""
    from moebius import kernels
    from moebius.kernels import linear as kl
    from moebius.kernels.fused import add_rmsnorm
    from moebius.layers.linear import linear

    torch.manual_seed(0)
    ones = torch.ones(8192, device="cuda", dtype=torch.bfloat16)
    for N, K in [(2560, 2048), (2048, 2048), (5120, 2048), (2048, 4096), (4608, 4096), (100, 300)]:
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02
        b = torch.randn(N, device="cuda", dtype=torch.bfloat16)
        for T, bias, order in [(3, b, kernels.LATE), (4, None, kernels.EARLY), (8, None, kernels.LATE),
                               (16, b, kernels.EARLY), (32, None, kernels.LATE), (33, None, kernels.EARLY)]:
            x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
            assert kl.fits_mma(x, w) == (T <= kl.MMA_MAX_ROWS) and not kl.fits_mma(x[:2], w)
            kc = DEFAULT_KERNELS.with_release(order)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):  # its input written by the kernel just before
                h = add_rmsnorm(x, None, ones[:K], 1e-6, kc=kc)
                y = kl.linear_mma(h, w, bias, kc=kc) if T <= kl.MMA_MAX_ROWS else linear(h, w, bias, kc=kc)
            g.replay()
            torch.cuda.synchronize()
            want = torch.nn.functional.linear(h.float(), w.float(), None if bias is None else bias.float())
            assert torch.allclose(y.float(), want, rtol=1e-2, atol=1e-2), (N, K, T, (y.float() - want).abs().max())
    # the model's projections take it from 3 rows (2 keep the one-row kernel or cuBLAS)
    calls = []
    kernel = kl.linear_mma
    try:
        kl.linear_mma = lambda *a, **kw: calls.append(a[0].shape[0]) or kernel(*a, **kw)
        for T in (2, 3, 32, 33):
            linear(torch.randn(T, K, device="cuda", dtype=torch.bfloat16), w,
                   kc=DEFAULT_KERNELS.with_release(kernels.release_order_for(T, w.numel())))
    finally:
        kl.linear_mma = kernel
    assert calls == [3, 32]


def test_argmax_keys_match_torch_argmax() -> None:
    """The one-launch vocabulary argmax (kernels/fused.py) against torch.argmax on bf16 logits with ties."""
    from moebius.kernels.fused import argmax_keys
    from moebius.layers.sampler import key_ids

    torch.manual_seed(0)
    x = torch.randn(300, 75968, device="cuda").to(torch.bfloat16)  # bf16 rounding makes ties common
    x[1] = -x[1].abs() - 1.0
    x[2, [10, 70000]] = 30.0
    assert torch.equal(key_ids(argmax_keys(x, 0)), x.argmax(-1))
    assert torch.equal(key_ids(argmax_keys(x[:1], 75968)), x[:1].argmax(-1) + 75968)


def test_dual_layout_peak_memory_within_3_percent_of_static_ep() -> None:
    """Holding both layouts (TP attention shards, TP static buffers and graphs) costs < 3% over an EP-only engine
    with the same KV cache, on real Qwen3-30B-A3B layer shapes (4 layers)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs (each engine's ranks then measure their own processes)")
    kw = dict(model="qwen3-30b-a3b", load_format="dummy", num_layers=4, num_ranks=2, mode="ep",
              max_total_tokens=262144, max_model_len=1088, max_running_requests=256)
    peaks = {}
    for static in (True, False):
        with LLM(static_layout=static, **kw) as llm:
            llm.engine.probe(DecodeProbe(batch=64, context=1024, steps=2, warmup=1, graphs=True))
            peaks[static] = max(m["peak_reserved"] for m in llm.engine.query("memory"))
    assert peaks[False] <= 1.03 * peaks[True], peaks


@pytest.mark.parametrize("mode", ["tp", "ep"])
def test_symmetric_exchange_gives_the_tokens_nccl_gives(mode: str) -> None:
    """TP's all-reduce and EP's dispatch / combine go through symmetric memory by default (graphs and eager
    prefill; EP prefill chunks above the symmetric capacity through NCCL) and produce the tokens of the NCCL-only
    engine (--disable-custom-all-reduce); each engine reports which path it set up."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    kw = dict(model="qwen3-30b-a3b", load_format="dummy", num_layers=4, num_ranks=2, mode=mode,
              max_total_tokens=65536, max_model_len=4096, max_running_requests=64, max_num_batched_tokens=4096,
              warmup="none")
    prompts = [[(7 * i + 13 * j) % 150000 + 1 for j in range(5 + 9 * i)] for i in range(12)]
    prompts.append([(j * 31) % 150000 + 1 for j in range(3000)])  # an EP prefill chunk past 2048 tokens: NCCL
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    got = {}
    for disable in (False, True):
        with LLM(disable_custom_all_reduce=disable, **kw) as llm:
            comm = llm.engine.query("comm")
            assert all(r[m]["symmetric"] is (not disable) for r in comm for m in ("tp", "ep")), comm
            got[disable] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
            used = [r[mode]["symmetric_calls"] for r in llm.engine.query("comm")]
            assert all(n > 0 for n in used) if not disable else used == [0, 0], used  # the path really ran
    assert got[False] == got[True]


def _fused_all_reduce_rank(rank: int, port: int, results: torch.multiprocessing.Queue) -> None:
    import torch.distributed as dist

    from moebius.kernels.fused import add_rmsnorm
    from moebius.parallel.dispatch import SymmetricAllReduce

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            device_id=torch.device("cuda", rank))
    try:
        D, eps = 2048, 1e-6
        sym = SymmetricAllReduce(dist.group.WORLD, 4096 * D, torch.bfloat16, torch.device("cuda", rank))
        g = torch.Generator(device="cuda").manual_seed(0)  # the same residual and weight on both ranks
        weight = torch.randn(D, device="cuda", generator=g, dtype=torch.bfloat16)
        failures = []

        def case(T: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16) * (rank + 1)
            return x, torch.randn(T, D, device="cuda", generator=g, dtype=torch.bfloat16), x.clone()

        def check(name: str, x: torch.Tensor, res0: torch.Tensor, out: torch.Tensor, res: torch.Tensor) -> None:
            total = x.clone()
            dist.all_reduce(total)
            want_res = res0.clone()
            want = add_rmsnorm(total, want_res, weight, eps)
            every = [torch.empty_like(out) for _ in range(2)]
            dist.all_gather(every, out)
            if not torch.equal(res, want_res) or _rel(out, want) > 1e-2 or not torch.equal(every[0], every[1]):
                failures.append(f"{name}: residual equal {torch.equal(res, want_res)}, rel {_rel(out, want):.2e}, "
                                f"ranks agree {torch.equal(every[0], every[1])}")

        # eager, one-shot and two-shot, over sizes with one program per row and with several rows per program (both
        # slots each); None: the size picks
        for T, two in [(1, False), (3, True), (8, None), (64, True), (128, None), (200, False), (256, True), (1, None),
                       (1024, None), (255, True), (2048, None), (3, False), (1500, True)]:
            x, res0, _ = case(T)
            res = res0.clone()
            check(f"eager T={T} two_shot={two}", x, res0, sym.fused(x, res, weight, eps, two_shot=two), res)
        # captured: three calls in one graph, replayed with new inputs copied into its static tensors
        shapes = [(8, False), (1, True), (640, True)]
        xs, r0s = zip(*[case(T)[:2] for T, _ in shapes], strict=True)
        xs, res = [x.clone() for x in xs], [r.clone() for r in r0s]
        for x, r, (_, two) in zip(xs, [r.clone() for r in r0s], shapes, strict=True):
            sym.fused(x, r, weight, eps, two_shot=two)  # compiled before capture, as the engine's warm-up does
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(s), torch.cuda.graph(graph):
            outs = [sym.fused(x, r, weight, eps, two_shot=two) for x, r, (_, two) in zip(xs, res, shapes, strict=True)]
        torch.cuda.current_stream().wait_stream(s)
        for replay in range(3):
            news = [case(x.shape[0]) for x in xs]
            for (nx, nr, _), x, r in zip(news, xs, res, strict=True):
                x.copy_(nx)
                r.copy_(nr)
            graph.replay()
            for i, ((nx, nr, _), out, r) in enumerate(zip(news, outs, res, strict=True)):
                check(f"replay {replay} call {i}", nx, nr, out, r)
        x, res0, _ = case(5)  # eager again after the replays: the call counts moved on inside the graph
        res1 = res0.clone()
        check("eager after graph", x, res0, sym.fused(x, res1, weight, eps), res1)
        # expert outputs per (token, k) pair, summed inside the kernel: as summed first (`sum_k`), bit for bit
        for T in (1, 8, 200, 512, 2048):  # one-shot up to PAIRS_ONE_SHOT_MAX_ROWS; 2048: two-shot
            ids = torch.randint(0, 128, (T, 8), device="cuda")
            pairs = PairRows(torch.randn(T * 8, D, device="cuda", dtype=torch.bfloat16), ids, 32, 64)
            res0 = torch.randn(T, D, device="cuda", generator=g, dtype=torch.bfloat16)
            r1, r2 = res0.clone(), res0.clone()
            want, got = sym.fused(pairs.sum(), r1, weight, eps), sym.fused.sum_pairs(pairs, r2, weight, eps)
            if not (torch.equal(want, got) and torch.equal(r1, r2)):
                failures.append(f"pairs T={T}: out equal {torch.equal(want, got)}, residual equal "
                                f"{torch.equal(r1, r2)}")
        failures += _ep_exchange_failures(rank, D, eps, weight, g)
        results.put((rank, failures))
    except Exception as e:  # noqa: BLE001 - reported to the test
        results.put((rank, [f"{type(e).__name__}: {e}"]))
    finally:
        dist.destroy_process_group()


def _ep_exchange_failures(rank: int, D: int, eps: float, weight: torch.Tensor, g: torch.Generator) -> list[str]:
    """EP through symmetric memory against EP through NCCL: the same gathered rows, weights and ids (padding
    included) and the same combined, added and normed outputs, with ranks holding different token counts."""
    import torch.distributed as dist

    from moebius.kernels.symmetric import EPExchange
    from moebius.parallel.dispatch import EPComm

    K, failures = 8, []
    nccl, symm = EPComm(dist.group.WORLD, 2, 64), EPComm(dist.group.WORLD, 2, 64)
    symm.symmetric = EPExchange(dist.group.WORLD, 512, D, K, torch.bfloat16, torch.device("cuda", rank))

    def layer(comm: EPComm, x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, res: torch.Tensor,
              pairs: bool = False) -> tuple[torch.Tensor, ...]:
        gx, gw, gi, handle = comm.dispatch(x, w, ids)
        y = gx * 3 + gw.sum(-1, keepdim=True)  # stands in for the experts: depends on every gathered input
        if pairs:  # per (token, k) pair, k-th scaled by k + 1; rank r's experts are 64 r .. 64 r + 63
            y = PairRows((y[:, None] * torch.arange(1, K + 1, device="cuda")[None, :, None]).to(y.dtype).flatten(0, 1),
                         gi, 64 * rank, 64)
        gx, gw, gi = gx.clone(), gw.clone(), gi.clone()  # (the next dispatch overwrites the symmetric buffers)
        return gx, gw, gi, comm.combine_add_norm(y, handle, res, weight, eps)[0]

    def case(T: int) -> tuple[torch.Tensor, ...]:
        return (torch.randn(T, D, device="cuda", dtype=torch.bfloat16),
                torch.rand(T, K, device="cuda", dtype=torch.bfloat16), torch.randint(0, 128, (T, K), device="cuda"),
                torch.randn(T, D, device="cuda", dtype=torch.bfloat16))

    def compare(name: str, want: tuple, got: tuple, res_want: torch.Tensor, res_got: torch.Tensor) -> None:
        same = [torch.equal(a, b) for a, b in zip(want[:3], got[:3], strict=True)] + [torch.equal(res_want, res_got)]
        if not all(same) or _rel(got[3], want[3]) > 1e-2:
            failures.append(f"EP {name}: x/w/ids/residual equal {same}, out rel {_rel(got[3], want[3]):.2e}")

    for T_pair, C in [((1, 0), 1), ((3, 5), 5), ((64, 17), 64), ((200, 200), 256), ((0, 7), 7), ((512, 300), 512)]:
        x, w, ids, res0 = case(T_pair[rank])
        for comm in (nccl, symm):
            comm.capacity = C
        for pairs in (False, True):
            r1, r2 = res0.clone(), res0.clone()
            compare(f"eager T={T_pair} C={C} pairs={pairs}", layer(nccl, x, w, ids, r1, pairs),
                    layer(symm, x, w, ids, r2, pairs), r1, r2)
    # two layers in one graph, replayed with new inputs
    C, T = 32, (32, 9)[rank]
    symm.capacity = nccl.capacity = C
    ins = [case(T) for _ in range(2)]
    static = [tuple(t.clone() for t in c) for c in ins]
    for c in static:  # compiled before capture
        layer(symm, c[0], c[1], c[2], c[3].clone())
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s), torch.cuda.graph(graph):
        outs = [layer(symm, *c) for c in static]
    torch.cuda.current_stream().wait_stream(s)
    for replay in range(3):
        news = [case(T) for _ in range(2)]
        for new, st in zip(news, static, strict=True):
            for a, b in zip(new, st, strict=True):
                b.copy_(a)
        graph.replay()
        for i, (new, out, st) in enumerate(zip(news, outs, static, strict=True)):
            r = new[3].clone()
            compare(f"graph replay {replay} layer {i}", layer(nccl, *new[:3], r), out, r, st[3])
    return failures


def test_fused_all_reduce_add_norm_matches_nccl() -> None:
    """The one-launch TP sum + residual add + RMSNorm (symmetric memory, flags in peer memory) equals NCCL's
    all-reduce followed by add_rmsnorm, on both ranks alike, eagerly and replayed in a CUDA graph; EP's
    symmetric-memory dispatch and combine equal its NCCL path likewise."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    import torch.multiprocessing as mp
    from conftest import free_port

    port = free_port()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_fused_all_reduce_rank, args=(r, port, results)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=240) for _ in procs)
    for p in procs:
        p.join(60)
    assert got == {0: [], 1: []}, got


def test_switch_reshard_copies_match_torch_permutes() -> None:
    """The switch's pack and unpack through kernels/copy.py, in bf16 at the 30B preset's shard shapes (fewer experts),
    equal torch's permuted copies bit for bit, and round-trip."""
    from moebius.switch.plan import ep_to_tp_pack, tp_to_ep_unpack

    El, I, D, P = 4, 768, 2048, 2
    w13 = torch.randn(El, 2 * I, D, device="cuda", dtype=torch.bfloat16)
    w2 = torch.randn(El, D, I, device="cuda", dtype=torch.bfloat16)
    out = (torch.full((P * El, 2 * I // P, D), float("nan"), device="cuda", dtype=torch.bfloat16),
           torch.full((P * El, D, I // P), float("nan"), device="cuda", dtype=torch.bfloat16))
    ep_to_tp_pack(w13, w2, P, out, row_kernel=True)
    assert torch.equal(out[0], w13.view(El, 2, P, I // P, D).permute(2, 0, 1, 3, 4).reshape(P * El, 2 * I // P, D))
    assert torch.equal(out[1], w2.view(El, D, P, I // P).permute(2, 0, 1, 3).reshape(P * El, D, I // P))
    back13, back2 = torch.full_like(w13, float("nan")), torch.full_like(w2, float("nan"))
    tp_to_ep_unpack(out[0], out[1], P, back13, back2, row_kernel=True)
    assert torch.equal(back13, w13) and torch.equal(back2, w2)


def test_pipelined_switch_moves_what_the_one_stream_pass_moves(monkeypatch: pytest.MonkeyPatch) -> None:
    """--switch-overlap on a GPU: the exchanges go out from a side stream while the compute stream permutes the next
    layer, with 1.2 GB of experts a layer (30B shapes, one rank: the exchange is a copy on the side stream). Each
    pipelined run holds one side back ~1 ms before each of its copies (the exchanges, then the permutes), so that a
    missing wait of the other stream for it shows as different bytes. Expert weights and KV after EP -> TP and after
    the way back, and the tokens, equal the one-stream pass's."""
    from moebius.switch import executor
    from moebius.switch.transport import CollectiveTransport

    held: list[str] = []

    def late(fn: Callable[..., Any], side: str) -> Callable[..., Any]:
        def run(*args: Any) -> Any:
            if side in held:
                torch.cuda._sleep(2_000_000)  # clock cycles, on the stream the copy is queued on
            return fn(*args)
        return run

    monkeypatch.setattr(CollectiveTransport, "all_to_all", late(CollectiveTransport.all_to_all, "exchange"))
    monkeypatch.setattr(executor, "ep_to_tp_pack", late(executor.ep_to_tp_pack, "permute"))
    monkeypatch.setattr(executor, "tp_to_ep_unpack", late(executor.tp_to_ep_unpack, "permute"))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 150000, (int(n),), generator=g).tolist() for n in (37, 5, 120, 64)]
    got = []
    for overlap, hold in ((False, ""), (True, "exchange"), (True, "permute")):
        held[:] = [hold]
        with LLM(model="qwen3-30b-a3b", load_format="dummy", num_layers=4, mode="ep", mem_fraction=0.3,
                 max_model_len=256, cuda_graph_max_bs=4, switch_overlap=overlap, warmup="none") as llm:
            ids = [llm.add_request(p, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)) for p in prompts]
            outs = {}
            for _ in range(4):
                outs.update({o.request_id: o for o in llm.step()})
            prints = [llm.engine.query("fingerprint")[0]]
            for target in ("tp", "ep", "tp"):
                switched = llm.switch_mode(target)
                assert switched.done and switched.pipelined is overlap, switched
                prints.append(llm.engine.query("fingerprint")[0])
            while llm.has_unfinished():
                outs.update({o.request_id: o for o in llm.step()})
            assert prints[2]["experts"] == prints[0]["experts"] and prints[2]["kv"] == prints[0]["kv"]
            got.append(([(p["experts"], p["kv"]) for p in prints], [outs[i].token_ids for i in ids]))
    assert got[0] == got[1] == got[2]


def test_peer_switch_transport_moves_what_the_collective_one_moves() -> None:
    """--switch-transport peer on 2 GPUs (copies into and out of the peer's symmetric-memory staging over NVLink),
    one-stream and pipelined: expert weights and KV after each switch, and the tokens, equal the collective
    transport's; every expert exchange went as peer copies."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 150000, (int(n),), generator=g).tolist() for n in (37, 5, 120, 64, 9, 300)]
    got = []
    for transport, overlap in (("collective", False), ("peer", False), ("peer", True)):
        with LLM(model="qwen3-30b-a3b", load_format="dummy", num_layers=4, num_ranks=2, mode="ep",
                 mem_fraction=0.3, max_model_len=512, cuda_graph_max_bs=8, switch_overlap=overlap,
                 switch_transport=transport, warmup="none") as llm:
            ids = [llm.add_request(p, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)) for p in prompts]
            outs = {}
            for _ in range(4):
                outs.update({o.request_id: o for o in llm.step()})
            prints = [llm.engine.query("fingerprint")]
            for target in ("tp", "ep", "tp"):
                switched = llm.switch_mode(target)
                assert switched.done and switched.transport == transport, switched
                assert switched.peer_exchanges == (8 if transport == "peer" else 0), switched
                prints.append(llm.engine.query("fingerprint"))
            while llm.has_unfinished():
                outs.update({o.request_id: o for o in llm.step()})
            assert [p["experts"] for p in prints[2]] == [p["experts"] for p in prints[0]]
            got.append(([[(p["experts"], p["kv"]) for p in ranks] for ranks in prints],
                        [outs[i].token_ids for i in ids]))
    assert got[0] == got[1] == got[2]


def test_logprobs_graph_and_eager_agree() -> None:
    """Log-probabilities through decode graphs (the graph's logits, the pinned read-back) equal eager steps'; min_p = 1
    gives the greedy tokens; k up to 20; a request that asks nothing gets nothing."""
    prompts = [[(7 * i + 3 * j) % 1000 + 1 for j in range(20 + i)] for i in range(5)]
    sp = [SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True),
          SamplingParams(temperature=0.8, seed=1, max_tokens=6, logprobs=0, ignore_eos=True),
          SamplingParams(temperature=1.2, seed=2, min_p=1.0, max_tokens=6, ignore_eos=True),
          SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
          SamplingParams(temperature=0, max_tokens=6, logprobs=20, ignore_eos=True)]
    runs = []
    for graphs in (True, False):
        with LLM(model="qwen3-30b-a3b", load_format="dummy", num_layers=2, mem_fraction=0.3, max_model_len=256,
                 cuda_graph_max_bs=8, dtype="float32", disable_cuda_graph=not graphs, warmup="none") as llm:
            runs.append(llm.generate(prompts, sp))
            greedy = llm.generate(prompts[2], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
            assert runs[-1][2].token_ids == greedy.token_ids
    graph, eager = runs
    assert graph[3].outputs[0].logprobs is None and all(len(e) in (20, 21) for e in graph[4].outputs[0].logprobs)
    for a, b in zip(graph, eager, strict=True):
        assert a.token_ids == b.token_ids
        for x, y in zip(a.outputs[0].logprobs or [], b.outputs[0].logprobs or [], strict=True):
            assert x.keys() == y.keys() and all(abs(x[k] - y[k]) < 1e-3 and x[k] <= 0 for k in x), (x, y)


def _latent_case(heads: int, ctx: list[int], q_lens: list[int], seed: int = 0
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Any]:
    """DeepSeek-V2-Lite / V3's MLA shapes (C = 512, R = 64, N = V = 128) in bf16 on the GPU: q_nope, q_rope, a paged
    latent cache (NaN past each sequence's end, where pages are unwritten), kv_b, and the step's metadata. Magnitudes
    as the model's: the latent normalised (about 1 a value), q_latent = q_nope @ W_UK about 1 a value."""
    torch.manual_seed(seed)
    C, R, N, V, bs, pages = 512, 64, 128, 128, 16, 512
    meta = paged_metadata(q_lens, ctx, bs, pages, "cuda")
    cache = torch.randn(pages, bs, C + R, device="cuda", dtype=torch.bfloat16)
    for b, n in enumerate(ctx):
        cache[meta.block_tables[b, (n - 1) // bs], (n - 1) % bs + 1:] = float("nan")
    T = sum(q_lens)
    q_nope = torch.randn(T, heads, N, device="cuda", dtype=torch.bfloat16)
    q_rope = torch.randn(T, heads, R, device="cuda", dtype=torch.bfloat16)
    kv_b = (torch.randn(heads * (N + V), C, device="cuda") * N ** -0.5).to(torch.bfloat16)
    return q_nope, q_rope, cache, kv_b, meta


@pytest.mark.parametrize("heads", [8, 16, 128])  # a TP shard of V2-Lite, V2-Lite whole, V3 on one rank
@pytest.mark.parametrize("splits", [1, 4, 16, 32])
def test_latent_decode_attention_matches_reference(heads: int, splits: int) -> None:
    """kernels/mla.py (MLA decode, absorbed form, through models/deepseek/mla.absorbed_kernel) in bf16 against the
    float32 torch absorbed form on the same bf16 values: relative error < 2e-2 (bf16 rounds q_latent, the
    probabilities and the output: about 3 significant digits each; the GQA kernel's tolerance is 1e-2), finite."""
    from moebius.models.deepseek.mla import absorbed, absorbed_kernel

    ctx = [1, 17, 300, 1000, 64, 513]
    q_nope, q_rope, cache, kv_b, meta = _latent_case(heads, ctx, [1] * len(ctx))
    scale = 192 ** -0.5
    ref = absorbed(q_nope.float(), q_rope.float(), cache.float(), kv_b.float(), meta, scale)
    meta.num_splits = splits
    out = absorbed_kernel(q_nope, q_rope, cache, kv_b, meta, scale)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert _rel(out, ref) < 2e-2, (heads, splits, _rel(out, ref))


@pytest.mark.parametrize("heads", [8, 16, 128])  # a TP shard of V2-Lite, V2-Lite whole, V3 on one rank
@pytest.mark.parametrize("kind", ["fresh", "prefix", "mixed"])
def test_latent_chunk_attention_matches_reference(heads: int, kind: str) -> None:
    """kernels/mla.py's causal prompt-chunk launch (through models/deepseek/mla.absorbed_kernel) in bf16 against the
    float32 torch expanded form on the same bf16 values: relative error < 2e-2 (the decode kernel's bound), finite.
    fresh: chunks from position 0 (one of 512 tokens over 32 pages); prefix: chunks after cached tokens; mixed:
    chunks beside decodes in one launch."""
    from moebius.models.deepseek.mla import absorbed_kernel, expanded

    q_lens, ctx = {"fresh": ([512, 77], [512, 77]), "prefix": ([300, 40, 5], [1000, 57, 517]),
                   "mixed": ([1, 200, 1, 33], [300, 200, 17, 100])}[kind]
    q_nope, q_rope, cache, kv_b, meta = _latent_case(heads, ctx, q_lens)
    scale = 192 ** -0.5
    ref = expanded(q_nope.float(), q_rope.float(), cache.float(), kv_b.float(), meta, scale)
    out = absorbed_kernel(q_nope, q_rope, cache, kv_b, meta, scale)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert _rel(out, ref) < 2e-2, (heads, kind, _rel(out, ref))


@pytest.mark.parametrize("decodes", [0, 2])
def test_latent_attention_takes_the_kernels_for_chunks_and_decodes_on_cuda(monkeypatch: pytest.MonkeyPatch,
                                                                           decodes: int) -> None:
    """models/deepseek/mla.latent_attention on CUDA: a mixed step's leading decodes (meta.decodes, as the runner
    sets them with --mixed-attention apart) in the decode launch, the sequences after them (a decode among them too)
    in one causal chunk launch over the step's rows; decodes=0: everything in the chunk launch. The whole step within
    bf16 noise (< 2e-2) of the float32 CPU path (decodes absorbed, chunks expanded)."""
    from moebius.kernels import mla as kernel
    from moebius.models.deepseek.mla import latent_attention

    calls: list[tuple[str, int, int]] = []
    decode, chunk = kernel.latent_decode_attention, kernel.latent_chunk_attention
    monkeypatch.setattr(kernel, "latent_decode_attention", lambda q, r, c, bt, sl, *a, **kw: (
        calls.append(("decode", q.shape[0], sl.shape[0])), decode(q, r, c, bt, sl, *a, **kw))[1])
    monkeypatch.setattr(kernel, "latent_chunk_attention", lambda q, r, c, bt, sl, *a, **kw: (
        calls.append(("chunk", q.shape[0], sl.shape[0])), chunk(q, r, c, bt, sl, *a, **kw))[1])
    q_lens, ctx = [1, 1, 40, 1, 25], [300, 1000, 40, 17, 90]
    q_nope, q_rope, cache, kv_b, meta = _latent_case(16, ctx, q_lens)
    meta.num_splits, meta.decodes = 4, decodes
    out = latent_attention(q_nope, q_rope, cache, kv_b, meta, 192 ** -0.5)
    assert calls == ([("decode", 2, 2), ("chunk", 68, 3)] if decodes else [("chunk", 68, 5)]), calls
    cpu = {k: getattr(meta, k).cpu() for k in ("positions", "slot_mapping", "query_start_loc", "seq_lens",
                                                "block_tables", "token_seq", "token_qpos")}
    ref = latent_attention(q_nope.float().cpu(), q_rope.float().cpu(), cache.float().cpu(), kv_b.float().cpu(),
                           replace(meta, **cpu), 192 ** -0.5)
    assert torch.isfinite(out).all() and _rel(out.cpu(), ref) < 2e-2


def test_latent_step_pieces_match_eager_steps_in_bf16() -> None:
    """DeepSeek-V2-Lite's shapes (two layers, dummy bf16 weights; the first dense, the second with routed and shared
    experts): decode graphs replay, steps with prompt chunks run in pieces around the latent kernels (the leading
    decodes in their own launch), and give the prompt logits and tokens of the same steps run eagerly with the
    decodes in the chunks' launch."""
    kw = dict(_MIXED_KW, model="deepseek-v2-lite", load_format="dummy", num_layers=2, cuda_graph_max_bs=8)
    with LLM(**kw) as llm:
        assert all(r["pieces"] for r in llm.engine.probe(PrefillProbe(tokens=2048, context=0, steps=1, warmup=0)))
        assert all(r["cuda_graph"] for r in llm.engine.probe(DecodeProbe(batch=4, context=300, steps=1, warmup=0,
                                                                         graphs=True)))
        pieces = _mixed_run(llm)
    with LLM(disable_cuda_graph=True, mixed_attention="shared", **kw) as llm:
        eager = _mixed_run(llm)
    _assert_same_logits(pieces, eager)
