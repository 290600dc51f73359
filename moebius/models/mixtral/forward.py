"""Mixtral forward (transformers' MixtralForCausalLM semantics), reading weight views handed to it, over the
`Communicator`: the same math in every layout (head counts from the weight shapes). Every layer: GQA attention
(models/gqa.py, no q/k norm; windowed where the config has a sliding window), then the sparse MoE block.

Routing (MixtralTopKRouter): the router's logits in the activations' dtype, softmax over all experts in float32, the
top-k of those, divided by their sum (`layers/moe.route` with the renormalisation). transformers keeps these weights
in float32 into the experts' products; the engine rounds them to the activations' dtype first (as for Qwen3-MoE,
whose router rounds them itself): float32 runs are identical, bfloat16 ones may differ in an output's last bit.
Shapes: T tokens, D hidden, K top-k, V vocab.
"""

from __future__ import annotations

import torch

from moebius.config import ModelConfig
from moebius.kernels import KernelConfig
from moebius.layers.attention import AttentionMetadata
from moebius.models.decoder import decoder, num_moe_layers, softmax_moe  # noqa: F401  (the family's)
from moebius.models.gqa import attend, attention, attention_geometry  # noqa: F401  (the family's)
from moebius.models.weights import ModelWeights, MoEWeights, logits  # noqa: F401  (the family's)
from moebius.parallel.dispatch import Communicator


def forward(input_ids_T: torch.Tensor, meta: AttentionMetadata, weights: ModelWeights, kv: list[torch.Tensor],
            cfg: ModelConfig, comm: Communicator, kc: KernelConfig, routed_TLK: torch.Tensor | None = None
            ) -> torch.Tensor:
    """Final-normed hidden states [T, D] of the new tokens (`decoder`); Mixtral's layers: GQA without q/k norm, softmax
    top-2 experts renormalised, every layer."""
    return decoder(input_ids_T, weights, kv, cfg, comm, kc, routed_TLK,
                   lambda i, h, w, cache: attention(h, w, cache, meta.group(cfg.kv_group_of(i)), cfg, weights.rope,
                                                    kc, cfg.layer_window(i)),
                   lambda h, w, record: softmax_moe(h, w, cfg, comm, kc, record))

