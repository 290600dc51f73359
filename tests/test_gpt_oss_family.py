"""The GPT-OSS family served end to end on the CPU (float32): config.json parsed into the engine's ModelConfig
(sliding layers, the clamped SwiGLU, YaRN in `extra`), the checkpoint names transformers writes (fused experts with
gate and up interleaved, their biases, the sinks), and greedy tokens identical to transformers' own
GptOssForCausalLM for P = 1, 2, 4 in TP and EP, across live switches with arrivals, aborts and n > 1, with no KV page
leaked; weight updates (a few tensors by name, a whole checkpoint from disk); MXFP4's dequantization.

Checkpoints (written here by transformers' class, `_reinit_`'s std 0.3 weights, so every bias and sink is random):
  gpt_oss    3 layers (sliding, full, sliding) with a 6-token window, shorter than every prompt but the first plus
             its outputs (so the window changes tokens); 4 heads, 2 KV heads (replicated in TP at P = 4), 8 experts
             top-2, swiglu_limit 2 (the clamps bite), YaRN (factor 4 over 128 positions, truncate false)
  gpt_oss_b  other weights of gpt_oss's shapes (a weight update from disk)
Every engine runs prompts crossing 4-token pages with a 16-token step budget, so prompt chunks and decodes share
steps.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from typing import Any

import family_cases
import pytest
import torch
from conftest import VOCAB
from family_cases import (
    ENGINE_KW,
    assert_kv_free,
    assert_routed,
    hf_greedy,
    hf_model,
    parity_across_switch,
    random_prompts,
    serve,
    stress_jobs,
    switch_stress,
    write_hf_checkpoint,
)
from family_cases import hf_config as _config

from moebius import LLM, SamplingParams
from moebius.config import ConfigError, KVSpec
from moebius.models.registry import FAMILIES, family_of, model_config

# (test_gpt_oss_mxfp4.py imports ENGINE_KW, N_OUT, PROMPTS, _config, assert_kv_free, greedy_outputs, hf_greedy and
# write_gpt_oss_checkpoint from here)
N_OUT = 10
WINDOW = 6
PROMPTS: list[list[int]] = random_prompts(7, (1, 5, 9, 17, 23))
CONFIG: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=WINDOW,
    max_position_embeddings=512, swiglu_limit=2.0, tie_word_embeddings=False, rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                     "original_max_position_embeddings": 128, "rope_theta": 10000.0},
)


def write_gpt_oss_checkpoint(path: str, overrides: dict[str, Any] | None = None, *, seed: int = 0) -> str:
    """Save a random GptOssForCausalLM with save_pretrained (no EOS: runs are compared at full length)."""
    return write_hf_checkpoint(path, "GptOssForCausalLM", {**CONFIG, **(overrides or {})}, seed)


MAKERS: dict[str, Callable[[str], str]] = {
    "gpt_oss": write_gpt_oss_checkpoint,
    "gpt_oss_b": functools.partial(write_gpt_oss_checkpoint, seed=3),
}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], str]:
    root = tmp_path_factory.mktemp("gpt_oss")
    paths: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in paths:
            paths[name] = MAKERS[name](str(root / name))
        return paths[name]

    return get


def greedy_outputs(llm: LLM, prompts: list[list[int]], n: int = N_OUT) -> list[list[int]]:
    """family_cases.greedy_outputs, N_OUT tokens unless told."""
    return family_cases.greedy_outputs(llm, prompts, n)


# ---------------------------------------------------------------------------------------------------------------
# Config, checkpoint names, rope
# ---------------------------------------------------------------------------------------------------------------

def test_config_and_checkpoint_names(ckpt: Callable[[str], str]) -> None:
    """The family, GQA's KV spec, the layer types and window, the activation's constants; every tensor
    transformers saved is one the family reads (fused experts and biases under their own names), and no other."""
    path = ckpt("gpt_oss")
    hf = _config(path)
    cfg = model_config(hf)
    assert family_of(cfg) is FAMILIES["gpt_oss"] and cfg.family == "gpt_oss"
    assert cfg.kv_spec == KVSpec(parts=2, heads=2, dim=16)
    assert (cfg.num_experts, cfg.top_k, cfg.moe_intermediate_size) == (8, 2, 32)
    assert all(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    ext = cfg.extra
    assert cfg.layer_windows == (WINDOW, None, WINDOW)
    assert [(g.layers, g.window) for g in cfg.kv_groups] == [((1,), None), ((0, 2), WINDOW)]
    assert (ext.swiglu_alpha, ext.swiglu_limit) == (1.702, 2.0)
    assert ext.yarn.factor == 4.0 and not ext.yarn.truncate
    assert hash(cfg) == hash(model_config(hf))  # a cache key
    assert model_config(hf, 1).extra == ext and model_config(hf, 1).layer_windows == (WINDOW,)  # a cut's layers
    from safetensors import safe_open

    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        saved = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118  (safe_open has no iter)
    assert family_of(cfg).checkpoint_tensors(cfg) == saved


def test_rope_table_is_transformers_yarn(ckpt: Callable[[str], str]) -> None:
    """The region "rope" holds transformers' cos and sin (YaRN's frequencies, times its attention factor) over the
    whole head, rotated in halves (GPT-OSS's _apply_rotary_emb is rotate-half)."""
    path = ckpt("gpt_oss")
    cfg = model_config(_config(path))
    table = family_of(cfg).rope_table(cfg, torch.device("cpu"))
    rotary = hf_model(path).model.rotary_emb
    assert rotary.attention_scaling > 1  # YaRN's factor scales cos and sin
    pos = torch.arange(cfg.max_position_embeddings)[None]
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), pos)
    torch.testing.assert_close(table, torch.cat([cos[0], sin[0]], dim=-1), rtol=0, atol=1e-6)


