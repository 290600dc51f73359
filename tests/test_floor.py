"""The project's decode-step floor agrees with the reference floor model in ../shared/tools/floor.py."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

from moebius.bench.floor import decode_step_floor_ms, switch_floor_ms
from moebius.bench.sweep import crossover
from moebius.config import PRESETS, ModelConfig
from moebius.models.registry import model_config

REF = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "tools", "floor.py")


@pytest.mark.skipif(not os.path.isfile(REF), reason="../shared/tools/floor.py is not beside this checkout")
# the reference models GQA shapes only: the Qwen3 presets (the DeepSeek ones are checked by hand below)
@pytest.mark.parametrize("preset", sorted(p for p, hf in PRESETS.items() if hf["model_type"] == "qwen3_moe"))
def test_floor_agrees_with_reference(preset: str) -> None:
    spec = importlib.util.spec_from_file_location("ref_floor", REF)
    ref = importlib.util.module_from_spec(spec)
    sys.modules["ref_floor"] = ref  # its dataclasses look their module up while being built
    spec.loader.exec_module(ref)
    cfg = model_config(PRESETS[preset])
    shape = ref.Shape(**ref.PRESETS[preset])
    for P in (1, 2, 4, 8):
        for mode in ("tp", "ep"):
            for batch in (1, 3, 64, 256, 2048):
                for context in (1, 512, 4096):
                    want = ref.step_floor(shape, P, mode, batch, context)["floor_ms"]
                    assert decode_step_floor_ms(cfg, P, mode, batch, context) == pytest.approx(want, rel=1e-9)
        for kv_tokens in (0, 1000, 200_000):
            want = ref.switch_floor(shape, P, kv_tokens)["floor_ms"]
            assert switch_floor_ms(cfg, P, kv_tokens) == pytest.approx(want, rel=1e-9)


def test_switch_floor_by_hand() -> None:
    """Qwen3-30B-A3B on 2 ranks, no KV: half a rank's experts cross the link, the other half is copied in HBM."""
    cfg = model_config(PRESETS["qwen3-30b-a3b"])
    rank = 48 * 128 * 3 * 2048 * 768 * 2 / 2  # bytes of a rank's experts (bf16)
    want = (rank / 2 / 395e9 + 2 * rank / 2 / 4.28e12) * 1e3
    assert switch_floor_ms(cfg, 2, 0) == pytest.approx(want)
    assert switch_floor_ms(cfg, 2, 1000) > want


def test_floor_shape_tp_wins_small_ep_wins_large_on_8_ranks() -> None:
    cfg = model_config(PRESETS["qwen3-235b-a22b"])
    f = {m: [decode_step_floor_ms(cfg, 8, m, b, 1024) for b in (8, 2048)] for m in ("tp", "ep")}
    assert f["tp"][0] < f["ep"][0] and f["ep"][1] < f["tp"][1]


def test_crossover_is_where_ep_stays_ahead() -> None:
    series = {"tp": {1: 1.0, 2: 2.0, 4: 3.0, 8: 4.0}, "ep": {1: 1.5, 2: 1.9, 4: 3.5, 8: 3.0}}
    pts = [dict(mode=m, batch=b, step_ms=t) for m, s in series.items() for b, t in s.items()]
    assert crossover(pts) == 8


def test_prefill_floor_by_hand() -> None:
    """A chunk of 10 tokens after 6 cached ones on a tiny model, its bytes and FLOPs counted by hand."""
    from moebius.bench.floor import Hardware, prefill_floor_ms, prefill_work, step_floor_ms

    cfg = ModelConfig(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                      intermediate_size=128, moe_intermediate_size=32, num_experts=8, top_k=2, norm_topk_prob=True,
                      rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=512)
    work = prefill_work(10, prefix=6)
    assert (work.tokens, work.kv_tokens, work.attended, work.sampled) == (10, 16, 10 * 6 + 55, 1)
    attn_w = 64 * 4 * 16 * 2 + 64 * 2 * 16 * 2  # q and o, k and v: 12288 elements
    experts_hit = 8 * (1 - 0.75 ** 10)  # 10 tokens, top-2 of 8
    moe_w = experts_hit * 3 * 64 * 32
    kv = (16 + 10) * 2 * 16 * 2  # read 16 tokens' K and V, write 10
    act = 20 * (3 * 64 + 2 * 32) * 2  # 20 (token, expert) pairs, bf16
    hbm = 2 * ((attn_w + moe_w + kv) * 2 + act) + 256 * 64 * 2  # two layers, then lm_head once
    flops = 2 * (10 * 2 * attn_w + 2 * 20 * 3 * 64 * 32 + 4 * 115 * 4 * 16) + 2 * 256 * 64 * 1
    hw = Hardware()
    want = max(hbm / hw.hbm_bytes_per_s, flops / hw.bf16_flops) * 1e3
    assert prefill_floor_ms(cfg, 1, "tp", 10, prefix=6) == pytest.approx(want, rel=1e-12)
    assert step_floor_ms(cfg, 1, "ep", work) == pytest.approx(want, rel=1e-12)  # one rank: the same work
    # large chunks are bound by FLOPs: 4x the tokens, more than 4x the time (attention grows with the square)
    big = model_config(PRESETS["qwen3-30b-a3b"])
    assert prefill_floor_ms(big, 1, "tp", 16384) > 4 * prefill_floor_ms(big, 1, "tp", 4096)


