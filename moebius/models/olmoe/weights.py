"""OLMoE's weights: every view of a layout with the checkpoint names it is cut from (`weight_specs`), and the views
as the forward takes them (`build_weights`). q|k|v and o_proj are GQA's (`models/gqa.attention_specs`, no per-head
norm, no bias); the q / k norms span the whole projections ([H * d], [kvH * d]), so a layout holds the rows of its
heads, cut like q and k (KV heads replicated below P as `Layout` replicates them)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moebius.config import ModelConfig
from moebius.memory.umm import UnifiedMemory
from moebius.models.gqa import attention_specs as gqa_specs
from moebius.models.gqa import attn_tag
from moebius.models.specs import ParamSpec, routed_expert_specs, spec_view
from moebius.models.weights import LayerWeights, ModelWeights, MoEWeights
from moebius.parallel.layout import Layout


@dataclass
class AttnWeights:
    """A rank's OLMoE attention (`qkv_QD` as GQA's, so `models/gqa.attention_geometry` reads it)."""

    qkv_QD: torch.Tensor  # [(H + 2 * kvH) * d, D]: this rank's q heads, then k heads, then v heads
    o_DQ: torch.Tensor  # [D, H * d]
    q_norm_Q: torch.Tensor  # [H * d]: q_norm's entries of this rank's q heads
    k_norm_K: torch.Tensor  # [kvH * d]: k_norm's entries of this rank's KV heads
    # 1.0 where this rank's KV heads count in k's sum of squares over the ranks, 0.0 on a further replica of them
    k_share: float


def k_share(cfg: ModelConfig, lay: Layout) -> float:
    """Whether this rank counts its KV heads in the whole k's sum of squares: TP below P replicates each KV head on
    P / kvH consecutive ranks (`Layout.kv_heads`), of which the first counts it."""
    replicas = max(1, lay.tp // cfg.num_kv_heads)
    return 1.0 if lay.tp_rank % replicas == 0 else 0.0


def attention_specs(cfg: ModelConfig, lay: Layout, p: str) -> list[ParamSpec]:
    """Layer `p`'s attention views: GQA's q|k|v and o_proj of this layout's heads, and the rows of q_norm / k_norm
    of the same heads (self_attn.{q,k}_norm.weight)."""
    d, qh, kvh, tag = cfg.head_dim, lay.q_heads, lay.kv_heads, attn_tag(lay)
    return [
        *gqa_specs(cfg, lay, p, qk_norm=False, bias=False),
        ParamSpec(p + f"q_norm.{tag}", (len(qh) * d,), lambda f: lay.shard_heads(
            f(p + "self_attn.q_norm.weight", (cfg.q_size,)), qh, cfg.num_heads)),
        ParamSpec(p + f"k_norm.{tag}", (len(kvh) * d,), lambda f: lay.shard_heads(
            f(p + "self_attn.k_norm.weight", (cfg.kv_size,)), kvh, cfg.num_kv_heads)),
    ]


def weight_specs(cfg: ModelConfig, lay: Layout, elt: int) -> list[ParamSpec]:
    V, D = cfg.vocab_size, cfg.hidden_size
    specs = [ParamSpec("model.embed_tokens", (V, D), lambda f: f("model.embed_tokens.weight", (V, D)))]
    if not cfg.tie_word_embeddings:
        specs.append(ParamSpec("lm_head", (V, D), lambda f: f("lm_head.weight", (V, D))))
    specs += [ParamSpec("model.norm", (D,), lambda f: f("model.norm.weight", (D,))),
              ParamSpec("rope", (cfg.max_position_embeddings, cfg.head_dim), None)]
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        specs += [
            ParamSpec(p + "input_layernorm", (D,), lambda f, p=p: f(p + "input_layernorm.weight", (D,))),
            ParamSpec(p + "post_attention_layernorm", (D,),
                      lambda f, p=p: f(p + "post_attention_layernorm.weight", (D,))),
            *attention_specs(cfg, lay, p),
            *routed_expert_specs(cfg, lay, i, elt),  # every OLMoE layer is MoE
        ]
    return specs


def build_weights(umm: UnifiedMemory, cfg: ModelConfig, lay: Layout, dtype: torch.dtype) -> ModelWeights:
    """The layout's weight views over the buffer (contents are whatever was loaded there)."""
    views = {s.name: spec_view(umm, s, dtype) for s in weight_specs(cfg, lay, dtype.itemsize)}
    tag, share = attn_tag(lay), k_share(cfg, lay)
    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        attn = AttnWeights(views[p + f"qkv.{tag}"], views[p + f"o_proj.{tag}"], views[p + f"q_norm.{tag}"],
                           views[p + f"k_norm.{tag}"], share)
        mlp = MoEWeights(views[p + "mlp.gate"], views[p + "mlp.experts.w13"], views[p + "mlp.experts.w2"],
                         lay.first_expert)
        layers.append(LayerWeights(views[p + "input_layernorm"], views[p + "post_attention_layernorm"], attn, mlp))
    embed = views["model.embed_tokens"]
    head = embed if cfg.tie_word_embeddings else views["lm_head"]
    rows = lay.vocab_rows  # TP: this rank's vocabulary slice (a view; see TPComm)
    return ModelWeights(embed, head[rows.start: rows.stop], views["model.norm"], views["rope"], layers)
