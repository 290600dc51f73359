"""The Mixtral family served end to end on the CPU (float32): config.json parsed into the engine's ModelConfig
(every layer MoE, the experts' size its intermediate_size, the renormalised top-2), the checkpoint names transformers
writes (`block_sparse_moe.experts.{e}.w1 / w3 / w2`), and greedy tokens identical to transformers' own
MixtralForCausalLM for P = 1, 2, 4 in TP and EP, across live switches with arrivals, aborts and n > 1, with no KV
page leaked; weight updates from disk, by Mixtral's per-expert names and by transformers 5's fused tensors; a sliding
window shorter than the context refused, naming the family.

Checkpoints (written here by transformers' MixtralForCausalLM, std 0.3 weights as tests/conftest.py's `_reinit_`):
  mixtral      GQA (4 query heads, 2 KV heads), 8 experts, top-2, rope_theta 1e6
  mixtral_mqa  one KV head (replicated on every TP rank), tied embeddings, 3 layers
  mixtral_b    other weights of mixtral's shapes (a weight update's target)
Every engine runs prompts crossing 4-token pages with a 16-token step budget, so prompt chunks and decodes share
steps.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from conftest import VOCAB
from family_cases import (
    ENGINE_KW,
    assert_kv_free,
    gpu_parity,
    greedy_outputs,
    hf_greedy,
    hf_model,
    parity_across_switch,
    random_prompts,
    saved_tensors,
    serve,
    stress_jobs,
    switch_stress,
    write_hf_checkpoint,
)
from family_cases import hf_config as _config

from moebius import LLM, SamplingParams
from moebius.config import PRESETS, ConfigError, KVSpec
from moebius.models.registry import FAMILIES, family_of, model_config
from moebius.models.specs import W1W3W2_EXPERTS, fused_name, per_expert, per_expert_names
from moebius.parallel.layout import MODES, Layout, check_shapes

N_OUT = 8
PROMPTS: list[list[int]] = random_prompts(11, (1, 5, 9, 17, 23))
CONFIG: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=512,
    rms_norm_eps=1e-5, tie_word_embeddings=False, sliding_window=None,
    rope_parameters={"rope_type": "default", "rope_theta": 1e6},
)
VARIANTS: dict[str, tuple[dict[str, Any], int]] = {
    "mixtral": ({}, 0),
    "mixtral_mqa": (dict(num_key_value_heads=1, tie_word_embeddings=True, num_hidden_layers=3), 1),
    "mixtral_b": ({}, 3),
    "mixtral_window": (dict(sliding_window=7), 0),  # every layer windowed: the one KV group frees its pages
}


def write_mixtral(path: str, overrides: dict[str, Any], seed: int) -> str:
    return write_hf_checkpoint(path, "MixtralForCausalLM", {**CONFIG, **overrides}, seed)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("mixtral")
    return {name: write_mixtral(str(root / name), ov, seed) for name, (ov, seed) in VARIANTS.items()}


# ---------------------------------------------------------------------------------------------------------------
# Config, checkpoint names, refusals
# ---------------------------------------------------------------------------------------------------------------

def test_config_and_checkpoint_names(ckpts: dict[str, str]) -> None:
    """The family, its KV spec (K and V of head_dim a KV head), every layer MoE with the renormalised top-2; every
    tensor transformers saved is one the family reads (Mixtral's per-expert names), and no other but the fused
    expert tensors an update may give instead."""
    from safetensors import safe_open

    path = ckpts["mixtral"]
    cfg = model_config(_config(path))
    assert family_of(cfg) is FAMILIES["mixtral"] and cfg.family == "mixtral"
    assert cfg.kv_spec == KVSpec(parts=2, heads=2, dim=16)
    assert (cfg.num_experts, cfg.top_k, cfg.moe_intermediate_size, cfg.norm_topk_prob) == (8, 2, 32, True)
    assert all(cfg.is_moe_layer(i) for i in range(cfg.num_layers)) and cfg.rope_theta == 1e6
    assert hash(cfg) == hash(model_config(_config(path)))  # a cache key
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        saved = set(f.keys())
    assert "model.layers.1.block_sparse_moe.experts.7.w3.weight" in saved
    known = family_of(cfg).checkpoint_tensors(cfg)
    fused = {n for n in known if n.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))}
    assert set(known) - fused == saved and len(fused) == 2 * cfg.num_layers


def test_expert_names_map_both_ways() -> None:
    """Mixtral's per-expert names belong to transformers 5's fused tensors (w1 and w3 to gate_up_proj, w2 to
    down_proj), and a fused tensor splits into Mixtral's names for a Mixtral model (Qwen3's stay Qwen3's)."""
    p = "model.layers.3."
    assert fused_name(p + "block_sparse_moe.experts.5.w1.weight") == p + "mlp.experts.gate_up_proj"
    assert fused_name(p + "block_sparse_moe.experts.5.w3.weight") == p + "mlp.experts.gate_up_proj"
    assert fused_name(p + "block_sparse_moe.experts.5.w2.weight") == p + "mlp.experts.down_proj"
    assert fused_name(p + "mlp.experts.5.up_proj.weight") == p + "mlp.experts.gate_up_proj"
    assert fused_name(p + "block_sparse_moe.gate.weight") is None and fused_name(p + "mlp.experts.5.w1.weight") is None
    cfg = model_config(PRESETS["mixtral-8x7b"], num_layers=4)
    assert cfg.extra == W1W3W2_EXPERTS
    assert per_expert_names(cfg, p + "mlp.experts.gate_up_proj", 2) == [
        p + f"block_sparse_moe.experts.{e}.{w}.weight" for e in range(2) for w in ("w1", "w3")]
    assert per_expert_names(cfg, p + "mlp.experts.down_proj", 1) == [p + "block_sparse_moe.experts.0.w2.weight"]
    I, D = 3, 2
    t = torch.arange(2 * 2 * I * D, dtype=torch.float32).view(2, 2 * I, D)
    parts = dict(per_expert(cfg, p + "mlp.experts.gate_up_proj", t))
    assert torch.equal(parts[p + "block_sparse_moe.experts.1.w3.weight"], t[1, cfg.moe_intermediate_size:])
    qwen = model_config(PRESETS["qwen3-30b-a3b"], num_layers=4)
    assert per_expert_names(qwen, p + "mlp.experts.down_proj", 1) == [p + "mlp.experts.0.down_proj.weight"]


@pytest.mark.parametrize("change, what", [
    (dict(sliding_window=0), r"the mixtral family \(MixtralForCausalLM\): sliding_window must be an integer >= 1 "
                             "or null, got 0"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}), "unsupported rope scaling 'yarn' "
                                                                                     "in the mixtral family"),
    (dict(num_local_experts=None), r"num_local_experts must be an integer >= 1, got None \(the mixtral family"),
    (dict(hidden_act="gelu"), "unsupported hidden_act 'gelu' in the mixtral family"),
])
def test_what_the_family_cannot_serve_is_refused_by_name(ckpts: dict[str, str], change: dict[str, Any],
                                                         what: str) -> None:
    hf = {**_config(ckpts["mixtral"]), **change}
    with pytest.raises(ConfigError, match=what):
        model_config(hf)
    assert model_config({**hf, "sliding_window": 512} if "sliding_window" in change else _config(ckpts["mixtral"]))


