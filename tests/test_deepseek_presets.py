"""The DeepSeek-V2 / V3 family's presets (deepseek-v2-lite, moonlight-16b-a3b, deepseek-v3, kimi-k2): each parses,
both layouts exist at P = 1, 2, 4, 8, the engine refuses rank counts their shapes do not divide, the command line
names them, and the smallest starts on the CPU (the others are tens to hundreds of GB even cut to a layer)."""

from __future__ import annotations

import pytest
from conftest import Checkpoints
from family_cases import assert_presets_named, assert_rank_count_refused

from moebius.config import PRESETS, EngineConfig
from moebius.models.registry import family_of, model_config
from moebius.parallel.layout import MODES, Layout, check_shapes

DEEPSEEK = ("deepseek-v2-lite", "moonlight-16b-a3b", "deepseek-v3", "kimi-k2")
# (layers, hidden, heads, routed experts, top-k, shared experts, dense layers, q_lora_rank, vocab)
SHAPES = {
    "deepseek-v2-lite": (27, 2048, 16, 64, 6, 2, (0,), None, 102400),
    "moonlight-16b-a3b": (27, 2048, 16, 64, 6, 2, (0,), None, 163840),
    "deepseek-v3": (61, 7168, 128, 256, 8, 1, (0, 1, 2), 1536, 129280),
    "kimi-k2": (61, 7168, 64, 384, 8, 1, (0,), 1536, 163840),
}


@pytest.mark.parametrize("preset", DEEPSEEK)
def test_preset_parses_with_its_published_shapes(preset: str) -> None:
    cfg = model_config(PRESETS[preset])
    layers, hidden, heads, experts, top_k, shared, dense, q_lora, vocab = SHAPES[preset]
    mla, moe = cfg.extra.mla, cfg.extra.moe
    assert cfg.family == "deepseek" and family_of(cfg).name == "deepseek"
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_experts, cfg.top_k, moe.n_shared_experts,
            cfg.mlp_only_layers, mla.q_lora_rank, cfg.vocab_size) == (layers, hidden, heads, experts, top_k, shared,
                                                                     dense, q_lora, vocab)
    # one latent of kv_lora_rank + qk_rope_head_dim values a token a layer: 512 + 64 in every release
    assert (cfg.kv_spec.parts, cfg.kv_spec.heads, cfg.kv_spec.dim) == (1, 1, 576)
    assert model_config(PRESETS[preset], num_layers=4).num_layers == 4  # --num-layers cuts it


@pytest.mark.parametrize("preset", DEEPSEEK)
@pytest.mark.parametrize("P", (1, 2, 4, 8))
def test_preset_layouts_at_1_2_4_8_ranks(preset: str, P: int) -> None:
    """Both layouts exist: TP cuts the heads and every expert, replicates the latent; EP holds E/P whole experts and
    every head. The weight specs of a 4-layer cut (dense and MoE layers) have every rank's shapes whole."""
    cfg = model_config(PRESETS[preset], num_layers=4)
    check_shapes(cfg, P)
    family = family_of(cfg)
    for r in range(P):
        tp, ep = Layout(cfg, "tp", r, P), Layout(cfg, "ep", r, P)
        assert len(tp.q_heads) * P == cfg.num_heads and tp.num_kv_heads == ep.num_kv_heads == 1
        assert tp.moe_inter * P == cfg.moe_intermediate_size and tp.dense_inter * P == cfg.intermediate_size
        assert ep.num_local_experts * P == cfg.num_experts and ep.first_expert == r * ep.num_local_experts
        assert tp.expert_bytes(2) == ep.expert_bytes(2)  # the slot's bytes are the same in both layouts
    for mode in MODES:
        specs = family.weight_specs(cfg, Layout(cfg, mode, P - 1, P), 2)
        assert all(all(n > 0 for n in s.shape) for s in specs)
        moe_layers = 4 - len(cfg.mlp_only_layers)  # the cut's layers past the dense ones
        assert sum(1 for s in specs if s.slot is not None) == 2 * moe_layers  # w13 and w2 in each layer's slot


@pytest.mark.parametrize("preset, P, what", [
    ("deepseek-v2-lite", 32, "num_attention_heads 16 is not divisible by 32 ranks"),
    ("moonlight-16b-a3b", 3, "num_experts 64 is not divisible by 3 ranks"),
    ("deepseek-v3", 6, "num_experts 256 is not divisible by 6 ranks"),
    ("kimi-k2", 3, "num_attention_heads 64 is not divisible by 3 ranks"),
])
def test_engine_refuses_rank_counts_the_shapes_do_not_allow(preset: str, P: int, what: str) -> None:
    """Refused before any rank starts (the front end checks the shapes), naming the number that does not divide."""
    assert_rank_count_refused(preset, P, what)


def test_command_line_names_the_presets() -> None:
    """`moebius generate --model` takes a preset, and its help (EngineConfig's) names each."""
    assert_presets_named(DEEPSEEK)
    assert EngineConfig.from_kwargs(model="kimi-k2").model == "kimi-k2"


def test_deepseek_v2_lite_starts_on_the_cpu() -> None:
    """The smallest preset, cut to its one dense layer (about 2.7 GB of float32 for the two vocabulary matrices,
    ~7 s here): starts with random weights and generates. Moonlight's vocabulary makes it 3.5 GB, and any MoE
    layer adds 2.2 GB of experts a slot: those are checked by shape only (above)."""
    from moebius import LLM
    from moebius.sampling_params import SamplingParams

    with LLM(model="deepseek-v2-lite", load_format="dummy", num_layers=1, device="cpu", max_model_len=64,
             max_total_tokens=256, max_num_batched_tokens=64, max_running_requests=4) as llm:
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0.0))
        assert len(out[0].outputs[0].token_ids) == 2
        assert llm.engine.model_config.kv_spec.dim == 576


# ---- the engine's capacity: TP holds every request's latent on every rank, EP each request's once --------------


def test_engine_tp_holds_every_latent_on_every_rank(ckpt: Checkpoints) -> None:
    """A tiny DeepSeek-V3 checkpoint on 2 ranks with 15 usable pages of 4 tokens a rank: four requests reaching 21
    tokens each (84 in all) never hold more than a rank's 60 at once in TP, the same on both ranks (the latents
    replicated), while EP holds them spread over the ranks, more than 60 in all; every request ends in both, no
    page leaked. The admission needs no change for it: each rank's pool counts its own copies (KV spec x Layout)."""
    from moebius import LLM
    from moebius.sampling_params import SamplingParams

    prompts = [[(7 * i + j) % 50 + 1 for j in range(13)] for i in range(4)]
    peak: dict[str, int] = {}
    for mode in ("tp", "ep"):
        with LLM(model=ckpt("deepseek_v3"), num_ranks=2, mode=mode, dtype="float32", device="cpu", block_size=4,
                 max_total_tokens=64, max_num_batched_tokens=16, max_running_requests=8, seed=0) as llm:
            for p in prompts:
                llm.add_request(p, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
            done, peak[mode] = 0, 0
            while llm.has_unfinished():
                done += sum(1 for o in llm.step() if o.finished)
                used = [s["total_tokens"] - s["free_tokens"] for s in llm.kv_stats()["per_rank"]]
                if mode == "tp":
                    assert used[0] == used[1] <= 60, used
                peak[mode] = max(peak[mode], used[0] if mode == "tp" else sum(used))
            assert done == 4
            assert all(s["free_tokens"] == s["total_tokens"] for s in llm.kv_stats()["per_rank"])
    assert peak["tp"] <= 60 < peak["ep"]
