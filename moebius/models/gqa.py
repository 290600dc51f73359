"""Grouped-query attention as the GQA families share it (Qwen3-MoE, and the families that differ from it only in
their options): the weights (`AttnWeights`), their specs with Hugging Face's names (`attention_specs`: q|k|v fused
and cut by heads, o_proj by columns, optional per-head q/k norms and q|k|v bias), the forward (`attention`), and
what the runner asks of it (`attention_geometry`, `attend`). Shapes: T tokens, D hidden, H heads, d head dim."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from moebius.config import ModelConfig
from moebius.kernels import KernelConfig
from moebius.kernels.fp8_rows import column_block
from moebius.layers.attention import AttentionGeometry, AttentionMetadata, paged_attention, qkv_attention
from moebius.layers.linear import linear
from moebius.models.specs import Fetch, FloorTerms, ParamSpec, linear_spec
from moebius.models.weights import ModelWeights
from moebius.parallel.layout import Layout


@dataclass
class AttnWeights:
    qkv_QD: torch.Tensor  # [(H + 2 * kvH) * d, D]: this rank's q heads, then k heads, then v heads
    qkv_bias: torch.Tensor | None
    o_DQ: torch.Tensor  # [D, H * d]
    q_norm: torch.Tensor | None  # [d], per head; None: no q/k norm
    k_norm: torch.Tensor | None  # [d]


def attention(x_TD: torch.Tensor, w: AttnWeights, cache: torch.Tensor, meta: AttentionMetadata,
              cfg: ModelConfig, rope: torch.Tensor, kc: KernelConfig, window: int | None = None) -> torch.Tensor:
    """This rank's heads' share of the output projection (in TP a partial sum over ranks). window: a sliding-window
    layer's (`meta` then its KV group's)."""
    qkv = linear(x_TD, w.qkv_QD, w.qkv_bias, kc=kc)
    o = qkv_attention(qkv, w.q_norm, w.k_norm, rope, cache, meta, cfg.rms_norm_eps, cfg.head_dim ** -0.5, kc=kc,
                      window=window)
    return linear(o.flatten(1), w.o_DQ, kc=kc)


def attention_geometry(cfg: ModelConfig, weights: ModelWeights, kv: list[torch.Tensor]) -> AttentionGeometry:
    """A rank's GQA attention: q and the output per head of head_dim; a decoding sequence's programs are its KV
    heads; query blocks group the query heads of a KV head."""
    kvh, d = kv[0].shape[3], kv[0].shape[4]
    heads = weights.layers[0].attn.qkv_QD.shape[0] // d - 2 * kvh
    return AttentionGeometry(heads=heads, q_dim=d, o_dim=d, split_units=kvh, group=heads // kvh)


def attend(q_THd: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, scale: float, kc: KernelConfig,
           out: torch.Tensor, *, window: int | None = None, sinks: torch.Tensor | None = None) -> None:
    """A layer's attention between two step pieces (q written by the piece before, `out` read by the one after);
    window / sinks: a sliding-window layer's, learned sink logits (`paged_attention`'s)."""
    paged_attention(q_THd, cache, meta, scale, kc=kc, out=out, window=window, sinks=sinks)


def attn_tag(lay: Layout) -> str:
    """Names an attention shard by the heads it holds, so layouts holding the same heads share the region."""
    return f"q{lay.q_heads.start}-{lay.q_heads.stop}.kv{lay.kv_heads.start}-{lay.kv_heads.stop}"


def attention_specs(cfg: ModelConfig, lay: Layout, p: str, *, qk_norm: bool, bias: bool) -> list[ParamSpec]:
    """Layer `p`'s attention views (`p`: its name prefix, "model.layers.{i}."): q|k|v of this layout's heads fused,
    o_proj's columns of its q heads, the per-head q/k norms (qk_norm) and the q|k|v bias (bias), read from
    self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm."""
    D, d = cfg.hidden_size, cfg.head_dim
    qh, kvh, tag = lay.q_heads, lay.kv_heads, attn_tag(lay)
    rows = (len(qh) + 2 * len(kvh)) * d

    def qkv(kind: str) -> Callable[[Fetch], torch.Tensor]:
        def load(fetch: Fetch) -> torch.Tensor:
            shape = (lambda n: (n, D)) if kind == "weight" else (lambda n: (n,))
            q = fetch(p + f"self_attn.q_proj.{kind}", shape(cfg.q_size))
            k = fetch(p + f"self_attn.k_proj.{kind}", shape(cfg.kv_size))
            v = fetch(p + f"self_attn.v_proj.{kind}", shape(cfg.kv_size))
            return torch.cat([lay.shard_heads(q, qh, cfg.num_heads), lay.shard_heads(k, kvh, cfg.num_kv_heads),
                              lay.shard_heads(v, kvh, cfg.num_kv_heads)])
        return load

    specs = [
        linear_spec(cfg, p + f"qkv.{tag}", (rows, D), qkv("weight")),
        linear_spec(cfg, p + f"o_proj.{tag}", (D, len(qh) * d), lambda f: column_block(
            f(p + "self_attn.o_proj.weight", (D, cfg.q_size)), qh.start * d, qh.stop * d),
            columns=(cfg.q_size, lay.world_size), cut=lay.tp),
    ]
    if qk_norm:
        specs += [ParamSpec(p + "q_norm", (d,), lambda f: f(p + "self_attn.q_norm.weight", (d,))),
                  ParamSpec(p + "k_norm", (d,), lambda f: f(p + "self_attn.k_norm.weight", (d,)))]
    if bias:
        specs.append(ParamSpec(p + f"qkv_bias.{tag}", (rows,), qkv("bias")))
    return specs


def attention_weights(views: dict[str, torch.Tensor], lay: Layout, p: str) -> AttnWeights:
    """Layer `p`'s `AttnWeights` from the views of `attention_specs` (the optional ones where specified)."""
    tag = attn_tag(lay)
    return AttnWeights(views[p + f"qkv.{tag}"], views.get(p + f"qkv_bias.{tag}"), views[p + f"o_proj.{tag}"],
                       views.get(p + "q_norm"), views.get(p + "k_norm"))