def test_unsupported_settings_are_refused_by_name(ckpt: Callable[[str], str]) -> None:
    """A missing shape key; bad layer types. (An MXFP4 config parses to the same ModelConfig: the packed experts are
    the loader's, tests/test_gpt_oss_mxfp4.py.)"""
    hf = _config(ckpt("gpt_oss"))
    with pytest.raises(ConfigError, match="config.json's num_local_experts must be an integer"):
        model_config({k: v for k, v in hf.items() if k != "num_local_experts"})
    assert model_config({**hf, "quantization_config": {"quant_method": "mxfp4"}}) == model_config(hf)
    with pytest.raises(ConfigError, match="layer_types must be 3 of"):
        model_config({**hf, "layer_types": ["sliding_attention", "full_attention"]})


@pytest.mark.parametrize("window", [None, 5])
def test_paged_attention_with_sinks_and_a_window_is_transformers(window: int | None) -> None:
    """The torch reference's sinks and window (layers/attention.py) on a step mixing decodes and prompt chunks after
    cached tokens, pages shuffled: every token's output is transformers' eager_attention_forward (GPT-OSS's) over
    its own sequence with the sliding mask (key > query - window)."""
    from types import SimpleNamespace

    from attention_cases import paged_metadata
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    from moebius.layers.attention import paged_attention_ref

    torch.manual_seed(0)
    bs, kvh, heads, d = 4, 2, 4, 16
    q_lens, ctx = [1, 11, 1, 5, 3], [14, 20, 3, 9, 3]
    meta = paged_metadata(q_lens, ctx, bs, 64, "cpu")
    cache = torch.randn(64, 2, bs, kvh, d)
    q = torch.randn(sum(q_lens), heads, d)
    sinks = torch.randn(heads) * 2
    out = paged_attention_ref(q, cache, meta, d ** -0.5, sinks=sinks, window=window)
    module = SimpleNamespace(num_key_value_groups=heads // kvh, sinks=sinks, training=False)
    for b, (n, L) in enumerate(zip(q_lens, ctx, strict=True)):
        j = torch.arange(L)
        kv = cache[meta.block_tables[b, j // bs].long(), :, j % bs]  # [L, 2, kvh, d]
        rows = slice(int(meta.query_start_loc[b]), int(meta.query_start_loc[b + 1]))
        qpos = torch.arange(L - n, L)
        allowed = j[None, :] <= qpos[:, None]
        if window is not None:
            allowed &= j[None, :] > qpos[:, None] - window
        mask = torch.zeros(n, L).masked_fill(~allowed, float("-inf"))[None, None]
        want, _ = eager_attention_forward(module, q[rows].transpose(0, 1)[None], kv[:, 0].transpose(0, 1)[None],
                                          kv[:, 1].transpose(0, 1)[None], mask, d ** -0.5)
        torch.testing.assert_close(out[rows], want[0], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# Parity with transformers in every layout, and across live switches
# ---------------------------------------------------------------------------------------------------------------

# (P, start mode); each engine serves in its start layout, then the other after a switch: P in {1, 2, 4} x {TP, EP}
ENGINES = [(1, "tp"), (2, "ep"), (4, "tp")]
STRESSED = {2, 4}  # the switch stress's engines


@pytest.fixture(scope="module", params=ENGINES, ids=[f"P{p}-{m}" for p, m in ENGINES])
def engine(request: pytest.FixtureRequest, ckpt: Callable[[str], str]) -> Iterator[tuple[str, int, LLM]]:
    P, mode = request.param
    yield from serve(ckpt("gpt_oss"), P, mode, ENGINE_KW)


@pytest.mark.parametrize("feature", ["window", "sinks", "clamps"])
def test_each_feature_changes_the_oracles_tokens(ckpt: Callable[[str], str], feature: str) -> None:
    """The checkpoint exercises what the parity tests check: transformers' greedy tokens differ without the sliding
    window (every layer full), without the sinks (-inf logits) or without the SwiGLU clamps (no limit)."""
    from transformers import AutoModelForCausalLM

    path = ckpt("gpt_oss")
    model = family_cases.as_configured(
        AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval())
    with torch.no_grad():
        for layer in model.model.layers:
            if feature == "window":
                layer.self_attn.sliding_window = None
            elif feature == "sinks":
                layer.self_attn.sinks.fill_(float("-inf"))
            else:
                layer.mlp.experts.limit = float("inf")
        if feature == "window":
            model.config.layer_types = ["full_attention"] * model.config.num_hidden_layers
        seq = list(PROMPTS[4])
        for _ in range(N_OUT):
            seq.append(int(model(input_ids=torch.tensor([seq]), use_cache=False).logits[0, -1].argmax()))
    assert seq[len(PROMPTS[4]):] != hf_greedy(path, tuple(PROMPTS[4]), N_OUT)


def test_greedy_equals_transformers_in_both_layouts(engine: tuple[str, int, LLM]) -> None:
    """A batch of prompts in the start layout, then in the other after a switch: transformers' greedy tokens."""
    path, _, llm = engine
    parity_across_switch(llm, path, PROMPTS, N_OUT)


def test_live_switches_change_no_token(engine: tuple[str, int, LLM]) -> None:
    """Arrivals, aborts, sampled n = 2 and greedy requests under a switch at many steps: the outputs of the run
    without switches (greedy: transformers'), aborted ones a prefix, and every KV page free afterwards."""
    path, P, llm = engine
    if P not in STRESSED:
        pytest.skip("the same switch as a stressed engine's (see STRESSED)")
    switch_stress(llm, path, stress_jobs(PROMPTS, aborted_tokens=9))


def test_weight_updates_routed_experts_and_prefix_cache(ckpt: Callable[[str], str], tmp_path: Any) -> None:
    """At P = 2: an update of a few tensors by name (layer 1's fused gate_up_proj; layer 0's expert biases, sinks
    and o_proj bias; layer 2's router bias, from the other checkpoint) changes those only: the tokens of
    transformers' model with the same tensors replaced, in EP and after a switch to TP. Then an update from disk
    rewrites every view the specs cut, those of the other layout too (the biases' regions, the experts' slot the
    switch moves): the other checkpoint's tokens in TP and EP. The routed experts of each output token are those
    of every layer; a prompt asked again takes its whole pages from the prefix cache (keys before a window
    included: they stay in their pages) and gives the same tokens."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    a, b = ckpt("gpt_oss"), ckpt("gpt_oss_b")
    names = ["model.layers.1.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.gate_up_proj_bias",
             "model.layers.0.mlp.experts.down_proj_bias", "model.layers.0.self_attn.sinks",
             "model.layers.0.self_attn.o_proj.bias", "model.layers.2.mlp.router.bias"]
    some = {n: t for n, t in load_file(os.path.join(b, "model.safetensors")).items() if n in names}
    model = AutoModelForCausalLM.from_pretrained(a, dtype=torch.float32)
    model.load_state_dict(some, strict=False)
    mixed = str(tmp_path / "mixed")
    model.save_pretrained(mixed)
    prompts = PROMPTS[2:4]
    want = [hf_greedy(mixed, tuple(p), N_OUT) for p in prompts]
    assert want != [hf_greedy(a, tuple(p), N_OUT) for p in prompts]  # the update changes tokens
    with LLM(model=a, num_ranks=2, mode="ep", enable_return_routed_experts=True, **ENGINE_KW) as llm:
        assert llm.update_weights(list(some.items())).done
        assert greedy_outputs(llm, prompts) == want
        assert llm.switch_mode("tp").done
        assert greedy_outputs(llm, prompts) == want
        assert llm.update_weights_from_disk(b).done
        want = [hf_greedy(b, tuple(p), N_OUT) for p in prompts]
        assert greedy_outputs(llm, prompts) == want
        assert llm.switch_mode("ep").done
        assert greedy_outputs(llm, prompts) == want
        params = SamplingParams(temperature=0.0, max_tokens=4, return_routed_experts=True)
        first, again = (llm.generate([PROMPTS[4]], params)[0] for _ in range(2))
        assert first.outputs[0].token_ids == again.outputs[0].token_ids == hf_greedy(b, tuple(PROMPTS[4]), 4)
        assert first.num_cached_tokens == 0 and again.num_cached_tokens == 20
        assert_routed(first.outputs[0].routed_experts, (4, 3, 2), 8)  # tokens, layers, top-k
        assert_kv_free(llm)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_dequantization_is_transformers(dtype: torch.dtype) -> None:
    """Random MXFP4 blocks and scales (every code, exponents around the bias) dequantize to transformers' own
    `convert_moe_packed_tensors`, bit for bit, in the float checkpoint's layout."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from moebius.models.gpt_oss.mxfp4 import dequantize

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 2, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(127 - 20, 127 + 8, (3, 10, 2), generator=g, dtype=torch.uint8)
    want = convert_moe_packed_tensors(blocks, scales, dtype=dtype)
    got = dequantize(blocks, scales, dtype)
    assert got.shape == want.shape == (3, 64, 10) and got.dtype == dtype
    assert torch.equal(got, want)


def test_the_graph_safe_expert_loop_takes_the_biases_and_the_clamped_activation() -> None:
    """kernels/moe.experts_dense (the float32 GPU path: every expert on every token, no host sync, so decode graphs
    capture it) gives GPT-OSS's experts as the torch reference does, with and without the down bias (TP ranks but
    one leave it out)."""
    from moebius.kernels.moe import experts_dense
    from moebius.layers.moe import ClampedSwiGLU, experts_ref

    g = torch.Generator().manual_seed(0)
    T, K, D, I, E = 9, 2, 16, 8, 4
    act = ClampedSwiGLU(alpha=1.702, limit=1.0)
    x = torch.randn(T, D, generator=g)
    ids = torch.stack([torch.randperm(8, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g).softmax(-1)
    w13, w2 = torch.randn(E, 2 * I, D, generator=g), torch.randn(E, D, I, generator=g)
    b13 = torch.randn(E, 2 * I, generator=g)
    for b2 in (torch.randn(E, D, generator=g), None):
        want = experts_ref(x, w, ids, w13, w2, 4, act=act, b13_EF=b13, b2_ED=b2)
        torch.testing.assert_close(experts_dense(x, w, ids, w13, w2, 4, act=act, b13_EF=b13, b2_ED=b2), want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_greedy_equals_transformers_on_the_gpu(ckpt: Callable[[str], str]) -> None:
    """On the GPU in float32 (passed on an H200 at f5344d7): decode graphs and step pieces (the
    sliding layers' own page tables in the static buffers, the paged kernel with the window and the sinks between
    the pieces, the graph-safe expert loop with the biases and the clamped activation) give transformers' greedy
    tokens, in both layouts across a switch; so do eager steps, and graphs with every step resolved first."""
    family_cases.gpu_parity(ckpt("gpt_oss"), PROMPTS, N_OUT, ENGINE_KW)


def test_the_rank_counts_each_sequences_window_for_the_floor(ckpt: Callable[[str], str]) -> None:
    """The work a rank reports for a step (what `bench throughput` prices, `engine.last_work`): a 17-token prompt's
    prefill reads its 17 keys in every layer and computes, in the sliding layers, each query's min(q + 1, 6)
    pairs; a decode after it reads the 5 cached keys its window reaches, and itself."""
    from moebius.link.messages import attended_pairs

    with LLM(model=ckpt("gpt_oss"), **dict(ENGINE_KW, max_num_batched_tokens=32)) as llm:
        llm.add_request(PROMPTS[3], SamplingParams(temperature=0.0, max_tokens=3))
        llm.step()
        w = llm.engine.last_work
        assert (w.tokens, w.kv_tokens, w.attended) == (17, 17, attended_pairs(0, 17))
        assert (w.window_kv_tokens, w.window_attended) == (17, attended_pairs(0, 17, WINDOW)) != (17, w.attended)
        llm.step()
        w = llm.engine.last_work
        assert (w.tokens, w.kv_tokens, w.window_kv_tokens, w.window_attended) == (1, 18, WINDOW, WINDOW)
        while llm.has_unfinished():
            llm.step()
