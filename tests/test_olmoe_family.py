"""The OLMoE family served end to end on the CPU (float32): config.json parsed into the engine's ModelConfig (every
layer MoE, experts `intermediate_size` wide, clip_qkv), the checkpoint names transformers writes, and greedy tokens
identical to transformers' own OlmoeForCausalLM for P = 1, 2, 4 in TP and EP, across live switches with arrivals,
aborts and n > 1, with no KV page leaked; a weight update from disk in both layouts; the q/k norms over the whole
projections in TP (a cross-rank sum of squares, each replicated KV head counted once) equal to transformers'
OlmoeRMSNorm; settings the family cannot serve refused by name; the preset olmoe-1b-7b starting on dummy weights.

Checkpoints (written here by transformers' OlmoeForCausalLM, weights re-initialised as conftest's `_reinit_`):
  olmoe      8 heads of 8 and 8 KV heads (MHA, as the release), raw softmax top-2 of 8 experts: 2 heads a rank at P = 4
  olmoe_gqa  2 KV heads (replicated on pairs of ranks in TP at P = 4), clip_qkv 2.0 (it clips q, k and v), top-k
             weights renormalised, lm_head tied to the embedding
  olmoe_b    other weights of olmoe's shapes (a weight update's target)
Every engine runs prompts crossing 4-token pages with a 16-token step budget, so prompt chunks and decodes share
steps.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import family_cases
import pytest
import torch
from conftest import VOCAB
from family_cases import (
    assert_kv_free,
    assert_routed,
    gpu_parity,
    greedy_outputs,
    hf_greedy,
    parity_across_switch,
    random_prompts,
    serve,
    stress_jobs,
    switch_stress,
    write_hf_checkpoint,
)
from family_cases import hf_config as _config

from moebius import LLM, SamplingParams
from moebius.config import PRESETS, ConfigError, EngineConfig, KVSpec
from moebius.models.registry import FAMILIES, family_of, model_config
from moebius.parallel.layout import Layout, check_shapes

N_OUT = 8
PROMPTS: list[list[int]] = random_prompts(11, (1, 5, 9, 17, 23))
ENGINE_KW: dict[str, Any] = dict(family_cases.ENGINE_KW, enable_return_routed_experts=True)

# Keyword arguments of transformers' OlmoeConfig (tiny: 8 heads, 8 experts, P up to 4)
OLMOE_CONFIG: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=8,
    num_key_value_heads=8, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, max_position_embeddings=512,
    rms_norm_eps=1e-5, tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)
VARIANTS: dict[str, tuple[dict[str, Any], int]] = {  # overrides, seed
    "olmoe": ({}, 0),
    "olmoe_gqa": (dict(num_key_value_heads=2, clip_qkv=2.0, norm_topk_prob=True, tie_word_embeddings=True), 1),
    "olmoe_b": ({}, 3),
    # the GPU's: head_dim 16 (the paged attention kernel's tensor-core dots need K >= 16; 8 heads give 8)
    "olmoe_d16": (dict(num_attention_heads=4, num_key_value_heads=4), 0),
    "olmoe_gqa_d16": (dict(num_attention_heads=4, num_key_value_heads=2, clip_qkv=2.0, norm_topk_prob=True,
                           tie_word_embeddings=True), 1),
}


def write_olmoe_checkpoint(path: str, overrides: dict[str, Any], seed: int) -> str:
    """Save a random OlmoeForCausalLM with save_pretrained (no EOS: greedy runs go their full length)."""
    return write_hf_checkpoint(path, "OlmoeForCausalLM", {**OLMOE_CONFIG, **overrides, "pad_token_id": None}, seed)


@pytest.fixture(scope="module")
def olmoe(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], str]:
    """The checkpoint directory of a variant, written on first use."""
    root = tmp_path_factory.mktemp("olmoe")

    @functools.cache
    def path(name: str) -> str:
        overrides, seed = VARIANTS[name]
        return write_olmoe_checkpoint(str(root / name), overrides, seed)

    return path


# ---------------------------------------------------------------------------------------------------------------
# Config, checkpoint names, refusals
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["olmoe", "olmoe_gqa"])
def test_config_and_checkpoint_names(olmoe: Callable[[str], str], name: str) -> None:
    """The family, GQA's KV spec (K and V of the KV heads, hidden / heads wide), every layer MoE with experts of
    intermediate_size, clip_qkv in the family's fields; every tensor transformers saved is one the family reads,
    and no other (the fused expert names besides)."""
    path = olmoe(name)
    hf = _config(path)
    cfg = model_config(hf)
    assert family_of(cfg) is FAMILIES["olmoe"] and cfg.family == "olmoe"
    assert cfg.kv_spec == KVSpec(parts=2, heads=hf["num_key_value_heads"], dim=8)
    assert all(cfg.is_moe_layer(i) for i in range(cfg.num_layers)) and cfg.intermediate_size == 0
    assert (cfg.num_experts, cfg.top_k, cfg.moe_intermediate_size) == (8, 2, 32)
    assert cfg.norm_topk_prob == hf["norm_topk_prob"] and cfg.extra.clip_qkv == hf["clip_qkv"]
    assert hash(cfg) == hash(model_config(hf))  # a cache key
    from safetensors import safe_open

    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        saved = set(f.keys())
    known = family_of(cfg).checkpoint_tensors(cfg)
    fused = {n for n in known if n.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))}
    assert set(known) - fused == saved


@pytest.mark.parametrize("change, what", [
    (dict(num_experts=None), "config.json lacks num_experts: an OLMoE model's config.json needs it"),
    (dict(intermediate_size=0), "config.json's intermediate_size must be an integer >= 1, got 0"),
    (dict(attention_bias=True), "attention_bias = true .* is not supported"),
    (dict(head_dim=16), "head_dim 16 is not supported: its q/k norms span hidden_size"),
    (dict(hidden_act="gelu"), "unsupported hidden_act 'gelu'"),
    (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}), "rope scaling 'linear'"),
    (dict(clip_qkv=-1), "clip_qkv must be a positive number, got -1"),
])
def test_unsupported_settings_are_refused_by_name(olmoe: Callable[[str], str], change: dict[str, Any],
                                                  what: str) -> None:
    hf = {k: v for k, v in {**_config(olmoe("olmoe")), **change}.items() if v is not None}
    with pytest.raises(ConfigError, match=what):
        model_config(hf)


def test_a_family_awaiting_its_gpu_run_is_refused_there(olmoe: Callable[[str], str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A family whose GPU path is written but not yet run there (`Family.cpu_only`, as OLMoE's was) is refused on cuda
    at start-up naming the family and why; MOEBIUS_UNCHECKED_GPU names the ones its GPU tests start."""
    import dataclasses

    from moebius.models import registry
    from moebius.worker.build import build_rank
    from moebius.worker.rank import RankSpec

    path = olmoe("olmoe")
    monkeypatch.setitem(registry.FAMILIES, "olmoe", dataclasses.replace(
        registry.FAMILIES["olmoe"], cpu_only="its GPU path (the q/k norm) is not yet checked on a GPU"))
    monkeypatch.delenv("MOEBIUS_UNCHECKED_GPU", raising=False)
    with pytest.raises(ConfigError, match=r"the olmoe family \(OlmoeForCausalLM\) cannot run on cuda yet: its GPU "
                                          r"path .* not yet checked on a GPU; serve it with --device cpu"):
        build_rank(RankSpec(engine=EngineConfig.from_kwargs(model=path, device="cuda"), model=model_config(
            _config(path)), checkpoint=path, device="cuda", dtype="float32", eos_token_ids=(), max_model_len=64))


