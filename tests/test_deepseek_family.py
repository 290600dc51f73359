"""The DeepSeek-V2 / V3 family served end to end on the CPU (float32): config.json parsed into the engine's
ModelConfig (MLA's latent as the KV spec, DeepSeek's dense-layer rule), the checkpoint names transformers writes,
and greedy tokens identical to transformers' own DeepseekV3ForCausalLM / DeepseekV2ForCausalLM for P = 1, 2 (and 4
for V3) in TP and EP, across live switches with arrivals, aborts and n > 1, with no KV page leaked; a TP target that
cannot hold the replicated latent cache refused; a weight update and routed experts. On a GPU (float32): decode
graphs, step pieces around the latent kernels, eager steps: transformers' tokens.

Checkpoints (tests/conftest.py, written by transformers' classes, std 0.3 weights):
  deepseek_v3  q-LoRA, sigmoid group-limited routing with e_score_correction_bias, one shared expert, layer 0
               dense (first_k_dense_replace = 1), YaRN rope scaling (mscale_all_dim), routed_scaling_factor 2.5
  deepseek_v2  softmax group-limited greedy routing, q projected directly (q_lora_rank = null), two shared experts
  deepseek_v3_bias  deepseek_v3 with attention_bias (o_proj's bias added by one TP shard)
  deepseek_v2_lora  deepseek_v2 with q-LoRA and plain greedy (ungrouped) routing
  deepseek_v3_b  other weights of deepseek_v3's shapes (a weight update from disk)
Every engine runs prompts crossing 4-token pages with a 16-token step budget, so prompt chunks (expanded MLA) and
decodes (absorbed) share steps.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from conftest import Checkpoints
from family_cases import (
    BLOCK,
    ENGINE_KW,
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
)
from family_cases import hf_config as _config

from moebius import LLM, SamplingParams
from moebius.config import ConfigError, KVSpec
from moebius.models.registry import FAMILIES, family_of, model_config

N_OUT = 10
PROMPTS: list[list[int]] = random_prompts(7, (1, 5, 9, 17, 23))


# ---------------------------------------------------------------------------------------------------------------
# Config and checkpoint names
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v2"])
def test_config_and_checkpoint_names(ckpt: Checkpoints, name: str) -> None:
    """The family, the latent KV spec (one part of one head of kv_lora_rank + qk_rope_head_dim values), the dense
    layers by first_k_dense_replace; every tensor transformers saved is one the family reads, and no other."""
    path = ckpt(name)
    hf = _config(path)
    cfg = model_config(hf)
    assert family_of(cfg) is FAMILIES["deepseek"] and cfg.family == "deepseek"
    assert cfg.kv_spec == KVSpec(parts=1, heads=1, dim=32 + 8)
    assert [cfg.is_moe_layer(i) for i in range(cfg.num_layers)] == [
        i >= hf["first_k_dense_replace"] for i in range(hf["num_hidden_layers"])]
    assert (cfg.num_experts, cfg.top_k, cfg.moe_intermediate_size) == (8, 2, 32)
    assert hash(cfg) == hash(model_config(hf))  # a cache key
    from safetensors import safe_open

    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        saved = set(f.keys())
    known = family_of(cfg).checkpoint_tensors(cfg)
    fused = {n for n in known if n.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))}
    assert set(known) - fused == saved
    # a cut keeps the dense-layer rule of the whole model (a cut engine compares equal to its full checkpoint)
    assert model_config(hf, 1).mlp_only_layers == cfg.mlp_only_layers


def test_unsupported_settings_are_refused_by_name(ckpt: Checkpoints) -> None:
    """A config without a DeepSeek key, naming it."""
    hf = _config(ckpt("deepseek_v3"))
    with pytest.raises(ConfigError, match="config.json has no n_routed_experts"):
        model_config({k: v for k, v in hf.items() if k != "n_routed_experts"})


# ---------------------------------------------------------------------------------------------------------------
# Parity with transformers in every layout, and across live switches
# ---------------------------------------------------------------------------------------------------------------

# (checkpoint, P, start mode); each engine serves in its start layout, then the other after a switch
ENGINES = [("deepseek_v3", 1, "tp"), ("deepseek_v2", 1, "ep"), ("deepseek_v3", 2, "ep"), ("deepseek_v2", 2, "tp"),
           ("deepseek_v3", 4, "ep"), ("deepseek_v3_bias", 2, "tp"), ("deepseek_v2_lora", 1, "ep")]
# the engines the switch stress runs on (the others differ from these in the math only, which a switch moves alike)
STRESSED = {("deepseek_v3", 1), ("deepseek_v3", 2), ("deepseek_v2", 2), ("deepseek_v3", 4)}


@pytest.fixture(scope="module", params=ENGINES, ids=[f"{n}-P{p}-{m}" for n, p, m in ENGINES])
def engine(request: pytest.FixtureRequest, ckpt: Checkpoints) -> Iterator[tuple[str, int, LLM]]:
    name, P, mode = request.param
    yield from serve(ckpt(name), P, mode, ENGINE_KW)


def _name(path: str) -> str:
    return os.path.basename(path)


def test_greedy_equals_transformers_in_both_layouts(engine: tuple[str, int, LLM]) -> None:
    """A batch of prompts in the start layout, then in the other after a switch: transformers' greedy tokens."""
    path, _, llm = engine
    parity_across_switch(llm, path, PROMPTS, N_OUT)


