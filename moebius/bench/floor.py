"""Floors: the least time a decode step can take on the given hardware (the project's copy of the reference model
in ../shared/tools/floor.py, in terms of ModelConfig; tests check the two agree).

floor = max(HBM bytes / HBM bandwidth, FLOPs / matmul rate) + link bytes / link bandwidth, where HBM bytes count the
layout's attention weights, the distinct experts the batch hits (uniform routing), the batch's KV, the MoE
activations of the (token, expert) pairs a rank computes, and the lm_head; link bytes are TP's two all-reduces per
layer or EP's dispatch + combine per layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from moebius.config import ModelConfig


@dataclass(frozen=True)
class Hardware:
    hbm_bytes_per_s: float = 4.28e12  # H200 device-to-device copy, read + write counted (measured)
    link_bytes_per_s: float = 395e9  # H200 -> H200 peer copy over NVLink, one direction (measured)
    bf16_flops: float = 790e12  # dense bf16 matmul on random data (measured)


def _experts_hit(cfg: ModelConfig, tokens: float, candidates: float) -> float:
    """Expected distinct experts hit among `candidates` when `tokens` tokens each pick top-k of E uniformly."""
    return 0.0 if tokens <= 0 else candidates * (1.0 - (1.0 - cfg.top_k / cfg.num_experts) ** tokens)


def decode_step_floor_ms(cfg: ModelConfig, P: int, mode: str, batch: int, context: int, dtype_bytes: int = 2,
                         hw: Hardware = Hardware()) -> float:
    b, D, d, L = dtype_bytes, cfg.hidden_size, cfg.head_dim, cfg.num_layers
    expert = 3 * D * cfg.moe_intermediate_size  # elements of one whole expert
    lm_head = cfg.vocab_size * D
    if mode == "tp":
        toks, kvh, qh = batch, max(1, cfg.num_kv_heads // P), cfg.num_heads // P
        attn_w = D * qh * d * 2 + D * kvh * d * 2
        moe_w = _experts_hit(cfg, batch, cfg.num_experts) * expert / P
        kv = batch * context * kvh * d * 2
        lm = lm_head / P
        pairs, inter = batch * cfg.top_k, cfg.moe_intermediate_size / P
        flops = L * (toks * (2 * attn_w + 2 * cfg.top_k * expert / P) + 4 * batch * context * qh * d) + 2 * lm * toks
        link = 2 * (2 * (P - 1) / P) * batch * D * b if P > 1 else 0.0
    elif mode == "ep":
        toks, kvh, qh = math.ceil(batch / P), cfg.num_kv_heads, cfg.num_heads
        attn_w = D * qh * d * 2 + D * kvh * d * 2
        moe_w = _experts_hit(cfg, batch, cfg.num_experts / P) * expert
        kv = toks * context * kvh * d * 2
        lm = lm_head
        pairs, inter = batch * cfg.top_k / P, cfg.moe_intermediate_size
        flops = (L * (toks * 2 * attn_w + 2 * cfg.top_k * batch / P * expert + 4 * toks * context * qh * d)
                 + 2 * lm * toks)
        remote = (P - 1) * (1.0 - (1.0 - 1.0 / P) ** cfg.top_k) if P > 1 else 0.0
        link = 2 * toks * remote * D * b
    else:
        raise ValueError(f"mode must be tp or ep, not {mode!r}")
    moe_act = pairs * (3 * D + 2 * inter) * b
    hbm = L * ((attn_w + moe_w + kv) * b + moe_act) + lm * b
    t = max(hbm / hw.hbm_bytes_per_s, flops / hw.bf16_flops) + L * link / hw.link_bytes_per_s
    return t * 1e3


def switch_floor_ms(cfg: ModelConfig, P: int, kv_tokens: int, dtype_bytes: int = 2, hw: Hardware = Hardware()
                    ) -> float:
    """The least time one EP <-> TP switch can take on a rank: the bytes whose owner changes over the link (one
    direction; the KV of `kv_tokens` live tokens counted the EP -> TP way, the larger), plus the local share of the
    experts read and written in HBM."""
    b, L = dtype_bytes, cfg.num_layers
    experts = L * cfg.num_experts * 3 * cfg.hidden_size * cfg.moe_intermediate_size * b / P  # a rank's, either way
    remote, local = experts * (P - 1) / P, experts / P
    replicas = max(1, P // cfg.num_kv_heads)  # TP holds each KV head on this many ranks
    kv = kv_tokens * L * cfg.num_kv_heads * cfg.head_dim * 2 * b / P * (P - 1) / P * replicas
    return ((remote + kv) / hw.link_bytes_per_s + 2 * local / hw.hbm_bytes_per_s) * 1e3