# ---------------------------------------------------------------------------------------------------------------
# The q/k norms over the whole projections in TP
# ---------------------------------------------------------------------------------------------------------------

class _Ranks:
    """P ranks as threads of this process: `reduce_heads` sums their tensors (what TPComm's all-reduce gives, without
    spawning a group: the engines at P = 2 and 4 run the real one)."""

    def __init__(self, P: int) -> None:
        self.parts: list[torch.Tensor] = []
        self.lock, self.barrier = threading.Lock(), threading.Barrier(P)

    def reduce_heads(self, x_TN: torch.Tensor) -> torch.Tensor:
        with self.lock:
            self.parts.append(x_TN.clone())
        self.barrier.wait()
        return torch.stack(self.parts).sum(0)


def test_tp_norm_equals_the_whole_projections_norm(olmoe: Callable[[str], str]) -> None:
    """Four TP ranks of olmoe_gqa (2 q heads a rank; each of the 2 KV heads on two ranks, counted once): each rank's
    q and k heads normed by `whole_qk_norm` (its sums of squares summed over the ranks) are those heads of
    transformers' OlmoeRMSNorm over the whole q_proj(x) and k_proj(x); v is untouched."""
    from safetensors.torch import load_file
    from transformers.models.olmoe.modeling_olmoe import OlmoeRMSNorm

    from moebius.models.olmoe.forward import whole_qk_norm
    from moebius.models.olmoe.weights import AttnWeights, attention_specs, k_share

    path, P, p = olmoe("olmoe_gqa"), 4, "model.layers.1."
    cfg = model_config(_config(path))
    tensors = load_file(os.path.join(path, "model.safetensors"))
    x_TD = torch.randn(7, cfg.hidden_size, generator=torch.Generator().manual_seed(5))
    whole = {}
    for proj in ("q", "k"):
        norm = OlmoeRMSNorm(cfg.hidden_size if proj == "q" else cfg.kv_size, eps=cfg.rms_norm_eps)
        norm.weight.data.copy_(tensors[p + f"self_attn.{proj}_norm.weight"])
        with torch.no_grad():
            whole[proj] = norm(x_TD @ tensors[p + f"self_attn.{proj}_proj.weight"].T)
    ranks, got = _Ranks(P), {}

    def rank(r: int) -> None:
        lay = Layout(cfg, "tp", r, P)
        # by kind: qkv, o_proj, q_norm, k_norm (the heads' tags left off)
        v = {s.name[len(p):].split(".")[0]: s.load(lambda n, shape: tensors[n]) for s in attention_specs(cfg, lay, p)}
        qkv_TQ = x_TD @ v["qkv"].T
        whole_qk_norm(qkv_TQ, AttnWeights(v["qkv"], v["o_proj"], v["q_norm"], v["k_norm"], k_share(cfg, lay)), cfg,
                      ranks)  # type: ignore[arg-type]
        got[r] = (lay, qkv_TQ, x_TD @ v["qkv"].T)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(P)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(got) == list(range(P))
    assert [k_share(cfg, got[r][0]) for r in range(P)] == [1.0, 0.0, 1.0, 0.0]  # KV head 0 on ranks 0-1, 1 on 2-3
    d = cfg.head_dim
    for lay, qkv_TQ, raw_TQ in got.values():
        Q, K = len(lay.q_heads) * d, len(lay.kv_heads) * d
        torch.testing.assert_close(qkv_TQ[:, :Q], whole["q"][:, lay.q_heads.start * d: lay.q_heads.stop * d],
                                   rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(qkv_TQ[:, Q: Q + K], whole["k"][:, lay.kv_heads.start * d: lay.kv_heads.stop * d],
                                   rtol=1e-6, atol=1e-6)
        assert torch.equal(qkv_TQ[:, Q + K:], raw_TQ[:, Q + K:])  # v untouched


# ---------------------------------------------------------------------------------------------------------------
# Parity with transformers in every layout, and across live switches
# ---------------------------------------------------------------------------------------------------------------

# (checkpoint, P, start mode); each engine serves in its start layout, then the other after a switch
ENGINES = [("olmoe", 1, "tp"), ("olmoe_gqa", 1, "ep"), ("olmoe", 2, "ep"), ("olmoe_gqa", 2, "tp"),
           ("olmoe", 4, "tp"), ("olmoe_gqa", 4, "tp")]
# the engines the switch stress runs on (the others differ from these in the math only, which a switch moves alike)
STRESSED = {("olmoe", 2), ("olmoe_gqa", 4)}


@pytest.fixture(scope="module", params=ENGINES, ids=[f"{n}-P{p}-{m}" for n, p, m in ENGINES])
def engine(request: pytest.FixtureRequest, olmoe: Callable[[str], str]) -> Iterator[tuple[str, int, LLM]]:
    name, P, mode = request.param
    yield from serve(olmoe(name), P, mode, ENGINE_KW)


def test_greedy_equals_transformers_in_both_layouts(engine: tuple[str, int, LLM]) -> None:
    """A batch of prompts in the start layout, then in the other after a switch, then back: transformers' greedy
    tokens."""
    path, _, llm = engine
    parity_across_switch(llm, path, PROMPTS, N_OUT)


def test_live_switches_change_no_token(engine: tuple[str, int, LLM]) -> None:
    """Arrivals, aborts, sampled n = 2 and greedy requests under a switch at many steps: the outputs of the run
    without switches (greedy: transformers'), aborted ones a prefix, and every KV page free afterwards."""
    path, P, llm = engine
    if (os.path.basename(path), P) not in STRESSED:
        pytest.skip("the same switch as a stressed engine's (see STRESSED)")
    switch_stress(llm, path, stress_jobs(PROMPTS, aborted_tokens=9))


def test_weight_update_from_disk_in_both_layouts(engine: tuple[str, int, LLM], olmoe: Callable[[str], str]) -> None:
    """The routed experts of each output token are those of every layer (top-k ids below num_experts). An update
    from disk rewrites every view the specs cut, both layouts' (the q/k norms' head shards too): the next tokens
    are the new checkpoint's in EP and, after a switch, in TP; updating back restores the first's."""
    path, P, llm = engine
    if (os.path.basename(path), P) != ("olmoe", 2):
        pytest.skip("one engine updates (P = 2: both layouts cut the q/k norms differently)")
    prompts = PROMPTS[2:4]
    out = llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=4, return_routed_experts=True))
    assert_routed(out[0].outputs[0].routed_experts, (4, 2, 2), 8)  # tokens, layers, top-k
    start = llm.mode
    try:
        assert llm.update_weights_from_disk(olmoe("olmoe_b")).done
        for mode in ("ep", "tp"):
            if llm.mode != mode:
                assert llm.switch_mode(mode).done
            assert greedy_outputs(llm, prompts, N_OUT) == [hf_greedy(olmoe("olmoe_b"), p, N_OUT) for p in prompts]
    finally:
        assert llm.update_weights_from_disk(path).done
        if llm.mode != start:
            assert llm.switch_mode(start).done
    assert greedy_outputs(llm, prompts, N_OUT) == [hf_greedy(path, tuple(p), N_OUT) for p in prompts]
    assert_kv_free(llm)