def test_a_sliding_window_windows_every_layer(ckpts: dict[str, str]) -> None:
    """sliding_window shorter than the context windows every layer (one KV group, windowed), as transformers' mask;
    one as long as the context is none; the window changes the oracle's tokens on a prompt longer than it."""
    cfg = model_config(_config(ckpts["mixtral_window"]))
    assert cfg.layer_windows == (7, 7) and [(g.layers, g.window) for g in cfg.kv_groups] == [((0, 1), 7)]
    assert model_config({**_config(ckpts["mixtral"]), "sliding_window": 512}).layer_windows == ()
    long = tuple(PROMPTS[4])
    assert hf_greedy(ckpts["mixtral_window"], long, N_OUT) != hf_greedy(ckpts["mixtral"], long, N_OUT)


# ---------------------------------------------------------------------------------------------------------------
# Parity with transformers in every layout, and across live switches
# ---------------------------------------------------------------------------------------------------------------

# (checkpoint, P, start mode); each engine serves in its start layout, then the other after a switch
ENGINES = [("mixtral", 1, "tp"), ("mixtral", 2, "ep"), ("mixtral_mqa", 2, "tp"), ("mixtral", 4, "tp"),
           ("mixtral_mqa", 4, "ep"), ("mixtral_window", 2, "tp")]
# the switch stress's engines (the others switch alike)
STRESSED = {("mixtral", 2), ("mixtral_mqa", 4), ("mixtral_window", 2)}


@pytest.fixture(scope="module", params=ENGINES, ids=[f"{n}-P{p}-{m}" for n, p, m in ENGINES])
def engine(request: pytest.FixtureRequest, ckpts: dict[str, str]) -> Iterator[tuple[str, int, LLM]]:
    name, P, mode = request.param
    yield from serve(ckpts[name], P, mode, ENGINE_KW)


def test_greedy_equals_transformers_in_both_layouts(engine: tuple[str, int, LLM]) -> None:
    path, _, llm = engine
    parity_across_switch(llm, path, PROMPTS, N_OUT)


def test_live_switches_change_no_token(engine: tuple[str, int, LLM]) -> None:
    path, P, llm = engine
    if (os.path.basename(path), P) not in STRESSED:
        pytest.skip("the same switch as a stressed engine's (see STRESSED)")
    switch_stress(llm, path, stress_jobs(PROMPTS, aborted_tokens=8))


# ---------------------------------------------------------------------------------------------------------------
# Weight updates
# ---------------------------------------------------------------------------------------------------------------

