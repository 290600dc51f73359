"""OLMoE forward (transformers' OlmoeForCausalLM semantics), reading weight views handed to it, over the
`Communicator`: the same math in every layout (head counts from the weight shapes). The MoE block routes as
transformers' OlmoeTopKRouter (`layers/moe.route`: softmax, top-k, optionally renormalised) to SwiGLU experts; the
attention is GQA's (`qkv_attention`, rope and the paged cache) after q and k are RMS-normed over their WHOLE
projections (`whole_qk_norm`). Shapes: T tokens, D hidden, H heads, d head dim, Q / K this rank's q / k widths (its
heads times d), K top-k in `moe`.

Under TP a rank holds some heads, so a norm's sum of squares spans ranks: each rank sums its heads' squares (q's
and k's, a [T, 2] float32 tensor) and `Communicator.reduce_heads` all-reduces them before the norm: 8 bytes a
token a layer, one small collective. The alternative, every rank projecting q and k whole (norming locally, then
keeping its heads), exchanges nothing but holds and reads (P - 1) / P of q_proj and k_proj more on every step
(OLMoE-1B-7B at P = 2: 8 MiB of bf16 a layer, against 8 bytes a token) and spends their FLOPs on every prompt
token. EP holds every head: `reduce_heads` returns the sums as they are.
"""

from __future__ import annotations

import torch

from moebius.config import ModelConfig
from moebius.kernels import KernelConfig
from moebius.layers.attention import AttentionMetadata, qkv_attention
from moebius.layers.linear import linear
from moebius.models.decoder import decoder, num_moe_layers, softmax_moe  # noqa: F401  (the family's)
from moebius.models.gqa import attend, attention_geometry  # noqa: F401  (the family's)
from moebius.models.olmoe.config import OlmoeFields
from moebius.models.olmoe.weights import AttnWeights
from moebius.models.weights import ModelWeights, MoEWeights, logits  # noqa: F401  (the family's)
from moebius.parallel.dispatch import Communicator


def whole_qk_norm(qkv_TQ: torch.Tensor, w: AttnWeights, cfg: ModelConfig, comm: Communicator) -> None:
    """q and k of the fused q|k|v projection RMS-normed in place over the whole projections (every rank's heads),
    as OlmoeRMSNorm: float32 squares, their mean over H * d (kvH * d), then the weight times the cast back."""
    Q, K = w.q_norm_Q.shape[0], w.k_norm_K.shape[0]
    qk = qkv_TQ[:, : Q + K]
    qf, kf = qk[:, :Q].float(), qk[:, Q:].float()
    # a further replica of a KV head (TP below P) adds nothing: the whole k counts each head once
    ss_T2 = comm.reduce_heads(torch.stack([qf.pow(2).sum(-1), kf.pow(2).sum(-1) * w.k_share], dim=1))
    eps = cfg.rms_norm_eps
    qf = qf * torch.rsqrt(ss_T2[:, :1] / cfg.q_size + eps)
    kf = kf * torch.rsqrt(ss_T2[:, 1:] / cfg.kv_size + eps)
    qk[:, :Q] = w.q_norm_Q * qf.to(qkv_TQ.dtype)
    qk[:, Q:] = w.k_norm_K * kf.to(qkv_TQ.dtype)


def attention(x_TD: torch.Tensor, w: AttnWeights, cache: torch.Tensor, meta: AttentionMetadata, cfg: ModelConfig,
              rope: torch.Tensor, comm: Communicator, kc: KernelConfig) -> torch.Tensor:
    """This rank's heads' share of the output projection (in TP a partial sum over ranks)."""
    qkv = linear(x_TD, w.qkv_QD, kc=kc)
    whole_qk_norm(qkv, w, cfg, comm)
    ext = cfg.extra_as(OlmoeFields)
    if ext.clip_qkv is not None:  # transformers clamps normed q, k and v alike, before the rope
        qkv.clamp_(-ext.clip_qkv, ext.clip_qkv)
    o = qkv_attention(qkv, None, None, rope, cache, meta, cfg.rms_norm_eps, cfg.head_dim ** -0.5, kc=kc)
    return linear(o.flatten(1), w.o_DQ, kc=kc)


def forward(input_ids_T: torch.Tensor, meta: AttentionMetadata, weights: ModelWeights, kv: list[torch.Tensor],
            cfg: ModelConfig, comm: Communicator, kc: KernelConfig, routed_TLK: torch.Tensor | None = None
            ) -> torch.Tensor:
    """Final-normed hidden states [T, D] of the new tokens (`decoder`); OLMoE's layers: GQA with q/k norms over the
    whole projections, softmax top-k experts, every layer."""
    return decoder(input_ids_T, weights, kv, cfg, comm, kc, routed_TLK,
                   lambda i, h, w, cache: attention(h, w, cache, meta, cfg, weights.rope, comm, kc),
                   lambda h, w, record: softmax_moe(h, w, cfg, comm, kc, record))

