"""The GPT-OSS presets (gpt-oss-20b, gpt-oss-120b): each parses with its published shapes, its YaRN rope table is
transformers' own for the config, both layouts exist at P = 1, 2, 4, 8, rank counts the shapes do not divide are
refused, the command line names them, and gpt-oss-20b starts on the CPU with random weights, cut to two layers
(a sliding and a full one)."""

from __future__ import annotations

import pytest
import torch
from family_cases import assert_presets_named, assert_rank_count_refused

from moebius.config import PRESETS, EngineConfig
from moebius.models.registry import family_of, model_config
from moebius.parallel.layout import MODES, Layout, check_shapes

GPT_OSS = ("gpt-oss-20b", "gpt-oss-120b")
# (layers, hidden, heads, KV heads, experts, top-k, expert intermediate, vocab)
SHAPES = {
    "gpt-oss-20b": (24, 2880, 64, 8, 32, 4, 2880, 201088),
    "gpt-oss-120b": (36, 2880, 64, 8, 128, 4, 2880, 201088),
}


@pytest.mark.parametrize("preset", GPT_OSS)
def test_preset_parses_with_its_published_shapes(preset: str) -> None:
    cfg = model_config(PRESETS[preset])
    assert cfg.family == "gpt_oss" and family_of(cfg).name == "gpt_oss"
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.num_experts, cfg.top_k,
            cfg.moe_intermediate_size, cfg.vocab_size) == SHAPES[preset]
    ext = cfg.extra
    assert cfg.layer_windows == (128, None) * (cfg.num_layers // 2)
    assert (ext.swiglu_alpha, ext.swiglu_limit) == (1.702, 7.0)
    assert (cfg.kv_spec.parts, cfg.kv_spec.heads, cfg.kv_spec.dim) == (2, 8, 64)
    assert model_config(PRESETS[preset], num_layers=2).num_layers == 2  # --num-layers cuts it


def test_preset_rope_is_transformers_yarn() -> None:
    """The releases' rope (YaRN, factor 32 over 4096 positions, truncate false, theta 150000) as transformers'
    GptOssRotaryEmbedding computes it from the same config.json, at the first 8192 positions."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    hf = {k: v for k, v in PRESETS["gpt-oss-20b"].items() if k not in ("architectures", "experts_per_token",
                                                                          "initial_context_length")}
    rotary = GptOssRotaryEmbedding(GptOssConfig(**hf))
    cfg = model_config(PRESETS["gpt-oss-20b"])
    n = 8192
    table = family_of(cfg).rope_table(cfg, torch.device("cpu"))[:n]
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), torch.arange(n)[None])
    torch.testing.assert_close(table, torch.cat([cos[0], sin[0]], dim=-1), rtol=0, atol=2e-6)


@pytest.mark.parametrize("preset", GPT_OSS)
@pytest.mark.parametrize("P", (1, 2, 4, 8))
def test_preset_layouts_at_1_2_4_8_ranks(preset: str, P: int) -> None:
    """Both layouts exist: TP cuts the heads (8 KV heads: one a rank at P = 8) and every expert's intermediate dim,
    EP holds E/P whole experts and every head. A 2-layer cut's weight specs have every rank's shapes whole, the
    experts' two views in each layer's slot, and o_proj's and the experts' down bias on TP rank 0 only."""
    cfg = model_config(PRESETS[preset], num_layers=2)
    check_shapes(cfg, P)
    family = family_of(cfg)
    for r in range(P):
        tp, ep = Layout(cfg, "tp", r, P), Layout(cfg, "ep", r, P)
        assert len(tp.q_heads) * P == cfg.num_heads and tp.num_kv_heads * P == cfg.num_kv_heads
        assert tp.moe_inter * P == cfg.moe_intermediate_size
        assert ep.num_local_experts * P == cfg.num_experts
        assert tp.expert_bytes(2) == ep.expert_bytes(2)
    for mode in MODES:
        for r in (0, P - 1):
            specs = family.weight_specs(cfg, Layout(cfg, mode, r, P), 2)
            assert all(all(n > 0 for n in s.shape) for s in specs)
            assert sum(1 for s in specs if s.slot is not None) == 2 * 2  # w13 and w2 in each layer's slot
            once = sum(1 for s in specs if s.name.endswith("o_bias") or ".b2." in s.name)
            assert once == (4 if mode == "ep" or r == 0 else 0), (mode, r)


@pytest.mark.parametrize("preset, P, what", [
    ("gpt-oss-20b", 3, "num_experts 32 is not divisible by 3 ranks"),
    ("gpt-oss-120b", 6, "num_experts 128 is not divisible by 6 ranks"),
])
def test_engine_refuses_rank_counts_the_shapes_do_not_allow(preset: str, P: int, what: str) -> None:
    assert_rank_count_refused(preset, P, what)


def test_command_line_names_the_presets() -> None:
    assert_presets_named(GPT_OSS, sep="")  # argparse wraps the names over lines, at their hyphens too
    assert EngineConfig.from_kwargs(model="gpt-oss-120b").model == "gpt-oss-120b"


@pytest.mark.slow
def test_gpt_oss_20b_starts_on_the_cpu() -> None:
    """The smaller preset cut to two layers (a sliding and a full one), random weights in bfloat16: starts and
    generates in both layouts. About 7 GB (the two vocabulary matrices 2.3 GB, 1.6 GB of experts a layer slot)."""
    from moebius import LLM
    from moebius.sampling_params import SamplingParams

    with LLM(model="gpt-oss-20b", load_format="dummy", num_layers=2, device="cpu", dtype="bfloat16",
             max_model_len=64, max_total_tokens=256, max_num_batched_tokens=64, max_running_requests=4) as llm:
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0.0))
        assert len(out[0].outputs[0].token_ids) == 2
        assert llm.switch_mode("ep").done
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0.0))
        assert len(out[0].outputs[0].token_ids) == 2


def test_the_floor_reads_a_window_of_the_sliding_layers_cache() -> None:
    """gpt-oss-20b's decode floor: past the 128-token window only the full-attention layers' cache reads grow with
    the context (12 of its 24 layers), the sliding layers' stay at a window's."""
    from moebius.bench.floor import decode_step_terms

    cfg = model_config(PRESETS["gpt-oss-20b"])
    per_token = 12 * 8 * 2 * 64 * 2  # a layer's K and V heads of a token, bf16, in the 12 full layers
    short, long = (decode_step_terms(cfg, 1, "tp", 8, c)["kv_bytes"] for c in (1024, 4096))
    assert long - short == 8 * (4096 - 1024) * per_token
    assert short == 8 * (1024 + 128) * per_token  # as many sliding layers, a window each


def test_window_pairs_and_reads_are_counted_query_by_query() -> None:
    """`attended_pairs` with a window: each query at position q computes min(q + 1, window) pairs (brute force over
    chunks before, across and past the window); `window_reads`: the cached keys the first query's window reaches and
    the new tokens."""
    from moebius.link.messages import attended_pairs, window_reads

    for start, tokens, window in ((0, 1, 4), (0, 10, 4), (2, 5, 4), (3, 1, 4), (100, 7, 8), (5, 300, 128), (0, 3, 1)):
        assert attended_pairs(start, tokens, window) == sum(min(q + 1, window) for q in range(start, start + tokens))
        assert attended_pairs(start, tokens) == sum(q + 1 for q in range(start, start + tokens))
        assert window_reads(start, tokens, window) == min(start, window - 1) + tokens
    assert window_reads(50, 3, 0) == 0


def test_the_step_floor_reads_each_sequences_window() -> None:
    """gpt-oss-20b's step floor, from the work the rank counts (`worker.rank.step_work`): a 2048-token prompt chunk's
    sliding layers read its own 2048 keys (not a window's), and a decode batch of mixed lengths reads each sequence's
    window or less; the floor's cache bytes are those reads and the writes, the full layers' every key."""
    from moebius.bench.floor import Hardware, prefill_work, step_floor_ms
    from moebius.link.messages import StepWork, attended_pairs

    cfg = model_config(PRESETS["gpt-oss-20b"])
    W = cfg.largest_window
    assert W == 128
    chunk = prefill_work(2048, window=W)
    assert (chunk.window_kv_tokens, chunk.window_attended) == (2048, attended_pairs(0, 2048, W))
    lengths = [10, 100, 127, 128, 129, 5000]  # each decode's cached tokens
    decode = sum((prefill_work(0, sequences=0, decodes=1, decode_context=n, window=W) for n in lengths), StepWork())
    assert decode.window_kv_tokens == sum(min(n, W - 1) + 1 for n in lengths)
    assert decode.window_attended == sum(min(n + 1, W) for n in lengths)
    # the floor's cache reads beside the same step without them (which still writes the new tokens): 12 full layers
    # read every key, 12 sliding ones their windows'
    per_token = 12 * 8 * 2 * 64 * 2
    bare = StepWork(tokens=decode.tokens, decode_tokens=decode.decode_tokens, sequences=decode.sequences,
                    sampled=decode.sampled)
    kv = (decode.kv_tokens + decode.window_kv_tokens) * per_token
    assert step_floor_ms(cfg, 1, "tp", decode) - step_floor_ms(cfg, 1, "tp", bare) == pytest.approx(
        kv / Hardware().hbm_bytes_per_s * 1e3, rel=1e-3)
