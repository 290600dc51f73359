"""Multi-head latent attention (moebius/models/deepseek/mla.py) against transformers' DeepseekV3Attention and
DeepseekV2Attention on tiny random weights, float32 on the CPU: the same outputs (1e-5) for whole-sequence prefill,
two chunks, and prefill then decode through the paged latent cache; the absorbed and expanded forms agree; the
cache holds transformers' cached latent and rope key; a sum over head shards equals every head at once."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from moebius.config import ConfigError
from moebius.layers.attention import AttentionMetadata
from moebius.models.deepseek.mla import MLAConfig, MLAWeights, head_slice, mla_attention, rope_frequencies, rope_table

BASE: dict[str, Any] = dict(hidden_size=48, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
                            qk_nope_head_dim=8, qk_rope_head_dim=16, v_head_dim=12, max_position_embeddings=256,
                            rms_norm_eps=1e-6, vocab_size=32, num_hidden_layers=1)
# config.json-like dicts, as the checkpoints write them (legacy rope_scaling + rope_theta)
CASES: dict[str, dict[str, Any]] = {
    # q through q-LoRA; YaRN stretched 8x over an original context of 32 (the sequences below pass it), an
    # attention factor other than 1 (mscale != mscale_all_dim) and the softmax scale's mscale_all_dim
    "v3_lora_yarn": dict(BASE, model_type="deepseek_v3", q_lora_rank=24, rope_theta=100.0,
                         rope_scaling={"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32,
                                       "beta_fast": 4, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8}),
    # q projected directly, plain rope, the rope dims not interleaved (rotate-half)
    "v3_direct": dict(BASE, model_type="deepseek_v3", q_lora_rank=None, rope_theta=500.0, rope_interleave=False),
    # V2's complex rope, q-LoRA with biases (attention_bias), V2-Lite's YaRN (mscale = mscale_all_dim = 0.707)
    "v2": dict(BASE, model_type="deepseek_v2", q_lora_rank=24, attention_bias=True, rms_norm_eps=1e-5,
               max_position_embeddings=1280,  # = factor x original, as transformers expects
               rope_theta=10000.0, rope_scaling={"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 32,
                                                 "beta_fast": 32, "beta_slow": 1, "mscale": 0.707,
                                                 "mscale_all_dim": 0.707}),
}
LENS = (40, 29)  # two sequences, the first past YaRN's original context
BS = 4  # page size
# tokens each sequence brings in each step (0: not in the step); every token once
SCHEDULES: dict[str, list[list[int]]] = {
    "one_chunk": [[40, 29]],
    "two_chunks": [[23, 11], [17, 18]],
    "mixed": [[23, 28], [17, 1]],  # a chunk beside the other sequence's last token
    "decode": [[30, 20]] + [[1, 1]] * 9 + [[1, 0]],
}
TOL = dict(rtol=1e-5, atol=1e-5)  # float32, the same math in another order


def hf_modules(case: str) -> tuple[MLAConfig, torch.nn.Module, torch.nn.Module]:
    """Our config, transformers' attention module (random weights, norms near 1) and rotary embedding."""
    raw = dict(CASES[case])
    cfg = MLAConfig.from_hf(raw)
    if raw.pop("model_type") == "deepseek_v2":
        from transformers import DeepseekV2Config as Config
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Attention as Attention
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2RotaryEmbedding as Rotary
    else:
        from transformers import DeepseekV3Config as Config
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention as Attention
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding as Rotary
    hf = Config(**raw, attn_implementation="eager")
    torch.manual_seed(0)
    attn = Attention(hf, layer_idx=0).eval()
    with torch.no_grad():
        for name, p in attn.named_parameters():
            if "layernorm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.3 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * p.shape[1] ** -0.5)
    return cfg, attn, Rotary(hf)


def weights_of(attn: torch.nn.Module) -> MLAWeights:
    lora = attn.q_lora_rank is not None
    bias = lambda lin: None if lin.bias is None else lin.bias.detach()  # noqa: E731
    return MLAWeights(
        q_a_LD=attn.q_a_proj.weight.detach() if lora else None, q_a_bias=bias(attn.q_a_proj) if lora else None,
        q_a_norm=attn.q_a_layernorm.weight.detach() if lora else None,
        q_QL=(attn.q_b_proj if lora else attn.q_proj).weight.detach(),
        kv_a_AD=attn.kv_a_proj_with_mqa.weight.detach(), kv_a_bias=bias(attn.kv_a_proj_with_mqa),
        kv_a_norm=attn.kv_a_layernorm.weight.detach(), kv_b_UC=attn.kv_b_proj.weight.detach(),
        o_DO=attn.o_proj.weight.detach(), o_bias=bias(attn.o_proj))


