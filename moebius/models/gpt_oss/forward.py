"""GPT-OSS forward (transformers' GptOssForCausalLM semantics), reading weight views handed to it, over the
`Communicator`: the same math in every layout (head counts from the weight shapes, the experts' shard from theirs).

Attention: GQA with q|k|v and o biases, a learned sink logit a head, sliding-window layers
(`ModelConfig.layer_windows`, reading their KV group's page tables: `meta.group`), YaRN rope over the whole head
(rotate-half, cos and sin times the attention factor). Routing: the router's logits
with their bias, top-k of them, a softmax over those k. Experts: [gate | up] with their bias, gate clamped above at
`limit`, up clamped to [-limit, limit], out = (up + 1) * gate * sigmoid(alpha * gate) (`layers.moe.ClampedSwiGLU`),
down with its bias, all times the routing weight. On the GPU the paged attention
kernel takes the sinks and windows, the fused MoE kernel the biases and this activation, and the decode graphs and
step pieces hold the sliding layers' own tables.
Shapes: T tokens, D hidden, H heads, d head dim, E experts, K top-k, F = 2 * I rows of a [gate | up] stack.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moebius.config import ModelConfig
from moebius.kernels import KernelConfig, triton_available
from moebius.layers.attention import AttentionMetadata, qkv_attention
from moebius.layers.linear import linear
from moebius.layers.moe import experts
from moebius.layers.rotary import scaled_rope_table
from moebius.models.decoder import decoder, num_moe_layers  # noqa: F401  (the family's)
from moebius.models.gpt_oss.weights import GptOssAttnWeights, GptOssMoEWeights, ext_of
from moebius.models.gqa import attend, attention_geometry  # noqa: F401  (the family's)
from moebius.models.weights import ModelWeights, logits  # noqa: F401  (the family's)
from moebius.parallel.dispatch import Communicator


def family_rope_table(cfg: ModelConfig, device: torch.device) -> torch.Tensor:
    """The region "rope": [max_position_embeddings, head_dim] float32, YaRN's where the config says."""
    return scaled_rope_table(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, ext_of(cfg).yarn, device)


def attention(x_TD: torch.Tensor, w: GptOssAttnWeights, cache: torch.Tensor, meta: AttentionMetadata,
              cfg: ModelConfig, rope: torch.Tensor, window: int | None, kc: KernelConfig) -> torch.Tensor:
    """This rank's heads' share of the output projection (in TP a partial sum over ranks, o_proj's bias on one)."""
    qkv = linear(x_TD, w.qkv_QD, w.qkv_bias, kc=kc)
    o = qkv_attention(qkv, None, None, rope, cache, meta, cfg.rms_norm_eps, cfg.head_dim ** -0.5, kc=kc,
                      sinks=w.sinks_H, window=window)
    return linear(o.flatten(1), w.o_DQ, w.o_bias, kc=kc)


def route(x_TD: torch.Tensor, w: GptOssMoEWeights, top_k: int, kc: KernelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing weights [T, K] (x's dtype) and expert ids [T, K], as transformers' GptOssTopKRouter: the top k of the
    biased logits, softmaxed among themselves. On the GPU one launch after the logits' GEMM (`fused.topk_softmax`:
    the softmax over every expert renormalised over the top k is the softmax of the top k's logits), where torch's
    top-k, sort and softmax took several."""
    logits_TE = F.linear(x_TD, w.gate_ED, w.router_bias_E)
    if logits_TE.is_cuda and triton_available():
        from moebius.kernels.fused import topk_softmax

        return topk_softmax(logits_TE, top_k, True, x_TD.dtype, kc=kc)
    top_TK, ids_TK = torch.topk(logits_TE, top_k, dim=-1)
    return torch.softmax(top_TK, dim=-1, dtype=top_TK.dtype), ids_TK


def moe(h_TD: torch.Tensor, w: GptOssMoEWeights, cfg: ModelConfig, comm: Communicator, kc: KernelConfig,
        routed_TK: torch.Tensor | None = None) -> tuple[torch.Tensor, object]:
    """This rank's expert outputs for the tokens dispatched to it, and the handle that combines them. routed_TK:
    where the router's global expert ids are written (taken before the dispatch: the same in every layout)."""
    w_TK, ids_TK = route(h_TD, w, cfg.top_k, kc)
    if routed_TK is not None:
        routed_TK[: ids_TK.shape[0]].copy_(ids_TK)
    x_TD, w_TK, ids_TK, handle = comm.dispatch(h_TD, w_TK, ids_TK, kc=kc)
    return experts(x_TD, w_TK, ids_TK, w.w13_EFD, w.w2_EDF, w.first_expert, cfg.num_experts, kc=kc,
                   act=ext_of(cfg).activation, b13_EF=w.b13_EF, b2_ED=w.b2_ED), handle


def forward(input_ids_T: torch.Tensor, meta: AttentionMetadata, weights: ModelWeights, kv: list[torch.Tensor],
            cfg: ModelConfig, comm: Communicator, kc: KernelConfig, routed_TLK: torch.Tensor | None = None
            ) -> torch.Tensor:
    """Final-normed hidden states [T, D] of the new tokens (`decoder`); GPT-OSS's layers: GQA with sinks (windowed in
    the sliding layers, which read their KV group's pages: the window's only), its biased experts, every layer."""
    return decoder(input_ids_T, weights, kv, cfg, comm, kc, routed_TLK,
                   lambda i, h, w, cache: attention(h, w, cache, meta.group(cfg.kv_group_of(i)), cfg, weights.rope,
                                                     cfg.layer_window(i), kc),
                   lambda h, w, record: moe(h, w, cfg, comm, kc, record))