def test_step_floor_of_a_decode_batch_is_the_decode_floor() -> None:
    from moebius.bench.floor import step_floor_ms
    from moebius.link.messages import StepWork

    cfg = model_config(PRESETS["qwen3-30b-a3b"])
    for P, mode, B, ctx in ((1, "tp", 64, 512), (2, "tp", 8, 1024), (2, "ep", 256, 512)):
        work = StepWork(tokens=B, decode_tokens=B, sequences=B, kv_tokens=B * ctx, attended=B * ctx, sampled=B)
        # the step floor also writes the new tokens' KV, which the decode floor leaves out
        assert step_floor_ms(cfg, P, mode, work) == pytest.approx(decode_step_floor_ms(cfg, P, mode, B, ctx),
                                                                   rel=5e-3)


def test_prefill_work_of_several_prompts() -> None:
    """A step of 10 prompt tokens split over 3 prompts (4, 3, 3), each after 6 cached tokens: every prompt samples
    its last token, reads its own prefix and attends only within itself."""
    from moebius.bench.floor import prefill_work

    work = prefill_work(10, prefix=6, sequences=3)
    assert (work.tokens, work.sequences, work.kv_tokens, work.sampled) == (10, 3, 28, 3)
    assert work.attended == (4 * 6 + 10) + 2 * (3 * 6 + 6)
    # beside them 5 requests decoding a token each after 20 cached ones: each reads and attends 21 keys, samples
    mixed = prefill_work(10, prefix=6, sequences=3, decodes=5, decode_context=20)
    assert (mixed.tokens, mixed.decode_tokens, mixed.sequences, mixed.sampled) == (15, 5, 8, 8)
    assert (mixed.kv_tokens, mixed.attended) == (28 + 5 * 21, work.attended + 5 * 21)


# ---- the DeepSeek family's terms (MLA, its latent cache, shared experts, dense first layers) -------------------


def test_deepseek_attention_weights_by_hand() -> None:
    """MLA's projections a layer, counted by hand from the published shapes: V2-Lite (no q-LoRA) whole on one rank,
    DeepSeek-V3 (q-LoRA) on one of 8 TP ranks (16 of its 128 heads; q_a and kv_a every head's, replicated)."""
    from moebius.bench.floor import decode_step_terms, floor_terms

    lite = model_config(PRESETS["deepseek-v2-lite"])
    # q_proj 16 heads x 192 rows x 2048, kv_a 576 x 2048, kv_b 16 x 256 x 512, o_proj 2048 x 16 x 128
    layer = 16 * 192 * 2048 + 576 * 2048 + 16 * 256 * 512 + 2048 * 16 * 128
    assert layer == 13_762_560
    assert floor_terms(lite, 1, "tp").attn_weights == 27 * layer
    dense = 3 * 2048 * 10944  # first_k_dense_replace = 1: layer 0's MLP
    assert decode_step_terms(lite, 1, "tp", 8, 100)["weights_bytes"] == (27 * layer + dense) * 2
    v3 = model_config(PRESETS["deepseek-v3"], num_layers=4)
    shard = 1536 * 7168 + 16 * 192 * 1536 + 576 * 7168 + 16 * 256 * 512 + 7168 * 16 * 128
    f = floor_terms(v3, 8, "tp")
    assert f.attn_weights == 4 * shard and f.moe_layers == 1  # layers 0-2 dense
    assert f.dense_weights == 3 * 3 * 7168 * 18432 / 8
    assert f.shared_weights == 3 * 7168 * 2048 / 8  # one shared expert a MoE layer, 1/8 on every rank
    assert floor_terms(v3, 8, "ep").shared_weights == f.shared_weights  # the same shard in EP
    # the absorbed form a cached token: scores over 576 values and the weighted sum over 512, each of 16 heads
    assert f.attn_flops_per_key == 4 * 16 * (2 * 576 + 2 * 512)


