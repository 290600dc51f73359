"""The GLM-4.5 / 4.6 family (`Glm4MoeForCausalLM`) served end to end on the CPU (float32): config.json parsed into
the engine's ModelConfig (partial rotary, q/k norm, DeepSeek-V3's MoE block in `extra`), the checkpoint names
transformers writes, and greedy tokens identical to transformers' own Glm4MoeForCausalLM for P = 1, 2, 4 in TP and EP,
across live switches with arrivals, aborts and n > 1, with no KV page leaked; a weight update from disk, the MTP
layer's tensors never read; the GPU parity test (marked gpu, run on an H200); the
presets (glm-4.5-air, glm-4.5) with their published shapes, GLM-4.5-Air started on the CPU with dummy weights.

Checkpoints (written here by transformers' Glm4MoeForCausalLM, weights as tests/conftest.py's `_reinit_`, the
routers' e_score_correction_bias random):
  glm_qk     GLM-4.5's attention: q/k norm, q|k|v bias, half the head rotated (8 of 16 dims); 4 query heads on 2 KV
             heads; sigmoid routing in 4 groups of 2 experts keeping 2, norm_topk_prob, routed_scaling_factor 2.5; one
             shared expert; layer 0 dense (first_k_dense_replace = 1)
  glm_plain  GLM-4.5-Air's attention: no q/k norm, q|k|v bias, a quarter of the head rotated (4 of 16); 2 groups
             keeping 1, raw weights (norm_topk_prob false), two shared experts, layers 0 and 1 dense
  glm_qk_b   other weights of glm_qk's shapes (a weight update's target)
Every engine runs prompts crossing 4-token pages with a 16-token step budget (prompt chunks and decodes share steps).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from conftest import VOCAB
from family_cases import (
    ENGINE_KW,
    Job,
    assert_kv_free,
    assert_routed,
    generate_help,
    gpu_parity,
    greedy_outputs,
    hf_greedy,
    parity_across_switch,
    random_prompts,
    serve,
    switch_stress,
    write_hf_checkpoint,
)
from family_cases import hf_config as _config

from moebius import LLM, SamplingParams
from moebius.config import PRESETS, ConfigError, KVSpec
from moebius.models.registry import FAMILIES, family_of, model_config
from moebius.parallel.layout import MODES, Layout, check_shapes

N_OUT = 8
PROMPTS: list[list[int]] = random_prompts(11, (1, 6, 9, 17))

# Keyword arguments of transformers' Glm4MoeConfig (tiny: 4 heads on 2 KV heads, 8 experts, P up to 4)
GLM_CONFIG: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
    n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1, norm_topk_prob=True,
    routed_scaling_factor=2.5, attention_bias=True, use_qk_norm=True, partial_rotary_factor=0.5,
    max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=False, eos_token_id=None,
)
VARIANTS: dict[str, tuple[dict[str, Any], int]] = {
    "glm_qk": ({}, 0),
    "glm_plain": (dict(use_qk_norm=False, partial_rotary_factor=0.25, n_group=2, topk_group=1, norm_topk_prob=False,
                       routed_scaling_factor=1.0, n_shared_experts=2, first_k_dense_replace=2), 1),
    "glm_qk_b": ({}, 3),
}


def write_glm_checkpoint(path: str, overrides: dict[str, Any], seed: int) -> str:
    """Save a random Glm4MoeForCausalLM with save_pretrained, its weights re-initialised as `_reinit_` does and the
    routers' e_score_correction_bias random (std 0.1: it changes some choices)."""
    return write_hf_checkpoint(path, "Glm4MoeForCausalLM", {**GLM_CONFIG, **overrides}, seed, router_bias=True)


@pytest.fixture(scope="module")
def glm(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], str]:
    """The checkpoint directory of a variant, written on first use."""
    root = tmp_path_factory.mktemp("glm4_moe")
    paths: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in paths:
            overrides, seed = VARIANTS[name]
            paths[name] = write_glm_checkpoint(str(root / name), overrides, seed)
        return paths[name]

    return get


# ---------------------------------------------------------------------------------------------------------------
# Config and checkpoint names
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["glm_qk", "glm_plain"])
def test_config_and_checkpoint_names(glm: Callable[[str], str], name: str) -> None:
    """The family, GQA's KV spec, the rotated width, the q/k norm, the dense layers by first_k_dense_replace and
    the routing; every tensor transformers saved is one the family reads, and no other."""
    path = glm(name)
    hf = _config(path)
    cfg = model_config(hf)
    ext = cfg.extra
    assert family_of(cfg) is FAMILIES["glm4_moe"] and cfg.family == "glm4_moe"
    assert cfg.kv_spec == KVSpec(parts=2, heads=2, dim=16)
    assert (ext.rotary_dim, ext.qk_norm) == ((8, True) if name == "glm_qk" else (4, False))
    assert [cfg.is_moe_layer(i) for i in range(cfg.num_layers)] == [
        i >= hf["first_k_dense_replace"] for i in range(hf["num_hidden_layers"])]
    assert (ext.moe.scoring_func, ext.moe.topk_method, ext.moe.n_group) == ("sigmoid", "noaux_tc", hf["n_group"])
    assert hash(cfg) == hash(model_config(hf))  # a cache key
    assert model_config(hf, 1).mlp_only_layers == cfg.mlp_only_layers  # a cut keeps the whole model's dense rule
    from safetensors import safe_open

    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        saved = set(f.keys())
    known = family_of(cfg).checkpoint_tensors(cfg)
    fused = {n for n in known if n.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))}
    assert set(known) - fused == saved