def test_live_switches_change_no_token(engine: tuple[str, int, LLM]) -> None:
    """Arrivals, aborts, sampled n = 2 and greedy requests under a switch at many steps: the outputs of the run
    without switches (greedy: transformers'), aborted ones a prefix, and every KV page free afterwards."""
    path, P, llm = engine
    if (_name(path), P) not in STRESSED:
        pytest.skip("the same switch as a stressed engine's (see STRESSED)")
    switch_stress(llm, path, stress_jobs(PROMPTS, aborted_tokens=9))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v2"])
def test_greedy_equals_transformers_on_the_gpu(ckpt: Checkpoints, name: str) -> None:
    """On the GPU in float32: decode graphs and step pieces (the latent kernels between them) give transformers'
    greedy tokens, in both layouts across a switch; so do eager steps, and graphs with every step resolved first."""
    gpu_parity(ckpt(name), PROMPTS, N_OUT, ENGINE_KW)


def test_the_latent_decode_launch_asks_for_programs_enough(ckpt: Checkpoints) -> None:
    """MLA's attention geometry: a decoding sequence's programs are its head blocks, and where the Triton kernels run
    a decode launch's keys are split up to kernels/mla.DECODE_MIN_PROGRAMS programs (one a sequence left most SMs
    idle: benchmarks/results/h200-p1-decode-profiles.json)."""
    from moebius.kernels import triton_available

    with LLM(model=ckpt("deepseek_v3"), **ENGINE_KW) as llm:
        g = llm.engine.ranks.rank.runner.geometry
        if triton_available():
            from moebius.kernels.mla import DECODE_MIN_PROGRAMS, HEAD_BLOCK

            assert (g.min_programs, g.split_units) == (DECODE_MIN_PROGRAMS, -(-g.heads // HEAD_BLOCK))
        else:
            assert g.min_programs == 0


def test_a_slot_of_dense_layers_only_holds_no_experts(ckpt: Checkpoints) -> None:
    """The dense first layer (first_k_dense_replace = 1) sits in slot 0 in TP and slot 1 in EP: slot 0 holds only
    it, so the buffer gives it KV pages and no expert bytes (`layout.expert_slots`); every other slot holds a MoE
    layer in some layout and its experts. The tokens stay transformers' (the KV after a slot's experts, or at its
    start)."""
    with LLM(model=ckpt("deepseek_v3"), **ENGINE_KW) as llm:
        rank = llm.engine.ranks.rank
        lay = rank.modes["tp"].layout
        cfg, expert = lay.cfg, lay.expert_bytes(4)
        assert cfg.mlp_only_layers == (0,) and rank.umm.plan.num_slots == cfg.num_layers + 1
        slots = [r.nbytes for r in rank.umm.plan.slots]
        assert all(n - slots[0] >= expert for n in slots[1:]), (slots, expert)
        assert greedy_outputs(llm, PROMPTS[:2], 4) == [hf_greedy(ckpt("deepseek_v3"), tuple(p), 4) for p in PROMPTS[:2]]


def test_weight_update_and_routed_experts(ckpt: Checkpoints) -> None:
    """An update from disk rewrites every view the specs cut (the next tokens are the new checkpoint's), and the
    routed experts of each output token are those of the MoE layers (top-k ids, each below n_routed_experts)."""
    llm = LLM(model=ckpt("deepseek_v3"), enable_return_routed_experts=True, **ENGINE_KW)
    try:
        prompt = PROMPTS[3]
        out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4, return_routed_experts=True))
        sample = out[0].outputs[0]
        assert list(sample.token_ids) == hf_greedy(ckpt("deepseek_v3"), tuple(prompt), 4)
        assert_routed(sample.routed_experts, (4, 2, 2), 8)  # tokens, MoE layers, top-k
        assert llm.update_weights_from_disk(ckpt("deepseek_v3_b")).done
        assert greedy_outputs(llm, [prompt], N_OUT) == [hf_greedy(ckpt("deepseek_v3_b"), tuple(prompt), N_OUT)]
        assert_kv_free(llm)
    finally:
        llm.close()