def floor_terms(cfg: ModelConfig, lay: Layout, *, attn_extra: float = 0.0, shared_weights: float = 0.0) -> FloorTerms:
    """GQA's terms of the floor model (`FloorTerms`): a layout's q and o rows of its query heads, k and v of its KV
    heads (replicated in TP below P), head_dim each, K and V cached per KV head; dense MLP layers by the layout's
    shard (none in all-MoE families). A family adds attn_extra (attention elements a layer beyond these: OLMoE's
    whole-projection norms) and shared_weights (elements every rank runs on every token: shared experts' shards);
    biases and per-head norms are left out, as norms are. Sliding-window layers' cache and attention terms are apart
    (`FloorTerms.window`: the largest window)."""
    D, d, L, spec = cfg.hidden_size, cfg.head_dim, cfg.num_layers, cfg.kv_spec
    qh, kvh = lay.num_heads, lay.num_kv_heads
    moe = sum(1 for i in range(L) if cfg.is_moe_layer(i))
    windows = [w for w in map(cfg.layer_window, range(L)) if w is not None]
    full = L - len(windows)
    return FloorTerms(
        attn_weights=L * (D * qh * d * 2 + D * kvh * d * 2 + attn_extra),
        dense_weights=(L - moe) * 3 * D * lay.dense_inter,
        kv_per_token=full * kvh * spec.parts * spec.dim,
        attn_flops_per_key=full * 4 * qh * d,  # q.k and p.v of each of its heads
        moe_layers=moe,
        shared_weights=shared_weights,
        window_kv_per_token=len(windows) * kvh * spec.parts * spec.dim,
        window_attn_flops_per_key=len(windows) * 4 * qh * d,
        window=cfg.largest_window,
    )
