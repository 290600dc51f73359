"""Mixtral forward (transformers' MixtralForCausalLM semantics), reading weight views handed to it, over the
`Communicator`: the same math in every layout (head counts from the weight shapes). Every layer: GQA attention
(models/gqa.py, no q/k norm), then the sparse MoE block.

Routing (MixtralTopKRouter): the router's logits in the activations' dtype, softmax over all experts in float32, the
top-k of those, divided by their sum (`layers/moe.route` with the renormalisation). transformers keeps these weights
in float32 into the experts' products; the engine rounds them to the activations' dtype first (as for Qwen3-MoE,
whose router rounds them itself): float32 runs are identical, bfloat16 ones may differ in an output's last bit.
Shapes: T tokens, D hidden, K top-k, V vocab.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from moebius.config import ModelConfig
from moebius.kernels import KernelConfig
from moebius.kernels.pairs import PairRows
from moebius.layers.attention import AttentionMetadata
from moebius.layers.moe import experts, route
from moebius.layers.norm import add_rms_norm
from moebius.models.gqa import attend, attention, attention_geometry  # noqa: F401  (the family's)
from moebius.models.weights import ModelWeights, MoEWeights, logits  # noqa: F401  (the family's)
from moebius.parallel.dispatch import Communicator


def moe(x_TD: torch.Tensor, w: MoEWeights, cfg: ModelConfig, comm: Communicator, kc: KernelConfig,
        routed_TK: torch.Tensor | None) -> tuple[torch.Tensor | PairRows, Any]:
    """This rank's expert outputs for the tokens dispatched to it, and the handle that combines them. routed_TK:
    where the router's global expert ids are written (taken before the dispatch: the same in every layout)."""
    w_TK, ids_TK = route(x_TD, w.gate_ED, cfg.top_k, True, kc=kc)
    if routed_TK is not None:
        routed_TK[: ids_TK.shape[0]].copy_(ids_TK)
    x, w_TK, ids_TK, handle = comm.dispatch(x_TD, w_TK, ids_TK, kc=kc)
    return experts(x, w_TK, ids_TK, w.w13_EFD, w.w2_EDF, w.first_expert, cfg.num_experts, keep_pairs=True,
                   kc=kc), handle


def forward(input_ids_T: torch.Tensor, meta: AttentionMetadata, weights: ModelWeights, kv: list[torch.Tensor],
            cfg: ModelConfig, comm: Communicator, kc: KernelConfig, routed_TLK: torch.Tensor | None = None
            ) -> torch.Tensor:
    """Final-normed hidden states [T, D] of the new tokens; their K/V are written into `kv` (one cache per layer).
    Each sublayer's output is summed over ranks (attention: `reduce_add_norm`; experts: `combine_add_norm`), added
    to the residual and normed for the next sublayer. routed_TLK: a [>= T, layers, K] integer buffer the router's
    expert ids of every layer are written into."""
    eps = cfg.rms_norm_eps
    residual = F.embedding(input_ids_T, weights.embed_VD)
    h, residual = add_rms_norm(residual, None, weights.layers[0].input_norm, eps, kc=kc)
    norms = [layer.input_norm for layer in weights.layers[1:]] + [weights.norm]
    for j, (layer, cache, next_norm) in enumerate(zip(weights.layers, kv, norms, strict=True)):
        a = attention(h, layer.attn, cache, meta, cfg, weights.rope, kc)
        h, residual = comm.reduce_add_norm(a, residual, layer.post_norm, eps, kc=kc)
        y, handle = moe(h, layer.mlp, cfg, comm, kc, None if routed_TLK is None else routed_TLK[:, j])
        h, residual = comm.combine_add_norm(y, handle, residual, next_norm, eps, kc=kc)
    return h


def num_moe_layers(weights: ModelWeights) -> int:
    """Layers with routed experts (every layer; the second dim of `forward`'s routed_TLK)."""
    return len(weights.layers)