# ---------------------------------------------------------------------------------------------------------------
# The preset
# ---------------------------------------------------------------------------------------------------------------

def test_preset_parses_with_its_published_shapes() -> None:
    """olmoe-1b-7b: 16 layers of 64 experts of 1024 (top-8, raw softmax weights), 16 heads of 128 (MHA), both
    layouts at P = 1, 2, 4, 8 with every view's shape whole."""
    cfg = model_config(PRESETS["olmoe-1b-7b"])
    assert family_of(cfg).name == "olmoe"
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.num_experts,
            cfg.top_k, cfg.moe_intermediate_size, cfg.norm_topk_prob, cfg.vocab_size) == (
        16, 2048, 16, 16, 128, 64, 8, 1024, False, 50304)
    assert family_of(cfg).floor_terms(cfg, Layout(cfg, "tp", 0, 2)).moe_layers == 16  # GQA's terms
    cut = model_config(PRESETS["olmoe-1b-7b"], num_layers=2)
    for P in (1, 2, 4, 8):
        check_shapes(cut, P)
        for mode in ("tp", "ep"):
            specs = family_of(cut).weight_specs(cut, Layout(cut, mode, P - 1, P), 2)
            assert all(all(n > 0 for n in s.shape) for s in specs)
            assert sum(1 for s in specs if s.slot is not None) == 2 * 2  # w13 and w2 in each layer's slot


def test_preset_starts_on_the_cpu() -> None:
    """--load-format dummy --num-layers 2 (bfloat16: about 2.4 GB of experts in the two layers' and the spare
    slot, 0.4 GB of vocabulary): starts with random weights and generates."""
    with LLM(model="olmoe-1b-7b", load_format="dummy", num_layers=2, device="cpu", dtype="bfloat16",
             max_model_len=64, max_total_tokens=256, max_num_batched_tokens=64, max_running_requests=4) as llm:
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0.0))
        assert len(out[0].outputs[0].token_ids) == 2
        assert llm.engine.model_config.family == "olmoe"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["olmoe_d16", "olmoe_gqa_d16"])
def test_greedy_equals_transformers_on_the_gpu(olmoe: Callable[[str], str], name: str) -> None:
    """On the GPU in float32: decode graphs and step pieces (the
    whole-projection q/k norms through torch ops, the paged attention kernel between the pieces) give transformers'
    greedy tokens, in both layouts across a switch; so do eager steps, and graphs with every step resolved first."""
    gpu_parity(olmoe(name), PROMPTS, N_OUT, ENGINE_KW)
