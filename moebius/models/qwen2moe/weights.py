"""Qwen2-MoE's weights: every view of a layout with the checkpoint names it is cut from (`weight_specs`), and the
views as the forward takes them (`build_weights`).

Attention: models/gqa.py's with the q|k|v bias (qkv_bias) and no q/k norm. Routed experts: the shared `ExpertCut`
(per-expert `mlp.experts.{e}.{gate,up,down}_proj`, or fused tensors). Dense layers: a dense MLP sharded by TP and
whole in EP.

The shared expert (`mlp.shared_expert.{gate,up,down}_proj`, intermediate shared_expert_intermediate_size), as
DeepSeek's shared experts: one 1/P shard of its intermediate dim on every rank in both layouts (the same region, so
a switch moves none of its bytes), run by the forward on the tokens the routed experts see and added to the routed
output before the combine sums over the ranks (TP: every token, the all-reduce; EP: the dispatched tokens of every
rank, the reduce-scatter). Its gate `mlp.shared_expert_gate` ([1, D]) is every rank's whole: sigmoid(gate . x) scales
a token's shard output on each rank, and since the scale is per token, the ranks' scaled shards sum to the scaled
whole. A layout whose P does not divide shared_expert_intermediate_size is refused (ConfigError naming the family).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moebius.config import ConfigError, ModelConfig
from moebius.memory.umm import UnifiedMemory
from moebius.models.gqa import AttnWeights, attention_specs, attention_weights
from moebius.models.qwen2moe.config import Qwen2MoeFields
from moebius.models.specs import (
    ParamSpec,
    decoder_specs,
    dense_mlp_specs,
    routed_expert_specs,
    shared_expert_specs,
    spec_views,
)
from moebius.models.weights import (
    DenseWeights,
    ModelWeights,
    MoEWeights,
    decoder_weights,
    dense_weights,
    shared_expert_weights,
)
from moebius.parallel.layout import Layout


@dataclass
class Qwen2MoEWeights(MoEWeights):
    """The engine's MoE views (the switch moves w13 / w2) and this rank's shard of the shared expert, with its
    gate."""

    shared: DenseWeights  # this rank's 1/P of the shared expert's intermediate dim
    shared_gate_1D: torch.Tensor  # shared_expert_gate, [1, D]


def _fields(cfg: ModelConfig) -> Qwen2MoeFields:
    return cfg.extra_as(Qwen2MoeFields)


def _shared_specs(cfg: ModelConfig, lay: Layout, p: str) -> list[ParamSpec]:
    D, Is, P = cfg.hidden_size, _fields(cfg).shared_intermediate_size, lay.world_size
    if Is % P:
        raise ConfigError(f"the qwen2moe family cannot cut shared_expert_intermediate_size {Is} over {P} ranks "
                          f"(the {lay.mode} layout holds 1/P of the shared expert on every rank)")
    return [*shared_expert_specs(cfg, lay, p, "mlp.shared_expert.", Is),
            ParamSpec(p + "mlp.shared_gate", (1, D), lambda f: f(p + "mlp.shared_expert_gate.weight", (1, D)))]


def weight_specs(cfg: ModelConfig, lay: Layout, elt: int) -> list[ParamSpec]:
    """GQA attention with q|k|v bias; routed experts beside the gated shared expert, or a dense MLP."""
    def layer(p: str, i: int) -> list[ParamSpec]:
        mlp = (routed_expert_specs(cfg, lay, i, elt) + _shared_specs(cfg, lay, p) if cfg.is_moe_layer(i)
               else dense_mlp_specs(cfg, lay, p))
        return attention_specs(cfg, lay, p, qk_norm=False, bias=cfg.attention_bias) + mlp

    return decoder_specs(cfg, cfg.head_dim, layer)


def build_weights(umm: UnifiedMemory, cfg: ModelConfig, lay: Layout, dtype: torch.dtype) -> ModelWeights:
    """The layout's weight views over the buffer (contents are whatever was loaded there)."""
    views = spec_views(umm, weight_specs(cfg, lay, dtype.itemsize), dtype)

    def layer(p: str, i: int) -> tuple[AttnWeights, MoEWeights | DenseWeights]:
        if not cfg.is_moe_layer(i):
            return attention_weights(views, lay, p), dense_weights(views, lay.tp_rank, lay.tp, p)
        shared = shared_expert_weights(views, lay.rank, lay.world_size, p)
        assert shared is not None
        return attention_weights(views, lay, p), Qwen2MoEWeights(
            views[p + "mlp.gate"], views[p + "mlp.experts.w13"], views[p + "mlp.experts.w2"], lay.first_expert,
            shared, views[p + "mlp.shared_gate"])

    return decoder_weights(views, cfg, lay.vocab_rows, layer)
