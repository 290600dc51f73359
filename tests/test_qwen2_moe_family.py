"""The Qwen2-MoE family served end to end on the CPU (float32): config.json parsed into the engine's ModelConfig
(the shared expert's size in its extra, the dense-layer rule as Qwen3-MoE's), the checkpoint names transformers
writes (q|k|v biases, `mlp.shared_expert.*`, `mlp.shared_expert_gate`), and greedy tokens identical to transformers'
own Qwen2MoeForCausalLM for P = 1, 2, 4 in TP and EP, across live switches with arrivals, aborts and n > 1, with no
KV page leaked; a weight update from disk and by tensors (the shared expert's shards and gate included); sliding
windows and a shared expert the ranks cannot cut refused, naming the family; the presets.

Checkpoints (written here by transformers' Qwen2MoeForCausalLM, std 0.3 weights as tests/conftest.py's `_reinit_`):
  qwen2_moe       GQA (4 query heads, 2 KV heads) with q|k|v biases, 8 experts top-2 without renormalisation
                  (norm_topk_prob false, as published), a shared expert of 48, layer 1 dense (mlp_only_layers)
  qwen2_moe_norm  norm_topk_prob true, decoder_sparse_step 2 (layers 1 and 3 MoE), one KV head, tied embeddings,
                  no q|k|v bias (qkv_bias false)
  qwen2_moe_b     other weights of qwen2_moe's shapes (a weight update's target)
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
    assert_routed,
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
from moebius.parallel.layout import MODES, Layout, check_shapes

N_OUT = 8
PROMPTS: list[list[int]] = random_prompts(11, (1, 5, 9, 17, 23))  # test_mixtral_family.py's
CONFIG: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    shared_expert_intermediate_size=48, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
    num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, mlp_only_layers=[1], decoder_sparse_step=1,
    max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False, use_sliding_window=False,
    rope_parameters={"rope_type": "default", "rope_theta": 1e6},
)
VARIANTS: dict[str, tuple[dict[str, Any], int]] = {
    "qwen2_moe": ({}, 0),
    "qwen2_moe_norm": (dict(norm_topk_prob=True, decoder_sparse_step=2, mlp_only_layers=[], num_hidden_layers=4,
                            num_key_value_heads=1, tie_word_embeddings=True, qkv_bias=False), 1),
    "qwen2_moe_b": ({}, 3),
    # layer 0 slides (transformers' rule: even layers below max_window_layers), 1 and 2 attend to every key
    "qwen2_moe_window": (dict(use_sliding_window=True, sliding_window=6, max_window_layers=2), 0),
}


def write_qwen2_moe(path: str, overrides: dict[str, Any], seed: int) -> str:
    return write_hf_checkpoint(path, "Qwen2MoeForCausalLM", {**CONFIG, **overrides}, seed)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("qwen2_moe")
    return {name: write_qwen2_moe(str(root / name), ov, seed) for name, (ov, seed) in VARIANTS.items()}


# ---------------------------------------------------------------------------------------------------------------
# Config, checkpoint names, refusals
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["qwen2_moe", "qwen2_moe_norm"])
def test_config_and_checkpoint_names(ckpts: dict[str, str], name: str) -> None:
    """The family, its KV spec, the dense layers by mlp_only_layers / decoder_sparse_step, the q|k|v bias and the
    shared expert's size; every tensor transformers saved is one the family reads, and no other but the fused
    expert tensors an update may give instead."""
    from safetensors import safe_open

    path = ckpts[name]
    hf = _config(path)
    cfg = model_config(hf)
    assert family_of(cfg) is FAMILIES["qwen2moe"] and cfg.family == "qwen2moe"
    assert cfg.kv_spec == KVSpec(parts=2, heads=hf["num_key_value_heads"], dim=16)
    assert cfg.attention_bias == (name == "qwen2_moe") and cfg.extra.shared_intermediate_size == 48
    assert cfg.norm_topk_prob == hf["norm_topk_prob"]
    moe = [cfg.is_moe_layer(i) for i in range(cfg.num_layers)]
    assert moe == ([True, False, True] if name == "qwen2_moe" else [False, True, False, True])
    assert hash(cfg) == hash(model_config(hf))  # a cache key
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        saved = set(f.keys())
    assert f"model.layers.{moe.index(True)}.mlp.shared_expert_gate.weight" in saved
    assert ("model.layers.0.self_attn.v_proj.bias" in saved) == cfg.attention_bias
    known = family_of(cfg).checkpoint_tensors(cfg)
    fused = {n for n in known if n.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))}
    assert set(known) - fused == saved and len(fused) == 2 * sum(moe)


@pytest.mark.parametrize("change, what", [
    (dict(use_sliding_window=True, sliding_window=None), r"the qwen2moe family \(Qwen2MoeForCausalLM\): "
                                                         "use_sliding_window needs sliding_window an integer >= 1"),
    (dict(layer_types=["sliding_attention", "full_attention", "full_attention"]), "layer_types name "
                                                                                  "sliding_attention layers but "
                                                                                  "use_sliding_window is false"),
    (dict(shared_expert_intermediate_size=None), "shared_expert_intermediate_size must be an integer >= 1, got "
                                                 r"None \(the qwen2moe family"),
    (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6}),
     "unsupported rope scaling 'dynamic' in the qwen2moe family"),
])
def test_what_the_family_cannot_serve_is_refused_by_name(ckpts: dict[str, str], change: dict[str, Any],
                                                         what: str) -> None:
    with pytest.raises(ConfigError, match=what):
        model_config({**_config(ckpts["qwen2_moe"]), **change})


def test_sliding_layers_are_transformers(ckpts: dict[str, str]) -> None:
    """use_sliding_window: config.json's layer_types (transformers' rule) slide by sliding_window, in a KV group of
    their own after the full layers'; the window changes the oracle's tokens on a prompt longer than it."""
    cfg = model_config(_config(ckpts["qwen2_moe_window"]))
    assert cfg.layer_windows == (6, None, None)
    assert [(g.layers, g.window) for g in cfg.kv_groups] == [((1, 2), None), ((0,), 6)]
    hf = {**_config(ckpts["qwen2_moe_window"]), "layer_types": None}  # (4.x's config.json: the rule)
    assert model_config(hf).layer_windows == (6, None, None)
    long = tuple(PROMPTS[4])
    assert hf_greedy(ckpts["qwen2_moe_window"], long, N_OUT) != hf_greedy(ckpts["qwen2_moe"], long, N_OUT)


def test_a_shared_expert_the_ranks_cannot_cut_is_refused(ckpts: dict[str, str]) -> None:
    """Each rank holds 1/P of the shared expert in both layouts: a P that does not divide its intermediate size is
    refused, naming the family (at start-up: the ranks' weight specs), and check_shapes' other numbers pass."""
    cfg = model_config({**_config(ckpts["qwen2_moe"]), "shared_expert_intermediate_size": 50})
    check_shapes(cfg, 4)
    for mode in MODES:
        with pytest.raises(ConfigError, match="the qwen2moe family cannot cut shared_expert_intermediate_size 50 "
                                              f"over 4 ranks \\(the {mode} layout"):
            family_of(cfg).weight_specs(cfg, Layout(cfg, mode, 0, 4), 4)
    assert family_of(cfg).weight_specs(cfg, Layout(cfg, "ep", 1, 2), 4)


def test_an_engine_whose_ranks_cannot_cut_the_shared_expert_does_not_start(tmp_path: Any) -> None:
    path = write_qwen2_moe(str(tmp_path / "odd_shared"), {"shared_expert_intermediate_size": 49}, 0)
    with pytest.raises(ConfigError, match="the qwen2moe family cannot cut shared_expert_intermediate_size 49 over 2 "
                                          "ranks"):
        LLM(model=path, num_ranks=2, **ENGINE_KW)


# ---------------------------------------------------------------------------------------------------------------
# Parity with transformers in every layout, and across live switches
# ---------------------------------------------------------------------------------------------------------------

# (checkpoint, P, start mode); each engine serves in its start layout, then the other after a switch
# (qwen2_moe_norm's one KV head is replicated at P = 4 in TP: P = 2 adds nothing to it)
ENGINES = [("qwen2_moe", 1, "ep"), ("qwen2_moe", 2, "tp"), ("qwen2_moe", 4, "ep"), ("qwen2_moe_norm", 4, "tp"),
           ("qwen2_moe_window", 2, "ep")]
# the switch stress's engines (the others switch alike)
STRESSED = {("qwen2_moe", 2), ("qwen2_moe", 4), ("qwen2_moe_window", 2)}


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
# Weight updates, routed experts
# ---------------------------------------------------------------------------------------------------------------

def test_weight_updates_and_routed_experts(ckpts: dict[str, str]) -> None:
    """At P = 2 in TP then EP: an update from disk gives the new checkpoint's tokens; back by tensors (the shared
    expert's three projections and its gate among them, every rank cutting its shard again) and a switch: the old
    tokens; then only the shared experts and their gates of the new checkpoint: neither checkpoint's tokens, but
    transformers' on the old one with those tensors swapped in. The routed experts of each token are the MoE
    layers' top-k ids."""
    a, b = ckpts["qwen2_moe"], ckpts["qwen2_moe_b"]
    prompts = PROMPTS[2:4]
    want_a = [hf_greedy(a, tuple(p), N_OUT) for p in prompts]
    want_b = [hf_greedy(b, tuple(p), N_OUT) for p in prompts]
    with LLM(model=a, num_ranks=2, mode="tp", enable_return_routed_experts=True, **ENGINE_KW) as llm:
        out = llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=4, return_routed_experts=True))
        assert_routed(out[0].outputs[0].routed_experts, (4, 2, 2), 8)  # tokens, MoE layers, top-k
        assert llm.update_weights_from_disk(b).done
        assert greedy_outputs(llm, prompts, N_OUT) == want_b
        assert llm.update_weights(saved_tensors(a).items()).done
        assert llm.switch_mode("ep").done
        assert greedy_outputs(llm, prompts, N_OUT) == want_a
        shared = {n: t for n, t in saved_tensors(b).items() if ".shared_expert" in n}
        assert len(shared) == 2 * 4
        assert llm.update_weights(shared.items()).done
        got = greedy_outputs(llm, prompts, N_OUT)
        assert llm.switch_mode("tp").done
        assert greedy_outputs(llm, prompts, N_OUT) == got
        assert_kv_free(llm)
    hf = hf_model(a)
    try:
        with torch.no_grad():
            params = dict(hf.named_parameters())
            old = {n: params[n].clone() for n in shared}
            for n, t in shared.items():
                params[n].copy_(t)
        seq_want = []
        for p in prompts:
            seq = list(p)
            with torch.no_grad():
                for _ in range(N_OUT):
                    seq.append(int(hf(input_ids=torch.tensor([seq]), use_cache=False).logits[0, -1].argmax()))
            seq_want.append(seq[len(p):])
        assert got == seq_want and got != want_a
    finally:
        with torch.no_grad():
            for n, t in old.items():
                params[n].copy_(t)


