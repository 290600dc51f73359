"""Qwen2-MoE forward (transformers' Qwen2MoeForCausalLM semantics), reading weight views handed to it, over the
`Communicator`: the same math in every layout (head counts from the weight shapes, the shared expert's shard from
its). Attention: models/gqa.py's (q|k|v bias, no q/k norm). An MoE layer: `layers/moe.route` (Qwen2MoeTopKRouter:
softmax in float32, top-k, renormalised only with norm_topk_prob, rounded to the activations' dtype), the routed
experts, and the shared expert scaled by sigmoid(shared_expert_gate . x), each rank its 1/P shard of it on the
tokens its routed experts see (models/qwen2moe/weights.py). Shapes: T tokens, D hidden, K top-k, V vocab.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from moebius.config import ModelConfig
from moebius.kernels import KernelConfig
from moebius.layers.attention import AttentionMetadata
from moebius.layers.moe import beside, dense_mlp, experts, route, summed
from moebius.models.decoder import decoder, num_moe_layers  # noqa: F401  (the family's)
from moebius.models.gqa import attend, attention, attention_geometry  # noqa: F401  (the family's)
from moebius.models.qwen2moe.weights import Qwen2MoEWeights
from moebius.models.weights import DenseWeights, ModelWeights, MoEWeights, logits  # noqa: F401  (the family's)
from moebius.parallel.dispatch import Communicator


def moe(h_TD: torch.Tensor, w: Qwen2MoEWeights, cfg: ModelConfig, comm: Communicator, kc: KernelConfig,
        routed_TK: torch.Tensor | None) -> tuple[torch.Tensor, Any]:
    """This rank's part of the MoE block's output for the tokens dispatched to it (its local experts' pairs plus
    its gated shard of the shared expert), and the handle that combines it. routed_TK: where the router's global
    expert ids are written (taken before the dispatch: the same in every layout)."""
    w_TK, ids_TK = route(h_TD, w.gate_ED, cfg.top_k, cfg.norm_topk_prob, kc=kc)
    if routed_TK is not None:
        routed_TK[: ids_TK.shape[0]].copy_(ids_TK)
    x_TD, w_TK, ids_TK, handle = comm.dispatch(h_TD, w_TK, ids_TK, kc=kc)
    # the gate scales each token: the ranks' scaled shards sum (in the combine) to the scaled whole shared expert
    # (with kc.shared_stream computed beside the routed experts)
    shared = beside(lambda: torch.sigmoid(F.linear(x_TD, w.shared_gate_1D))
                    * dense_mlp(x_TD, w.shared.w13_FD, w.shared.w2_DF, kc=kc), x_TD, kc)
    y_TD = summed(experts(x_TD, w_TK, ids_TK, w.w13_EFD, w.w2_EDF, w.first_expert, cfg.num_experts, kc=kc), kc=kc)
    return y_TD + shared(), handle


def forward(input_ids_T: torch.Tensor, meta: AttentionMetadata, weights: ModelWeights, kv: list[torch.Tensor],
            cfg: ModelConfig, comm: Communicator, kc: KernelConfig, routed_TLK: torch.Tensor | None = None
            ) -> torch.Tensor:
    """Final-normed hidden states [T, D] of the new tokens (`decoder`); Qwen2-MoE's layers: GQA with q|k|v bias, softmax
    top-k experts beside a gated shared expert (or a dense MLP)."""
    return decoder(input_ids_T, weights, kv, cfg, comm, kc, routed_TLK,
                   lambda i, h, w, cache: attention(h, w, cache, meta.group(cfg.kv_group_of(i)), cfg, weights.rope,
                                                    kc, cfg.layer_window(i)),
                   lambda h, w, record: moe(h, w, cfg, comm, kc, record))

