"""The decoder stack the families share: the embedding, then per layer its attention and its MLP, each sublayer's
output summed over ranks and added to the residual stream together with the next norm (`reduce_add_norm`,
`combine_add_norm` of the `Communicator`: one fused step on GPUs), and the final-normed hidden states out. A family
hands in its attention and its MoE block; a layer whose MLP is `DenseWeights` runs the SwiGLU MLP. `softmax_moe` is
the plain routed block (softmax top-k, then the experts) of the families without shared experts.
Shapes: T tokens, D hidden, K top-k."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from moebius.config import ModelConfig
from moebius.kernels import KernelConfig
from moebius.kernels.pairs import PairRows
from moebius.layers.moe import dense_mlp, experts, route
from moebius.layers.norm import add_rms_norm
from moebius.models.weights import DenseWeights, ModelWeights, MoEWeights
from moebius.parallel.dispatch import Communicator

# (layer index, h_TD, the layer's attention weights, its KV cache) -> this rank's share of the attention output [T, D]
LayerAttention = Callable[[int, torch.Tensor, Any, torch.Tensor], torch.Tensor]
# (h_TD, the layer's MoE weights, where its router's expert ids go or None) -> (this rank's expert outputs, the
# handle the combine sums them with)
MoEBlock = Callable[[torch.Tensor, Any, torch.Tensor | None], tuple[torch.Tensor | PairRows, Any]]


def decoder(input_ids_T: torch.Tensor, weights: ModelWeights, kv: list[torch.Tensor], cfg: ModelConfig,
            comm: Communicator, kc: KernelConfig, routed_TLK: torch.Tensor | None, attention: LayerAttention,
            moe: MoEBlock) -> torch.Tensor:
    """Final-normed hidden states [T, D] of the new tokens (their KV written into `kv` by `attention`, one cache a
    layer). routed_TLK: a [>= T, MoE layers, K] integer buffer each MoE layer's router writes its expert ids into
    (`num_moe_layers`; a static buffer, so a graph replay writes it too)."""
    eps = cfg.rms_norm_eps
    residual = F.embedding(input_ids_T, weights.embed_VD)
    h, residual = add_rms_norm(residual, None, weights.layers[0].input_norm, eps, kc=kc)
    norms = [layer.input_norm for layer in weights.layers[1:]] + [weights.norm]
    j = 0  # the MoE layer's index among the MoE layers (dense layers route nothing)
    for i, (layer, cache, next_norm) in enumerate(zip(weights.layers, kv, norms, strict=True)):
        h, residual = comm.reduce_add_norm(attention(i, h, layer.attn, cache), residual, layer.post_norm, eps, kc=kc)
        if isinstance(layer.mlp, MoEWeights):
            record = None
            if routed_TLK is not None:
                record, j = routed_TLK[:, j], j + 1
            y, handle = moe(h, layer.mlp, record)
        else:
            assert isinstance(layer.mlp, DenseWeights)
            y, handle = dense_mlp(h, layer.mlp.w13_FD, layer.mlp.w2_DF, kc=kc), None  # no dispatch: nothing to combine
        h, residual = comm.combine_add_norm(y, handle, residual, next_norm, eps, kc=kc)
    return h


def num_moe_layers(weights: ModelWeights) -> int:
    """Layers with routed experts (the second dim of `decoder`'s routed_TLK)."""
    return sum(isinstance(layer.mlp, MoEWeights) for layer in weights.layers)


def softmax_moe(x_TD: torch.Tensor, w: MoEWeights, cfg: ModelConfig, comm: Communicator, kc: KernelConfig,
                routed_TK: torch.Tensor | None) -> tuple[torch.Tensor | PairRows, Any]:
    """This rank's expert outputs for the tokens dispatched to it (per (token, k) pair where the combine sums them)
    and the handle that combines them: softmax top-k routing (renormalised with cfg.norm_topk_prob), SwiGLU experts.
    routed_TK: where the router's global expert ids are written (taken before the dispatch: the same in every
    layout)."""
    w_TK, ids_TK = route(x_TD, w.gate_ED, cfg.top_k, cfg.norm_topk_prob, kc=kc)
    if routed_TK is not None:
        routed_TK[: ids_TK.shape[0]].copy_(ids_TK)
    x, w_TK, ids_TK, handle = comm.dispatch(x_TD, w_TK, ids_TK, kc=kc)
    return experts(x, w_TK, ids_TK, w.w13_EFD, w.w2_EDF, w.first_expert, cfg.num_experts, keep_pairs=True,
                   kc=kc), handle