@pytest.mark.parametrize("P", (2, 4, 8))
def test_deepseek_tp_reads_p_times_eps_kv_a_rank(P: int) -> None:
    """MLA's one latent a token is replicated on every TP rank, so a TP rank reads the whole batch's cache while
    an EP rank reads its 1/P of the requests': P times the bytes at the same batch (Qwen3-235B's 4 KV heads over 8
    TP ranks: each on 2 ranks, so twice EP's)."""
    from moebius.bench.floor import decode_step_terms

    cfg = model_config(PRESETS["deepseek-v3"], num_layers=4)
    tp, ep = (decode_step_terms(cfg, P, m, 64, 1000) for m in ("tp", "ep"))
    assert tp["kv_bytes"] == pytest.approx(P * ep["kv_bytes"])
    assert ep["kv_bytes"] == 64 / P * 1000 * 4 * 576 * 2  # tokens x layers x the latent's values x bf16
    qwen = model_config(PRESETS["qwen3-235b-a22b"])
    tp, ep = (decode_step_terms(qwen, 8, m, 64, 1000) for m in ("tp", "ep"))
    assert tp["kv_bytes"] == pytest.approx(2 * ep["kv_bytes"])


def test_deepseek_switch_floor_by_hand() -> None:
    """V2-Lite on 2 ranks: the experts of its 26 MoE layers (none in the dense layer 0), and EP -> TP's gather of
    the other rank's half of the latents."""
    cfg = model_config(PRESETS["deepseek-v2-lite"])
    rank = 26 * 64 * 3 * 2048 * 1408 * 2 / 2
    weights = (rank / 2 / 395e9 + 2 * rank / 2 / 4.28e12) * 1e3
    assert switch_floor_ms(cfg, 2, 0) == pytest.approx(weights)
    kv = 1000 * 27 * 576 * 2 / 2  # each rank receives the other's 500 tokens' latents, 27 layers, bf16
    assert switch_floor_ms(cfg, 2, 1000) == pytest.approx(weights + kv / 395e9 * 1e3)


def test_deepseek_step_floor_of_a_decode_batch_is_the_decode_floor() -> None:
    from moebius.bench.floor import step_floor_ms
    from moebius.link.messages import StepWork

    cfg = model_config(PRESETS["moonlight-16b-a3b"])
    for P, mode, B, ctx in ((1, "tp", 64, 512), (4, "tp", 8, 1024), (4, "ep", 256, 512)):
        work = StepWork(tokens=B, decode_tokens=B, sequences=B, kv_tokens=B * ctx, attended=B * ctx, sampled=B)
        assert step_floor_ms(cfg, P, mode, work) == pytest.approx(decode_step_floor_ms(cfg, P, mode, B, ctx),
                                                                   rel=5e-3)


@pytest.mark.parametrize("gpu,card", [("NVIDIA H200", "H200"), ("NVIDIA H100 80GB HBM3", "H100"), ("cpu", "H200"),
                                      ("NVIDIA A100-SXM4-80GB", "H200")])
def test_a_floor_is_the_card_s_that_ran(gpu: str, card: str) -> None:
    """The benches take the floor of the card they ran on (results.gpu_name): an H100's memory-bound decode step reads
    the same bytes at its own copy rate; anything else is floored as an H200."""
    from moebius.bench.floor import HARDWARE, hardware_of

    hw = hardware_of(gpu)
    assert hw == HARDWARE[card]
    cfg = model_config(PRESETS["qwen3-30b-a3b"])
    on_h200, here = (decode_step_floor_ms(cfg, 1, "tp", 64, 1024, hw=h) for h in (HARDWARE["H200"], hw))
    assert here == pytest.approx(on_h200 * HARDWARE["H200"].hbm_bytes_per_s / hw.hbm_bytes_per_s)


def test_a_throughput_run_is_floored_on_the_card_that_ran(monkeypatch: pytest.MonkeyPatch) -> None:
    """`bench throughput` prices each step on the card the run names: the same demo-model steps floored on an H100
    cost the H200's floor times the ratio of their rates (every step here reads more bytes than it computes)."""
    from moebius.bench import throughput
    from moebius.bench.floor import HARDWARE, step_floor_ms
    from moebius.config import EngineConfig
    from moebius.frontend.core import EngineCore

    monkeypatch.setattr(throughput, "gpu_name", lambda: "NVIDIA H100 80GB HBM3")
    with EngineCore(EngineConfig.from_kwargs(device="cpu")) as engine:
        cfg, works = engine.model_config, []
        step = engine.step

        def step_and_keep() -> list:
            outs = step()
            works.append(engine.last_work)
            return outs

        monkeypatch.setattr(engine, "step", step_and_keep)
        _, rows, _ = throughput.run(engine, [([1, 2, 3, 4, 5], 3), ([6, 7], 2)])
    timed = [(r, w) for r, w in zip(rows, works, strict=True) if w.tokens]
    assert timed
    for row, w in timed:
        h100 = step_floor_ms(cfg, 1, row["mode"], w, hw=HARDWARE["H100"])
        assert row["floor_ms"] == pytest.approx(h100) and h100 > step_floor_ms(cfg, 1, row["mode"], w)
