"""DeepSeek-V2 / V3's terms of the floor model (`FloorTerms`): MLA in the absorbed form its decode runs.

Weights a layer: q (q_a of the latent rank L and this rank's heads of q_b, or q_proj), kv_a (C + R rows, every
head's: replicated in TP), this rank's heads of kv_b and o_proj's columns; norms (vectors) left out. In the absorbed
form each of them is used once a token (kv_b's key rows folded into the query, its value rows after the weighted
sum), so a token's projection FLOPs are twice the elements, as for GQA. Cache: one latent of C + R values a token a
layer on every rank that runs the request (TP: every rank, every request). Attention a cached token: scores over
C + R values and the weighted sum over C, for each of the rank's heads. The shared experts: a 1/P shard of their
intermediate dim on every rank in both layouts, run on every token of the batch (models/deepseek/weights.py).
"""

from __future__ import annotations

from moebius.config import ModelConfig
from moebius.models.deepseek.config import DeepseekConfig
from moebius.models.specs import FloorTerms
from moebius.parallel.layout import Layout


def floor_terms(cfg: ModelConfig, lay: Layout) -> FloorTerms:
    ext = cfg.extra_as(DeepseekConfig)
    mla, D, L, H = ext.mla, cfg.hidden_size, cfg.num_layers, lay.num_heads
    C, R, N, V, Lq = mla.kv_lora_rank, mla.qk_rope_head_dim, mla.qk_nope_head_dim, mla.v_head_dim, mla.q_lora_rank
    q = H * (N + R) * D if Lq is None else Lq * D + H * (N + R) * Lq
    layer = q + (C + R) * D + H * (N + V) * C + D * H * V
    moe = sum(1 for i in range(L) if cfg.is_moe_layer(i))
    return FloorTerms(
        attn_weights=L * layer,
        dense_weights=(L - moe) * 3 * D * lay.dense_inter,  # first_k_dense_replace's MLPs
        kv_per_token=L * lay.num_kv_heads * cfg.kv_spec.parts * cfg.kv_spec.dim,  # the latent and its rope key
        attn_flops_per_key=L * (2 * H * (C + R) + 2 * H * C),
        moe_layers=moe,
        shared_weights=moe * 3 * D * ext.moe.shared_intermediate_size / lay.world_size,
    )