def hf_forward(attn: torch.nn.Module, rotary: torch.nn.Module, x_SD: torch.Tensor, cache: Any = None
               ) -> torch.Tensor:
    """transformers' attention over one whole sequence, causal, positions 0..S-1."""
    S = x_SD.shape[0]
    mask = torch.full((S, S), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        pe = rotary(x_SD[None], torch.arange(S)[None])
        out, _ = attn(hidden_states=x_SD[None], attention_mask=mask, position_embeddings=pe, cache=cache)
    return out[0]


def page_tables(lens: tuple[int, ...], pages: int, seed: int = 1) -> torch.Tensor:
    """Shuffled distinct pages for each sequence's whole length (page 0, the padding page, never used)."""
    perm = torch.randperm(pages - 1, generator=torch.Generator().manual_seed(seed)) + 1
    need = [-(-n // BS) for n in lens]
    table = torch.zeros(len(lens), max(need), dtype=torch.int32)
    used = 0
    for i, n in enumerate(need):
        table[i, :n], used = perm[used: used + n].int(), used + n
    return table


def step_meta(table: torch.Tensor, starts: list[int], q_lens: list[int]) -> AttentionMetadata:
    """A step where sequence i (row i of `table`) holds starts[i] cached tokens and brings q_lens[i] new ones."""
    start, q_len = torch.tensor(starts), torch.tensor(q_lens)
    qsl = torch.cat([torch.zeros(1, dtype=torch.int64), q_len.cumsum(0)])
    seq = torch.repeat_interleave(torch.arange(len(q_lens)), q_len)
    qpos = torch.arange(int(qsl[-1])) - qsl[:-1][seq]
    positions = start[seq] + qpos
    slots = table[seq, positions // BS].long() * BS + positions % BS
    return AttentionMetadata(positions, slots, qsl, start + q_len, table, seq, qpos, max(q_lens),
                             int((start + q_len).max()), BS)


def run_schedule(cfg: MLAConfig, w: MLAWeights, xs: list[torch.Tensor], schedule: list[list[int]],
                 absorb: bool | None = None) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Every token's output through the paged cache, step by step (NaN where nothing was written), with the cache
    and the page tables."""
    pages = 48
    table = page_tables(tuple(x.shape[0] for x in xs), pages)
    cache = torch.full((pages, BS, cfg.cache_dim), float("nan"))
    rope = rope_table(cfg, cfg.max_position_embeddings)
    done, outs = [0] * len(xs), [[] for _ in xs]
    for step in schedule:
        seqs = [i for i, n in enumerate(step) if n]
        meta = step_meta(table[seqs], [done[i] for i in seqs], [step[i] for i in seqs])
        x = torch.cat([xs[i][done[i]: done[i] + step[i]] for i in seqs])
        y = mla_attention(x, w, cache, meta, cfg, rope, absorb=absorb)
        for i, part in zip(seqs, y.split([step[i] for i in seqs]), strict=True):
            outs[i].append(part)
            done[i] += step[i]
    assert done == [x.shape[0] for x in xs]
    return [torch.cat(o) for o in outs], cache, table


def inputs(cfg: MLAConfig) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return [torch.randn(n, cfg.hidden_size, generator=g) for n in LENS]


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("case", list(CASES))
def test_matches_transformers(case: str, schedule: str) -> None:
    """Every token's output (the last ones included) equals transformers' module run on the whole sequence, each
    sequence in the form the engine picks (absorbed for a decode, expanded for a chunk, apart in a mixed step)."""
    cfg, attn, rotary = hf_modules(case)
    xs = inputs(cfg)
    with torch.no_grad():
        got, _, _ = run_schedule(cfg, weights_of(attn), xs, SCHEDULES[schedule])
    for x, y in zip(xs, got, strict=True):
        torch.testing.assert_close(y, hf_forward(attn, rotary, x), **TOL)


@pytest.mark.parametrize("case", list(CASES))
def test_absorbed_equals_expanded(case: str) -> None:
    """Both forms on the same steps (chunks, a mixed step, decodes) give the same outputs."""
    cfg, attn, _ = hf_modules(case)
    xs, w = inputs(cfg), weights_of(attn)
    for schedule in ("mixed", "decode"):
        with torch.no_grad():
            a, _, _ = run_schedule(cfg, w, xs, SCHEDULES[schedule], absorb=True)
            e, _, _ = run_schedule(cfg, w, xs, SCHEDULES[schedule], absorb=False)
        for y_a, y_e in zip(a, e, strict=True):
            torch.testing.assert_close(y_a, y_e, **TOL)


@pytest.mark.parametrize("case", list(CASES))
def test_cache_entry_is_transformers_latent_and_rope_key(case: str) -> None:
    """A token's cache entry is the normalised latent and the roped rope key transformers caches (V2's complex rope
    keeps the rope dims in pairs: the entry holds them as halves [evens | odds], the same dot products)."""
    from transformers import DynamicCache

    cfg, attn, rotary = hf_modules(case)
    xs = inputs(cfg)
    with torch.no_grad():
        _, cache, table = run_schedule(cfg, weights_of(attn), xs, SCHEDULES["two_chunks"])
    for i, x in enumerate(xs):
        hf_cache = DynamicCache()
        hf_forward(attn, rotary, x, hf_cache)
        latent, k_rope = hf_cache.layers[0].keys[0, 0], hf_cache.layers[0].values[0, 0]
        if CASES[case]["model_type"] == "deepseek_v2":
            k_rope = torch.cat([k_rope[..., 0::2], k_rope[..., 1::2]], dim=-1)
        j = torch.arange(x.shape[0])
        entries = cache[table[i, j // BS].long(), j % BS]
        torch.testing.assert_close(entries, torch.cat([latent, k_rope], dim=-1), **TOL)


@pytest.mark.parametrize("case", ["v3_lora_yarn", "v2"])
def test_head_shards_sum_to_whole(case: str) -> None:
    """Two TP shards (heads [0, 2) and [2, 4), each with its own copy of the replicated latent cache; o_proj's bias
    on one shard only): their outputs summed (the all-reduce) equal every head's, in both forms."""
    cfg, attn, _ = hf_modules(case)
    xs, w = inputs(cfg), weights_of(attn)
    shards = [head_slice(w, cfg, 0, 2), head_slice(w, cfg, 2, 4, with_bias=False)]
    assert shards[0].q_QL.shape[0] * 2 == w.q_QL.shape[0]
    for schedule in ("two_chunks", "decode"):
        with torch.no_grad():
            whole, _, _ = run_schedule(cfg, w, xs, SCHEDULES[schedule])
            parts = [run_schedule(cfg, s, xs, SCHEDULES[schedule])[0] for s in shards]
        for i, y in enumerate(whole):
            torch.testing.assert_close(parts[0][i] + parts[1][i], y, **TOL)


@pytest.mark.parametrize("case", list(CASES))
def test_config_matches_transformers(case: str) -> None:
    """The parsed fields, the softmax scale (attn.scaling), the rope frequencies and attention factor."""
    cfg, attn, rotary = hf_modules(case)
    raw = CASES[case]
    assert (cfg.num_heads, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
            cfg.v_head_dim, cfg.attention_bias, cfg.rms_norm_eps) == (
        raw["num_attention_heads"], raw["q_lora_rank"], raw["kv_lora_rank"], raw["qk_nope_head_dim"],
        raw["qk_rope_head_dim"], raw["v_head_dim"], raw.get("attention_bias", False), raw["rms_norm_eps"])
    assert cfg.cache_dim == raw["kv_lora_rank"] + raw["qk_rope_head_dim"]
    assert cfg.softmax_scale == pytest.approx(attn.scaling, rel=1e-12)
    inv_freq, factor = rope_frequencies(cfg)
    torch.testing.assert_close(inv_freq, rotary.inv_freq, rtol=1e-6, atol=0)
    assert factor == pytest.approx(rotary.attention_scaling, rel=1e-12)
    if "rope_scaling" in raw:  # transformers 5's config.json: rope_parameters with the theta inside
        modern = {k: v for k, v in raw.items() if k not in ("rope_scaling", "rope_theta")}
        modern["rope_parameters"] = dict(raw["rope_scaling"], rope_theta=raw["rope_theta"])
        assert MLAConfig.from_hf(modern) == cfg


def test_unsupported_rope_scaling_is_named() -> None:
    raw = dict(CASES["v3_direct"], rope_scaling={"type": "dynamic", "factor": 2.0})
    with pytest.raises(ConfigError, match="dynamic"):
        MLAConfig.from_hf(raw)


@pytest.mark.parametrize("absorb", [True, False])
def test_empty_step(absorb: bool) -> None:
    """A rank with no tokens this step (EP) still runs the layer: [0, D] out, the cache untouched."""
    cfg, attn, _ = hf_modules("v3_lora_yarn")
    cache = torch.zeros(4, BS, cfg.cache_dim)
    none = torch.zeros(0, dtype=torch.int64)
    meta = AttentionMetadata(none, none, torch.zeros(1, dtype=torch.int64), none, torch.zeros(0, 1, dtype=torch.int32),
                             none, none, 0, 0, BS)
    with torch.no_grad():
        y = mla_attention(torch.zeros(0, cfg.hidden_size), weights_of(attn), cache, meta, cfg,
                          rope_table(cfg, 64), absorb=absorb)
    assert y.shape == (0, cfg.hidden_size) and not cache.any()
