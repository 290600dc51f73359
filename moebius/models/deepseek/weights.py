"""DeepSeek-V2 / V3's weights: every view of a layout with the checkpoint names transformers writes
(`weight_specs`), and the views as the forward takes them (`build_weights`).

Attention (MLA): with --quantization fp8 its projections are FP8 rows (`linear_spec`) but kv_b_proj, which the
absorbed form reads per head beside the latent. TP cuts by heads, q_b_proj's (or q_proj's) and kv_b_proj's rows of a
rank's heads and o_proj's columns of them; the latent projections (q_a_proj, kv_a_proj_with_mqa) and their norms are
every head's, replicated (the latent cache is replicated in TP too); o_proj's bias is given to the shard of head 0
only, since TP sums the shards' outputs (`Communicator.reduce_add_norm`). EP holds every head.

Routed and shared experts and the routing bias: the block DeepSeek shares with GLM-4.5 (models/grouped_moe.py
`moe_specs`: the shared experts a 1/P shard on every rank in both layouts; it says why and what it costs).
Dense layers (first_k_dense_replace): a dense MLP sharded by TP and whole in EP, as Qwen3-MoE's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from moebius.config import ModelConfig
from moebius.kernels.fp8_rows import column_block
from moebius.memory.umm import UnifiedMemory
from moebius.models.deepseek.config import DeepseekConfig
from moebius.models.deepseek.mla import MLAWeights
from moebius.models.grouped_moe import moe_specs, moe_weights
from moebius.models.specs import Fetch, ParamSpec, decoder_specs, dense_mlp_specs, linear_spec, spec_views
from moebius.models.weights import DenseWeights, ModelWeights, MoEWeights, decoder_weights, dense_weights
from moebius.parallel.layout import Layout


def _ext(cfg: ModelConfig) -> DeepseekConfig:
    return cfg.extra_as(DeepseekConfig)


def _heads_tag(lay: Layout) -> str:
    """Names an attention shard by its heads, so layouts holding the same heads share the region."""
    return f"h{lay.q_heads.start}-{lay.q_heads.stop}"


def _attn_specs(cfg: ModelConfig, lay: Layout, p: str) -> list[ParamSpec]:
    mla = _ext(cfg).mla
    D, H, C, L = cfg.hidden_size, cfg.num_heads, mla.kv_lora_rank, mla.q_lora_rank
    N, R, V = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
    qh, tag, a = lay.q_heads, _heads_tag(lay), p + "self_attn."

    def rows(name: str, shape: tuple[int, int]) -> Callable[[Fetch], torch.Tensor]:
        return lambda f: lay.shard_heads(f(a + name, shape), qh, H)

    def whole(name: str, shape: tuple[int, ...]) -> Callable[[Fetch], torch.Tensor]:
        return lambda f: f(a + name, shape)

    specs = [
        linear_spec(cfg, p + "kv_a", (C + R, D), whole("kv_a_proj_with_mqa.weight", (C + R, D))),
        ParamSpec(p + "kv_a_norm", (C,), whole("kv_a_layernorm.weight", (C,))),
        # in the dtype under FP8 too: the absorbed decode folds it into the query and the output (vLLM keeps it so)
        ParamSpec(p + f"kv_b.{tag}", (len(qh) * (N + V), C), rows("kv_b_proj.weight", (H * (N + V), C))),
        linear_spec(cfg, p + f"o_proj.{tag}", (D, len(qh) * V), lambda f: column_block(
            f(a + "o_proj.weight", (D, H * V)), qh.start * V, qh.stop * V), columns=(H * V, lay.world_size),
            cut=lay.tp),
    ]
    if L is None:
        specs.append(linear_spec(cfg, p + f"q.{tag}", (len(qh) * (N + R), D),
                                 rows("q_proj.weight", (H * (N + R), D))))
    else:
        specs += [
            linear_spec(cfg, p + "q_a", (L, D), whole("q_a_proj.weight", (L, D))),
            ParamSpec(p + "q_a_norm", (L,), whole("q_a_layernorm.weight", (L,))),
            linear_spec(cfg, p + f"q.{tag}", (len(qh) * (N + R), L), rows("q_b_proj.weight", (H * (N + R), L))),
        ]
    if mla.attention_bias:
        specs += [ParamSpec(p + "kv_a_bias", (C + R,), whole("kv_a_proj_with_mqa.bias", (C + R,))),
                  ParamSpec(p + "o_bias", (D,), whole("o_proj.bias", (D,)))]
        if L is not None:
            specs.append(ParamSpec(p + "q_a_bias", (L,), whole("q_a_proj.bias", (L,))))
    return specs


def _layer_specs(cfg: ModelConfig, lay: Layout, p: str, i: int, elt: int) -> list[ParamSpec]:
    """Layer i's MLA and its grouped MoE block or dense MLP."""
    mlp = moe_specs(cfg, _ext(cfg).moe, lay, i, elt) if cfg.is_moe_layer(i) else dense_mlp_specs(cfg, lay, p)
    return _attn_specs(cfg, lay, p) + mlp


def weight_specs(cfg: ModelConfig, lay: Layout, elt: int) -> list[ParamSpec]:
    return decoder_specs(cfg, _ext(cfg).mla.qk_rope_head_dim, lambda p, i: _layer_specs(cfg, lay, p, i, elt))


def build_weights(umm: UnifiedMemory, cfg: ModelConfig, lay: Layout, dtype: torch.dtype) -> ModelWeights:
    """The layout's weight views over the buffer (contents are whatever was loaded there)."""
    views = spec_views(umm, weight_specs(cfg, lay, dtype.itemsize), dtype)
    tag = _heads_tag(lay)

    def layer(p: str, i: int) -> tuple[MLAWeights, MoEWeights | DenseWeights]:
        attn = MLAWeights(
            q_a_LD=views.get(p + "q_a"), q_a_bias=views.get(p + "q_a_bias"), q_a_norm=views.get(p + "q_a_norm"),
            q_QL=views[p + f"q.{tag}"], kv_a_AD=views[p + "kv_a"], kv_a_bias=views.get(p + "kv_a_bias"),
            kv_a_norm=views[p + "kv_a_norm"], kv_b_UC=views[p + f"kv_b.{tag}"], o_DO=views[p + f"o_proj.{tag}"],
            # the shards' outputs are summed: the bias once, on the shard of head 0
            o_bias=views.get(p + "o_bias") if lay.q_heads.start == 0 else None)
        mlp = moe_weights(views, lay, i) if cfg.is_moe_layer(i) else dense_weights(views, lay.tp_rank, lay.tp, p)
        return attn, mlp

    return decoder_weights(views, cfg, lay.vocab_rows, layer)