def test_weight_updates_by_mixtral_names_and_fused_tensors(ckpts: dict[str, str]) -> None:
    """At P = 2 in EP then TP: an update from disk gives the new checkpoint's tokens; back to the old weights by
    tensors under Mixtral's per-expert names; then the new experts as transformers 5's fused tensors (a trainer's
    named_parameters()) with every other tensor by name: the new tokens again, in both layouts; then a transformers
    model's whole named_parameters() (its router under its in-memory name, mlp.gate): the old tokens. A fused tensor
    and one of its experts by name in one update is refused, naming Mixtral's name."""
    a, b = ckpts["mixtral"], ckpts["mixtral_b"]
    prompts = PROMPTS[2:4]
    want_a = [hf_greedy(a, tuple(p), N_OUT) for p in prompts]
    want_b = [hf_greedy(b, tuple(p), N_OUT) for p in prompts]
    with LLM(model=a, num_ranks=2, mode="ep", **ENGINE_KW) as llm:
        assert greedy_outputs(llm, prompts, N_OUT) == want_a
        assert llm.update_weights_from_disk(b).done
        assert greedy_outputs(llm, prompts, N_OUT) == want_b
        old = saved_tensors(a)
        assert any(".block_sparse_moe.experts.3.w2." in n for n in old)
        assert llm.update_weights(old.items()).done
        assert llm.switch_mode("tp").done
        assert greedy_outputs(llm, prompts, N_OUT) == want_a
        fused = {n: t.detach() for n, t in hf_model(b).named_parameters() if fused_name(n) is None
                 and n.endswith(("experts.gate_up_proj", "experts.down_proj"))}
        assert sorted(fused) == sorted(f"model.layers.{i}.mlp.experts.{w}" for i in range(2)
                                       for w in ("gate_up_proj", "down_proj"))
        rest = {n: t for n, t in saved_tensors(b).items() if fused_name(n) is None}
        w1 = "model.layers.0.block_sparse_moe.experts.1.w1.weight"
        with pytest.raises(ValueError, match=f"tensor {w1.replace('.', '[.]')} is given twice"):
            llm.update_weights([*fused.items(), (w1, saved_tensors(b)[w1])])
        assert llm.update_weights([*fused.items(), *rest.items()]).done
        assert greedy_outputs(llm, prompts, N_OUT) == want_b
        assert llm.switch_mode("ep").done
        assert greedy_outputs(llm, prompts, N_OUT) == want_b
        # a trainer's transformers model as it is: named_parameters() (the router as mlp.gate, fused experts)
        assert llm.update_weights(hf_model(a).named_parameters()).done
        assert greedy_outputs(llm, prompts, N_OUT) == want_a
        assert_kv_free(llm)


# ---------------------------------------------------------------------------------------------------------------
# Presets
# ---------------------------------------------------------------------------------------------------------------

# (layers, hidden, heads, KV heads, experts, top-k, expert intermediate, vocab, max positions)
SHAPES = {"mixtral-8x7b": (32, 4096, 32, 8, 8, 2, 14336, 32000, 32768),
          "mixtral-8x22b": (56, 6144, 48, 8, 8, 2, 16384, 32000, 65536)}


@pytest.mark.parametrize("preset", SHAPES)
def test_presets_parse_with_their_published_shapes(preset: str) -> None:
    cfg = model_config(PRESETS[preset])
    assert family_of(cfg).name == "mixtral"
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.num_experts, cfg.top_k,
            cfg.moe_intermediate_size, cfg.vocab_size, cfg.max_position_embeddings) == SHAPES[preset]
    assert cfg.head_dim == 128 and cfg.rope_theta == 1e6 and cfg.norm_topk_prob
    for P in (1, 2, 4, 8):
        check_shapes(cfg, P)
        for mode in MODES:
            cut = model_config(PRESETS[preset], 2)
            specs = family_of(cut).weight_specs(cut, Layout(cut, mode, P - 1, P), 2)
            assert sum(1 for s in specs if s.slot is not None) == 2 * 2  # w13 and w2 in each layer's slot


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("MOEBIUS_BIG_PRESETS") != "1", reason="a minute and GBs: MOEBIUS_BIG_PRESETS=1")
@pytest.mark.parametrize("preset", SHAPES)
def test_presets_start_with_dummy_weights_on_the_cpu(preset: str) -> None:
    """--load-format dummy --num-layers 2 on the CPU: starts and generates. A layer's experts are 2.8 GB (8x7B) to
    4.8 GB (8x22B) of bfloat16, drawn on the CPU: 8x7B took 90 s and 9.2 GB resident here, hence opt-in."""
    with LLM(model=preset, load_format="dummy", num_layers=2, device="cpu", dtype="bfloat16", max_model_len=64,
             max_total_tokens=64, max_num_batched_tokens=16, max_running_requests=2) as llm:
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0.0))
        assert len(out[0].outputs[0].token_ids) == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["mixtral", "mixtral_mqa", "mixtral_window"])
def test_greedy_equals_transformers_on_the_gpu(ckpts: dict[str, str], name: str) -> None:
    """On the GPU in float32: decode graphs and step pieces (q and k
    roped through torch ops, the paged attention kernel between the pieces) give transformers' greedy tokens, in
    both layouts across a switch; so do eager steps, and graphs with every step resolved first."""
    gpu_parity(ckpts[name], PROMPTS, N_OUT, ENGINE_KW)
