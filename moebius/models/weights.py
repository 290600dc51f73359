"""The weight views a family's forward reads, in the form the engine also knows: the switch moves each MoE layer's
expert views (`MoEWeights.w13_EFD` / `w2_EDF`), the diagnostics digest them; the attention weights are the
family's own (`LayerWeights.attn`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from moebius.config import ModelConfig


@dataclass
class MoEWeights:
    gate_ED: torch.Tensor  # router, [E, D], every expert
    w13_EFD: torch.Tensor  # [E_local, 2 * I_local, D], gate rows then up rows
    w2_EDF: torch.Tensor  # [E_local, D, I_local]
    first_expert: int


@dataclass
class DenseWeights:
    w13_FD: torch.Tensor  # [2 * I_local, D]
    w2_DF: torch.Tensor  # [D, I_local]


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    attn: Any  # the family's attention weights (its model module's AttnWeights)
    mlp: MoEWeights | DenseWeights


@dataclass
class ModelWeights:
    embed_VD: torch.Tensor
    lm_head_VD: torch.Tensor  # TP: this rank's vocabulary slice (comm.vocab_argmax / gather_vocab)
    norm: torch.Tensor
    rope: torch.Tensor  # [max_pos, d] cos|sin table
    layers: list[LayerWeights]


def decoder_weights(views: dict[str, torch.Tensor], cfg: ModelConfig, vocab_rows: range,
                    layer: Callable[[str, int], tuple[Any, MoEWeights | DenseWeights]]) -> ModelWeights:
    """The views of `specs.decoder_specs` as the forward takes them: each layer's norms and what `layer(p, i)`
    makes of its attention and MLP views; the lm_head (the embedding where tied) cut to `vocab_rows` (TP: this
    rank's vocabulary slice, a view; see TPComm)."""
    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        layers.append(LayerWeights(views[p + "input_layernorm"], views[p + "post_attention_layernorm"], *layer(p, i)))
    embed = views["model.embed_tokens"]
    head = embed if cfg.tie_word_embeddings else views["lm_head"]
    return ModelWeights(embed, head[vocab_rows.start: vocab_rows.stop], views["model.norm"], views["rope"], layers)


def shared_tag(rank: int, world_size: int) -> str:
    """A shared expert's shard is a rank's in both layouts: one region, named by the rank."""
    return f"{rank}of{world_size}"


def shared_expert_weights(views: dict[str, torch.Tensor], rank: int, world_size: int, p: str) -> DenseWeights | None:
    """Layer `p`'s shared-expert shard (`specs.shared_expert_specs`; None where the layer has none)."""
    tag = shared_tag(rank, world_size)
    w13, w2 = views.get(p + f"mlp.shared.w13.{tag}"), views.get(p + f"mlp.shared.w2.{tag}")
    return None if w13 is None or w2 is None else DenseWeights(w13, w2)


def dense_weights(views: dict[str, torch.Tensor], tp_rank: int, tp: int, p: str) -> DenseWeights:
    """Layer `p`'s dense MLP views (`specs.dense_mlp_specs`: this TP rank's shard)."""
    return DenseWeights(views[p + f"mlp.w13.tp{tp_rank}of{tp}"], views[p + f"mlp.w2.tp{tp_rank}of{tp}"])


def logits(hidden_TD: torch.Tensor, weights: ModelWeights, fp32: bool = False) -> torch.Tensor:
    """[T, V] logits (TP: this rank's vocabulary slice). fp32 (--lm-head-dtype float32): accumulated and returned
    in float32 whatever the model's dtype, from the weights as they are (an fp32 copy would go stale on a weight
    update): on the GPU one matmul with a float32 output, elsewhere through float32 copies."""
    w = weights.lm_head_VD
    if not fp32 or w.dtype == torch.float32:
        return F.linear(hidden_TD, w)
    if hidden_TD.is_cuda:
        try:
            return torch.mm(hidden_TD, w.t(), out_dtype=torch.float32)
        except (RuntimeError, TypeError):  # a torch without mm's out_dtype for these dtypes
            pass
    return F.linear(hidden_TD.float(), w.float())