def test_config_errors_name_the_field(glm: Callable[[str], str]) -> None:
    hf = _config(glm("glm_qk"))
    for change, named in [({"n_routed_experts": None}, "n_routed_experts must be an integer"),
                          ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling 'yarn'"),
                          ({"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.1}}, "rotates 1 dims"),
                          ({"hidden_act": "gelu"}, "hidden_act"), ({"n_group": 3}, "n_group"),
                          ({"n_group": 8, "topk_group": 4}, "best two")]:
        with pytest.raises(ConfigError, match=named):
            model_config(hf | change)
    # the published files' top-level rope fields (transformers 4.x) and Glm4MoeConfig's default factor
    old = {k: v for k, v in hf.items() if k != "rope_parameters"} | dict(rope_theta=1e6, partial_rotary_factor=0.25)
    assert (model_config(old).extra.rotary_dim, model_config(old).rope_theta) == (4, 1e6)
    assert model_config({k: v for k, v in hf.items() if k != "rope_parameters"}).extra.rotary_dim == 8


# ---------------------------------------------------------------------------------------------------------------
# Parity with transformers in every layout, and across live switches
# ---------------------------------------------------------------------------------------------------------------

# (checkpoint, P, start mode); each engine serves in its start layout, then the other after a switch
ENGINES = [("glm_qk", 1, "tp"), ("glm_plain", 1, "ep"), ("glm_qk", 2, "ep"), ("glm_plain", 2, "tp"),
           ("glm_qk", 4, "tp"), ("glm_plain", 4, "ep")]
# the engines the switch stress runs on (the others differ from these in the math only, which a switch moves alike)
STRESSED = {("glm_qk", 2), ("glm_plain", 4)}


@pytest.fixture(scope="module", params=ENGINES, ids=[f"{n}-P{p}-{m}" for n, p, m in ENGINES])
def engine(request: pytest.FixtureRequest, glm: Callable[[str], str]) -> Iterator[tuple[str, int, LLM]]:
    name, P, mode = request.param
    yield from serve(glm(name), P, mode, ENGINE_KW)


def test_greedy_equals_transformers_in_both_layouts(engine: tuple[str, int, LLM]) -> None:
    """A batch of prompts in the start layout, then in the other after a switch: transformers' greedy tokens."""
    path, _, llm = engine
    parity_across_switch(llm, path, PROMPTS, N_OUT, back=False)


def test_live_switches_change_no_token(engine: tuple[str, int, LLM]) -> None:
    """Arrivals, aborts, sampled n = 2 and greedy requests under a switch at many steps: the outputs of the run
    without switches (greedy: transformers'), aborted ones a prefix, and every KV page free afterwards."""
    path, P, llm = engine
    if (os.path.basename(path), P) not in STRESSED:
        pytest.skip("the same switch as a stressed engine's (see STRESSED)")
    jobs = [Job(0, PROMPTS[3], SamplingParams(temperature=0.0, max_tokens=8)),
            Job(0, PROMPTS[1], SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=6, n=2)),
            Job(0, PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=8), 4),
            Job(2, PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=6))]
    switch_stress(llm, path, jobs, switch_at={1, 2, 3, 5, 8})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["glm_qk", "glm_plain"])
def test_greedy_equals_transformers_on_the_gpu(glm: Callable[[str], str], name: str) -> None:
    """On the GPU in float32: decode graphs and step pieces
    (partial rotary through torch ops, the paged attention kernel between the pieces) give transformers' greedy
    tokens, in both layouts across a switch; so do eager steps, and graphs with every step resolved first."""
    gpu_parity(glm(name), PROMPTS, N_OUT, ENGINE_KW)


def test_weight_update_from_disk_and_routed_experts(glm: Callable[[str], str]) -> None:
    """An update from disk rewrites every view the specs cut (the next tokens are the new checkpoint's, in both
    layouts), and the routed experts of each output token are those of the MoE layers."""
    with LLM(model=glm("glm_qk"), num_ranks=2, mode="ep", enable_return_routed_experts=True, **ENGINE_KW) as llm:
        prompt = PROMPTS[2]
        out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4, return_routed_experts=True))
        sample = out[0].outputs[0]
        assert list(sample.token_ids) == hf_greedy(glm("glm_qk"), tuple(prompt), 4)
        assert_routed(sample.routed_experts, (4, 2, 2), 8)  # tokens, MoE layers, top-k
        assert llm.update_weights_from_disk(glm("glm_qk_b")).done
        want = hf_greedy(glm("glm_qk_b"), tuple(prompt), N_OUT)
        assert greedy_outputs(llm, [prompt], N_OUT) == [want]
        assert llm.switch_mode("tp").done
        assert greedy_outputs(llm, [prompt], N_OUT) == [want]
        assert_kv_free(llm)


