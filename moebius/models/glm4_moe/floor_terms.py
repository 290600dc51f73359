"""GLM-4.5's terms of the floor model (`FloorTerms`): GQA, a layout's query heads and KV heads (replicated in TP
below P) of head_dim each, K and V cached per KV head (the projections and the scores as Qwen3-MoE's); the shared
experts a 1/P shard of their intermediate dim on every rank in both layouts, run on every token of the batch
(models/grouped_moe.py)."""

from __future__ import annotations

from moebius.config import ModelConfig
from moebius.models.glm4_moe.weights import glm_extra
from moebius.models.specs import FloorTerms
from moebius.parallel.layout import Layout


def floor_terms(cfg: ModelConfig, lay: Layout) -> FloorTerms:
    D, d, L = cfg.hidden_size, cfg.head_dim, cfg.num_layers
    qh, kvh, spec = lay.num_heads, lay.num_kv_heads, cfg.kv_spec
    moe = sum(1 for i in range(L) if cfg.is_moe_layer(i))
    return FloorTerms(
        attn_weights=L * (D * qh * d * 2 + D * kvh * d * 2),  # q and o of its heads, k and v of its KV heads
        dense_weights=(L - moe) * 3 * D * lay.dense_inter,  # first_k_dense_replace's MLPs
        kv_per_token=L * kvh * spec.parts * spec.dim,
        attn_flops_per_key=L * 4 * qh * d,  # q.k and p.v of each of its heads
        moe_layers=moe,
        shared_weights=moe * 3 * D * glm_extra(cfg).moe.shared_intermediate_size / lay.world_size,
    )
