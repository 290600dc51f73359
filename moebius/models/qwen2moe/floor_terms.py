"""Qwen2-MoE's terms of the floor model (`FloorTerms`): GQA, a layout's query heads and KV heads (replicated in TP
below P) of head_dim each, K and V cached per KV head (the q|k|v biases left out, as norms are); the shared expert a
1/P shard on every rank in both layouts, run on every token of the batch (models/qwen2moe/weights.py), its gate a
D-vector."""

from __future__ import annotations

from moebius.config import ModelConfig
from moebius.models.qwen2moe.config import Qwen2MoeFields
from moebius.models.specs import FloorTerms
from moebius.parallel.layout import Layout


def floor_terms(cfg: ModelConfig, lay: Layout) -> FloorTerms:
    ext = cfg.extra
    if not isinstance(ext, Qwen2MoeFields):
        raise TypeError(f"ModelConfig.extra of a {cfg.family!r} model is {type(ext).__name__}, not Qwen2MoeFields")
    D, d, L, spec = cfg.hidden_size, cfg.head_dim, cfg.num_layers, cfg.kv_spec
    qh, kvh = lay.num_heads, lay.num_kv_heads
    moe = sum(1 for i in range(L) if cfg.is_moe_layer(i))
    return FloorTerms(
        attn_weights=L * (D * qh * d * 2 + D * kvh * d * 2),  # q and o of its heads, k and v of its KV heads
        dense_weights=(L - moe) * 3 * D * lay.dense_inter,  # mlp_only_layers (none in the published configs)
        kv_per_token=L * kvh * spec.parts * spec.dim,
        attn_flops_per_key=L * 4 * qh * d,  # q.k and p.v of each of its heads
        moe_layers=moe,
        shared_weights=moe * (3 * D * ext.shared_intermediate_size / lay.world_size + D),
    )