def test_the_multi_token_prediction_layer_is_not_read(glm: Callable[[str], str], tmp_path: Any) -> None:
    """A checkpoint with GLM-4.5's MTP layer (model.layers.{num_hidden_layers}.*, num_nextn_predict_layers = 1) loads
    and updates from disk as one without it: its tensors are never read."""
    import shutil

    from safetensors.torch import load_file, save_file

    path = str(tmp_path / "glm_qk_b_mtp")
    shutil.copytree(glm("glm_qk_b"), path)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    D, mtp = GLM_CONFIG["hidden_size"], f"model.layers.{GLM_CONFIG['num_hidden_layers']}."
    tensors |= {mtp + "eh_proj.weight": torch.randn(D, 2 * D), mtp + "enorm.weight": torch.ones(D),
                mtp + "mlp.experts.0.down_proj.weight": torch.randn(D, 32)}
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    prompt = PROMPTS[1]
    with LLM(model=path, **ENGINE_KW) as llm:
        assert greedy_outputs(llm, [prompt], N_OUT) == [hf_greedy(glm("glm_qk_b"), tuple(prompt), N_OUT)]
        assert llm.update_weights_from_disk(glm("glm_qk")).done
        assert llm.update_weights_from_disk(path).done
        assert greedy_outputs(llm, [prompt], N_OUT) == [hf_greedy(glm("glm_qk_b"), tuple(prompt), N_OUT)]


# ---------------------------------------------------------------------------------------------------------------
# Presets
# ---------------------------------------------------------------------------------------------------------------

GLM = ("glm-4.5-air", "glm-4.5")
# (layers, hidden, heads, KV heads, routed experts, top-k, shared, dense layers, rotated dims, q/k norm)
SHAPES = {
    "glm-4.5-air": (46, 4096, 96, 8, 128, 8, 1, (0,), 64, False),
    "glm-4.5": (92, 5120, 96, 8, 160, 8, 1, (0, 1, 2), 64, True),
}


@pytest.mark.parametrize("preset", GLM)
def test_preset_parses_with_its_published_shapes(preset: str) -> None:
    cfg = model_config(PRESETS[preset])
    ext = cfg.extra
    layers, hidden, heads, kvh, experts, top_k, shared, dense, rot, qk_norm = SHAPES[preset]
    assert cfg.family == "glm4_moe" and family_of(cfg).name == "glm4_moe"
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.num_experts, cfg.top_k,
            ext.moe.n_shared_experts, cfg.mlp_only_layers, ext.rotary_dim, ext.qk_norm) == (
        layers, hidden, heads, kvh, experts, top_k, shared, dense, rot, qk_norm)
    assert cfg.kv_spec == KVSpec(parts=2, heads=8, dim=128) and cfg.attention_bias
    for P in (1, 2, 4, 8):  # both layouts exist, the experts' slot the same bytes in each
        check_shapes(cfg, P)
        cut = model_config(PRESETS[preset], num_layers=4)
        for mode in MODES:
            specs = family_of(cut).weight_specs(cut, Layout(cut, mode, P - 1, P), 2)
            assert all(all(n > 0 for n in s.shape) for s in specs)
            assert sum(1 for s in specs if s.slot is not None) == 2 * (4 - len(dense))
        assert Layout(cfg, "tp", 0, P).expert_bytes(2) == Layout(cfg, "ep", 0, P).expert_bytes(2)
        floor = family_of(cfg).floor_terms(cfg, Layout(cfg, "ep", 0, P))  # the shared experts: 1/P a rank
        assert floor.moe_layers == layers - len(dense)
        assert floor.shared_weights == floor.moe_layers * 3 * hidden * cfg.moe_intermediate_size * shared / P
    assert preset in generate_help()


@pytest.mark.slow
def test_glm_4_5_air_starts_on_the_cpu() -> None:
    """GLM-4.5-Air cut to its one dense layer, random weights in bfloat16 (about 2.8 GB written, the vocabulary
    matrices most of it): starts and generates. Its first MoE layer would add 4.4 GB of experts in each of three
    slots, and GLM-4.5 (7.5 GB of experts a slot) does not fit this machine's memory even cut to one layer: those are
    checked by shape only (above)."""
    with LLM(model="glm-4.5-air", load_format="dummy", num_layers=1, device="cpu", dtype="bfloat16",
             max_model_len=64, max_total_tokens=256, max_num_batched_tokens=64, max_running_requests=4) as llm:
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0.0))
        assert len(out[0].outputs[0].token_ids) == 2
        assert llm.engine.model_config.extra.rotary_dim == 64
