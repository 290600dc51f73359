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
from moebius.models.specs import ParamSpec, decoder_specs, routed_expert_specs, spec_views
from moebius.models.weights import ModelWeights, MoEWeights, decoder_weights
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
    """Its attention (whole-projection q/k norms) and routed experts, every layer."""
    return decoder_specs(cfg, cfg.head_dim, lambda p, i: [*attention_specs(cfg, lay, p),
                                                          *routed_expert_specs(cfg, lay, i, elt)])


def build_weights(umm: UnifiedMemory, cfg: ModelConfig, lay: Layout, dtype: torch.dtype) -> ModelWeights:
    """The layout's weight views over the buffer (contents are whatever was loaded there)."""
    views = spec_views(umm, weight_specs(cfg, lay, dtype.itemsize), dtype)
    tag, share = attn_tag(lay), k_share(cfg, lay)
    return decoder_weights(views, cfg, lay.vocab_rows, lambda p, i: (
        AttnWeights(views[p + f"qkv.{tag}"], views[p + f"o_proj.{tag}"], views[p + f"q_norm.{tag}"],
                    views[p + f"k_norm.{tag}"], share),
        MoEWeights(views[p + "mlp.gate"], views[p + "mlp.experts.w13"], views[p + "mlp.experts.w2"], lay.first_expert)))