def test_a_tp_target_that_cannot_hold_the_replicated_latents_is_refused(ckpt: Checkpoints) -> None:
    """EP holds each request's latent once, TP every request's on every rank: with 15 usable pages a rank, four
    requests of distinct prompts (about 5 pages each, 2 a rank in EP) do not fit in TP; the switch is refused naming
    the pages, and serving goes on in EP to transformers' tokens."""
    path = ckpt("deepseek_v3")
    llm = LLM(model=path, num_ranks=2, mode="ep", **{**ENGINE_KW, "max_total_tokens": 64})
    try:
        prompts = [PROMPTS[3], PROMPTS[4], PROMPTS[2] + [1], PROMPTS[3][::-1]]
        ids = [llm.add_request(p, SamplingParams(temperature=0.0, max_tokens=8)) for p in prompts]
        for _ in range(3):
            llm.step()
        out = llm.switch_mode("tp")
        assert not out.done and "tp layout cannot hold the live KV: needs 21 pages on a rank, has 15" in out.reason
        last: dict[str, Any] = {}
        while llm.has_unfinished():
            for o in llm.step():
                last[o.request_id] = o
        assert llm.mode == "ep"
        assert [list(last[i].outputs[0].token_ids) for i in ids] == [hf_greedy(path, tuple(p), 8) for p in prompts]
        assert_kv_free(llm)
    finally:
        llm.close()


def test_the_prefix_cache_and_the_server_serve_the_family(ckpt: Checkpoints, tmp_path: Any) -> None:
    """A prompt asked again takes its whole pages of latents from the prefix cache and gives the same tokens;
    `moebius serve` on the checkpoint answers /generate and /v1/completions with transformers' greedy tokens."""
    pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from test_serve import Server

    path = ckpt("deepseek_v3")
    prompt = PROMPTS[-1]  # 23 tokens: five whole 4-token pages to reuse
    want = hf_greedy(path, tuple(prompt), N_OUT)
    llm = LLM(model=path, **ENGINE_KW)
    try:
        first, again = (llm.generate([prompt], SamplingParams(max_tokens=N_OUT, temperature=0.0))[0]
                        for _ in range(2))
        assert first.outputs[0].token_ids == again.outputs[0].token_ids == want
        assert first.num_cached_tokens == 0 and again.num_cached_tokens == 20
    finally:
        llm.close()
    server = Server(tmp_path, "--model", path, "--dtype", "float32", "--block-size", str(BLOCK),
                    "--max-total-tokens", "512")
    try:
        r = server.post("/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": N_OUT,
                                                                               "temperature": 0}})
        assert r.status_code == 200 and r.json()["output_ids"] == want, r.text
        r = server.post("/v1/completions", {"model": server.get("/v1/models").json()["data"][0]["id"],
                                            "prompt": prompt, "max_tokens": N_OUT, "temperature": 0,
                                            "return_token_ids": True})
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == want, r.text
    finally:
        assert server.close() == 0, server.tail()