# ---------------------------------------------------------------------------------------------------------------
# Presets
# ---------------------------------------------------------------------------------------------------------------

# (layers, hidden, heads, KV heads, experts, top-k, expert intermediate, shared intermediate, vocab)
SHAPES = {"qwen1.5-moe-a2.7b": (24, 2048, 16, 16, 60, 4, 1408, 5632, 151936),
          "qwen2-57b-a14b": (28, 3584, 28, 4, 64, 8, 2560, 20480, 151936)}


@pytest.mark.parametrize("preset", SHAPES)
def test_presets_parse_with_their_published_shapes(preset: str) -> None:
    """Each parses; both layouts exist where the shapes allow (60 experts: P = 1, 2, 4; 28 heads: 1, 2, 4) and a
    cut's weight specs have every rank's shapes whole; the engine refuses P = 8 naming the number."""
    cfg = model_config(PRESETS[preset])
    assert family_of(cfg).name == "qwen2moe"
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.num_experts, cfg.top_k,
            cfg.moe_intermediate_size, cfg.extra.shared_intermediate_size, cfg.vocab_size) == SHAPES[preset]
    assert cfg.head_dim == 128 and cfg.attention_bias and not cfg.norm_topk_prob and cfg.rope_theta == 1e6
    cut = model_config(PRESETS[preset], 2)
    for P in (1, 2, 4):
        check_shapes(cfg, P)
        for mode in MODES:
            specs = family_of(cut).weight_specs(cut, Layout(cut, mode, P - 1, P), 2)
            assert all(all(n > 0 for n in s.shape) for s in specs)
            assert sum(1 for s in specs if s.slot is not None) == 2 * 2  # w13 and w2 in each layer's slot
    with pytest.raises(ConfigError, match="num_experts 60 is not divisible by 8 ranks" if cfg.num_experts == 60
                       else "num_attention_heads 28 is not divisible by 8 ranks"):
        check_shapes(cfg, 8)


def test_smallest_preset_starts_with_dummy_weights_on_the_cpu() -> None:
    """qwen1.5-moe-a2.7b with --load-format dummy --num-layers 2 on the CPU (bfloat16): starts, generates, switches.
    Qwen2-57B-A14B's layer holds 2.5 GB of experts and 0.4 GB of shared expert in bfloat16: by shape only."""
    with LLM(model="qwen1.5-moe-a2.7b", load_format="dummy", num_layers=2, device="cpu", dtype="bfloat16",
             max_model_len=64, max_total_tokens=64, max_num_batched_tokens=16, max_running_requests=2) as llm:
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0.0))
        assert len(out[0].outputs[0].token_ids) == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["qwen2_moe", "qwen2_moe_norm", "qwen2_moe_window"])
def test_greedy_equals_transformers_on_the_gpu(ckpts: dict[str, str], name: str) -> None:
    """On the GPU in float32: decode graphs and step pieces (q|k|v
    bias, q and k roped through torch ops; the gated shared expert, the paged attention kernel between the pieces)
    give transformers' greedy tokens, in both layouts across a switch; so do eager steps, and graphs with every step
    resolved first."""
    gpu_parity(ckpts[name], PROMPTS, N_OUT, ENGINE_KW)
