"""Qwen3-MoE forward (transformers' Qwen3MoeForCausalLM semantics), reading weight views handed to it.

The math is the same in every layout: head counts come from the weight shapes, and cross-rank sums/routing go
through the `Communicator` passed in. How the kernels run (expert kernel, launch order) is the `KernelConfig` kc
the runner passes for the step, handed to every layer and exchange. Shapes: T tokens, D hidden, H heads, d head
dim, E experts, F rows of a [gate | up] stack, K top-k, V vocab.
"""

from __future__ import annotations

import torch

from moebius.config import ModelConfig
from moebius.kernels import KernelConfig
from moebius.layers.attention import AttentionMetadata
from moebius.models.decoder import decoder, num_moe_layers, softmax_moe  # noqa: F401  (the family's)
from moebius.models.gqa import attend, attention, attention_geometry  # noqa: F401  (the family's)
from moebius.models.weights import DenseWeights, ModelWeights, MoEWeights, logits  # noqa: F401  (the family's)
from moebius.parallel.dispatch import Communicator


def forward(input_ids_T: torch.Tensor, meta: AttentionMetadata, weights: ModelWeights, kv: list[torch.Tensor],
            cfg: ModelConfig, comm: Communicator, kc: KernelConfig, routed_TLK: torch.Tensor | None = None
            ) -> torch.Tensor:
    """Final-normed hidden states [T, D] of the new tokens (`decoder`); Qwen3-MoE's layers: GQA with per-head q/k norms,
    softmax top-k experts (or a dense MLP)."""
    return decoder(input_ids_T, weights, kv, cfg, comm, kc, routed_TLK,
                   lambda i, h, w, cache: attention(h, w, cache, meta, cfg, weights.rope, kc),
                   lambda h, w, record: softmax_moe(h, w, cfg, comm, kc, record))


