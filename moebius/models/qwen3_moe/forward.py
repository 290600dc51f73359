"""Qwen3-MoE forward (transformers' Qwen3MoeForCausalLM semantics), reading weight views handed to it.

The math is the same in every layout: head counts come from the weight shapes, and cross-rank sums/routing go
through the `Communicator` passed in. How the kernels run (expert kernel, launch order) is the `KernelConfig` kc
the runner passes for the step, handed to every layer and exchange. Shapes: T tokens, D hidden, H heads, d head
dim, E experts, F rows of a [gate | up] stack, K top-k, V vocab.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from moebius.config import ModelConfig
from moebius.kernels import KernelConfig
from moebius.kernels.pairs import PairRows
from moebius.layers.attention import AttentionMetadata
from moebius.layers.moe import dense_mlp, experts, route
from moebius.layers.norm import add_rms_norm
from moebius.models.gqa import attend, attention, attention_geometry  # noqa: F401  (the family's)
from moebius.models.weights import DenseWeights, ModelWeights, MoEWeights, logits  # noqa: F401  (the family's)
from moebius.parallel.dispatch import Communicator


def moe(x_TD: torch.Tensor, w: MoEWeights, cfg: ModelConfig, comm: Communicator, kc: KernelConfig,
        routed_TK: torch.Tensor | None = None) -> tuple[torch.Tensor | PairRows, Any]:
    """This rank's expert outputs for the tokens dispatched to it (per (token, k) pair where the combine sums them),
    and the handle that combines them. routed_TK: where the router's expert ids of the T tokens are written (global
    ids, in the router's order: taken before the dispatch, so the same in every layout)."""
    w_TK, ids_TK = route(x_TD, w.gate_ED, cfg.top_k, cfg.norm_topk_prob, kc=kc)
    if routed_TK is not None:
        routed_TK[: ids_TK.shape[0]].copy_(ids_TK)
    x, w_TK, ids_TK, handle = comm.dispatch(x_TD, w_TK, ids_TK, kc=kc)
    y = experts(x, w_TK, ids_TK, w.w13_EFD, w.w2_EDF, w.first_expert, cfg.num_experts, keep_pairs=True, kc=kc)
    return y, handle


def mlp(x_TD: torch.Tensor, w: MoEWeights | DenseWeights, cfg: ModelConfig, comm: Communicator, kc: KernelConfig,
        routed_TK: torch.Tensor | None = None) -> tuple[torch.Tensor | PairRows, Any]:
    if isinstance(w, MoEWeights):
        return moe(x_TD, w, cfg, comm, kc, routed_TK)
    return dense_mlp(x_TD, w.w13_FD, w.w2_DF, kc=kc), None  # no dispatch: nothing to combine


def forward(input_ids_T: torch.Tensor, meta: AttentionMetadata, weights: ModelWeights, kv: list[torch.Tensor],
            cfg: ModelConfig, comm: Communicator, kc: KernelConfig, routed_TLK: torch.Tensor | None = None
            ) -> torch.Tensor:
    """Final-normed hidden states [T, D] of the new tokens; their K/V are written into `kv` (one cache per layer).
    Each sublayer's output is summed over ranks (attention: `reduce_add_norm`; experts: `combine_add_norm`), added
    to the residual stream and normed for the next sublayer in one step (fused on GPUs).
    routed_TLK: a [>= T, MoE layers, K] integer buffer the router's expert ids of every MoE layer are written into
    (`num_moe_layers`; a static buffer, so a graph replay writes it too)."""
    residual = F.embedding(input_ids_T, weights.embed_VD)
    h, residual = add_rms_norm(residual, None, weights.layers[0].input_norm, cfg.rms_norm_eps, kc=kc)
    norms = [layer.input_norm for layer in weights.layers[1:]] + [weights.norm]
    eps = cfg.rms_norm_eps
    j = 0  # the MoE layer's index among the MoE layers (dense layers route nothing)
    for layer, cache, next_norm in zip(weights.layers, kv, norms, strict=True):
        a = attention(h, layer.attn, cache, meta, cfg, weights.rope, kc)
        h, residual = comm.reduce_add_norm(a, residual, layer.post_norm, eps, kc=kc)
        record = None
        if routed_TLK is not None and isinstance(layer.mlp, MoEWeights):
            record, j = routed_TLK[:, j], j + 1
        y, handle = mlp(h, layer.mlp, cfg, comm, kc, record)
        h, residual = comm.combine_add_norm(y, handle, residual, next_norm, eps, kc=kc)
    return h


def num_moe_layers(weights: ModelWeights) -> int:
    """Layers with routed experts (the second dim of `forward`'s routed_TLK)."""
    return sum(isinstance(layer.mlp, MoEWeights) for layer in weights.layers)

