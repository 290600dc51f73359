"""Multi-head latent attention (MLA, DeepSeek-V2 / V3), the torch reference: transformers' DeepseekV3Attention and
DeepseekV2Attention over a paged latent cache.

A token's cache entry is its normalised latent and its roped rope key, C + R values in a paged cache [pages,
page_size, C + R] addressed like moebius/layers/attention.py's K/V cache (slot_mapping to write, block tables to
read). Two forms attend over it: `expanded` (the latents up-projected to per-head keys and values, as transformers
does; for prompt chunks) and `absorbed` (the key up-projection folded into the query and the value up-projection
applied after the weighted latent sum, so the cache is read once and never expanded; for decode). Layout-free: the
heads are those of the weights handed in (a TP shard is a leading slice of heads, `head_slice`), the latent cache is
the same on every shard, and the output is this shard's part of o_proj's sum.

Shapes: T tokens, D hidden, H heads (this shard's), N qk_nope_head_dim, R qk_rope_head_dim, V v_head_dim,
C kv_lora_rank (the latent), L q_lora_rank; Q = H * (N + R) (q's width), A = C + R (one cache entry),
U = H * (N + V) (kv_b_proj's rows), O = H * V (o_proj's input); B sequences, S keys of a sequence, P pages.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from moebius.config import ConfigError
from moebius.kernels import DEFAULT_KERNELS, KernelConfig, triton_available
from moebius.layers import rotary
from moebius.layers.attention import AttentionMetadata, select_sequences
from moebius.layers.linear import linear
from moebius.layers.norm import rms_norm
from moebius.layers.rotary import YarnScaling, apply_rope, yarn_mscale

# transformers builds q_a_layernorm and kv_a_layernorm with DeepseekV3RMSNorm's default eps, not rms_norm_eps
# (DeepSeek's reference code does the same)
LATENT_NORM_EPS = 1e-6


@dataclass(frozen=True)
class MLAConfig:
    """The attention's fields of a DeepSeek-V2 / V3 config (`from_hf`)."""

    hidden_size: int
    num_heads: int  # the whole model's; a shard's count comes from its weights
    q_lora_rank: int | None  # None: q projected directly (q_proj)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_theta: float
    rope_interleave: bool  # the checkpoint's rope dims in (even, odd) pairs, each pair one frequency
    yarn: YarnScaling | None  # None: plain rope
    max_position_embeddings: int
    rms_norm_eps: float  # the decoder layers' norms (the latent norms use LATENT_NORM_EPS)
    attention_bias: bool  # q_a_proj, kv_a_proj_with_mqa and o_proj carry a bias

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> MLAConfig:
        """From a transformers config dict (config.json): the legacy `rope_scaling` + `rope_theta` or transformers
        5's `rope_parameters`, taken in transformers' order of precedence."""
        rope = dict(config.get("rope_scaling") or config.get("rope_parameters") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        max_pos = int(config.get("max_position_embeddings", 4096))
        yarn = None
        if rope_type == "yarn":
            yarn = YarnScaling.from_rope(rope, max_pos, config.get("original_max_position_embeddings"))
        elif rope_type != "default":
            raise ConfigError(f"rope scaling {rope_type!r} is not supported for MLA (only default and yarn)")
        q_lora = config.get("q_lora_rank")
        return cls(
            hidden_size=int(config["hidden_size"]), num_heads=int(config["num_attention_heads"]),
            q_lora_rank=None if q_lora is None else int(q_lora), kv_lora_rank=int(config["kv_lora_rank"]),
            qk_nope_head_dim=int(config["qk_nope_head_dim"]), qk_rope_head_dim=int(config["qk_rope_head_dim"]),
            v_head_dim=int(config["v_head_dim"]),
            rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
            # DeepseekV2Attention always rotates interleaved pairs (complex rope) and has no such field
            rope_interleave=config.get("model_type") == "deepseek_v2" or bool(config.get("rope_interleave", True)),
            yarn=yarn, max_position_embeddings=max_pos, rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            attention_bias=bool(config.get("attention_bias", False)))

    @property
    def cache_dim(self) -> int:
        """Values one token's cache entry holds: the latent, then the rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """transformers' `yarn_apply_mscale`: YaRN scales the whole q.k (rope and nope dims) by mscale_all_dim's
        mscale squared, beside the attention factor its rope tables carry."""
        scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
        if self.yarn is not None and self.yarn.mscale_all_dim:
            scale *= yarn_mscale(self.yarn.factor, self.yarn.mscale_all_dim) ** 2
        return scale


def rope_frequencies(cfg: MLAConfig) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [R / 2] float32, the factor cos and sin are multiplied by) over the R rope dims."""
    return rotary.rope_frequencies(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.yarn)


def rope_table(cfg: MLAConfig, max_pos: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[max_pos, R] float32: cos in the first half, sin in the second, both times YaRN's attention factor (the
    table moebius.layers.rotary.apply_rope reads)."""
    return rotary.scaled_rope_table(cfg.qk_rope_head_dim, max_pos, cfg.rope_theta, cfg.yarn, device)


def apply_mla_rope(x_TXR: torch.Tensor, positions_T: torch.Tensor, table: torch.Tensor, interleave: bool
                   ) -> torch.Tensor:
    """Rotate the rope dims of each token (X: heads, or none). Interleaved checkpoints pair dims (2i, 2i + 1); the
    result is laid out in halves [evens | odds], as transformers' apply_rotary_pos_emb_interleave leaves it (V2's
    complex rope keeps the pairs in place: the same dot products, its dims permuted)."""
    if interleave:
        x_TXR = torch.cat([x_TXR[..., 0::2], x_TXR[..., 1::2]], dim=-1)
    return apply_rope(x_TXR, positions_T, table)


@dataclass
class MLAWeights:
    """One layer's attention weights, in the checkpoint's shapes; q_b / q, kv_b and o may hold a slice of heads."""

    q_a_LD: torch.Tensor | None  # q_a_proj; None when q is projected directly
    q_a_bias: torch.Tensor | None  # [L]
    q_a_norm: torch.Tensor | None  # [L], q_a_layernorm
    q_QL: torch.Tensor  # q_b_proj [Q, L], or q_proj [Q, D] without q-LoRA: per head N nope then R rope rows
    kv_a_AD: torch.Tensor  # kv_a_proj_with_mqa: the latent's C rows then the rope key's R
    kv_a_bias: torch.Tensor | None  # [A]
    kv_a_norm: torch.Tensor  # [C], kv_a_layernorm
    kv_b_UC: torch.Tensor  # kv_b_proj: per head N key rows then V value rows
    o_DO: torch.Tensor  # o_proj
    o_bias: torch.Tensor | None  # [D]; give it to one shard only, so that the sum over shards adds it once

    # the names the engine asks any attention's weights by: its first projection of x (the runner picks a launch
    # order by its size) and its output projection (the diagnostics list the resident views' addresses)
    @property
    def qkv_QD(self) -> torch.Tensor:
        return self.q_QL if self.q_a_LD is None else self.q_a_LD

    @property
    def o_DQ(self) -> torch.Tensor:
        return self.o_DO


def head_slice(w: MLAWeights, cfg: MLAConfig, h0: int, h1: int, *, with_bias: bool = True) -> MLAWeights:
    """The weights of heads [h0, h1) (a TP shard): rows of q_b / q and kv_b, columns of o_proj. The latent
    projections are every head's. with_bias=False drops o_proj's bias (every shard but one)."""
    qk, kv, v = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.v_head_dim
    return replace(w, q_QL=w.q_QL[h0 * qk: h1 * qk], kv_b_UC=w.kv_b_UC[h0 * kv: h1 * kv],
                   o_DO=w.o_DO[:, h0 * v: h1 * v], o_bias=w.o_bias if with_bias else None)


def projections(x_TD: torch.Tensor, w: MLAWeights, kc: KernelConfig = DEFAULT_KERNELS
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [T, H (N + R)]: each head's nope then rope values, kv_a's output [T, C + R]: the latent then the rope key)."""
    if w.q_a_LD is None:
        q = linear(x_TD, w.q_QL, kc=kc)
    else:
        q = linear(rms_norm(linear(x_TD, w.q_a_LD, w.q_a_bias, kc=kc), w.q_a_norm, LATENT_NORM_EPS), w.q_QL, kc=kc)
    return q, linear(x_TD, w.kv_a_AD, w.kv_a_bias, kc=kc)


def project(x_TD: torch.Tensor, w: MLAWeights, cfg: MLAConfig, positions_T: torch.Tensor, table: torch.Tensor, *,
            kc: KernelConfig = DEFAULT_KERNELS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q_nope [T, H, N], q_rope [T, H, R] roped, the cache entries [T, A]: normalised latent then roped key)."""
    N, R = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    q, kv = projections(x_TD, w, kc)
    q_nope_THN, q_rope_THR = q.unflatten(-1, (-1, N + R)).split([N, R], dim=-1)
    latent_TC, k_rope_TR = kv.split([cfg.kv_lora_rank, R], dim=-1)
    q_rope_THR = apply_mla_rope(q_rope_THR, positions_T, table, cfg.rope_interleave)
    k_rope_TR = apply_mla_rope(k_rope_TR[:, None], positions_T, table, cfg.rope_interleave)[:, 0]
    entry_TA = torch.cat([rms_norm(latent_TC, w.kv_a_norm, LATENT_NORM_EPS), k_rope_TR], dim=-1)
    return q_nope_THN, q_rope_THR, entry_TA


def write_latent(cache_PSA: torch.Tensor, entry_TA: torch.Tensor, meta: AttentionMetadata) -> None:
    """Store this step's cache entries in their pages (slot = page * page_size + offset)."""
    if entry_TA.shape[0] == 0:
        return
    cache_PSA[meta.slot_mapping // meta.block_size, meta.slot_mapping % meta.block_size] = entry_TA


def _gather(cache_PSA: torch.Tensor, meta: AttentionMetadata, C: int
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each sequence's latents [B, S, C] and rope keys [B, S, R] through its block table, padded to the longest
    (zeros past its end: a page's unwritten rest may hold NaN, and 0 * NaN is NaN), and the causal mask [B, Q, S]
    of its new tokens."""
    j = torch.arange(meta.max_seq_len, device=cache_PSA.device)
    entries = cache_PSA[meta.block_tables[:, j // meta.block_size].long(), j % meta.block_size]
    entries = torch.where((j[None, :] < meta.seq_lens[:, None])[:, :, None], entries, 0)
    q_len = meta.query_start_loc[1:] - meta.query_start_loc[:-1]
    qpos_BQ = (meta.seq_lens - q_len)[:, None] + torch.arange(meta.max_query_len, device=j.device)[None, :]
    latent_BSC, k_rope_BSR = entries.split([C, entries.shape[-1] - C], dim=-1)
    return latent_BSC, k_rope_BSR, j[None, None, :] <= qpos_BQ[:, :, None]


def _up_projections(kv_b_UC: torch.Tensor, H: int, N: int) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_b_proj per head: the key up-projection W_UK [H, N, C] and the value up-projection W_UV [H, V, C]."""
    wkv_HXC = kv_b_UC.unflatten(0, (H, -1))
    wk_HNC, wv_HVC = wkv_HXC.split([N, wkv_HXC.shape[1] - N], dim=1)
    return wk_HNC, wv_HVC


def _padded(x_TX: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """[T, ...] -> [B, Q, ...]: each new token at its sequence and place in the chunk (zeros elsewhere)."""
    out = x_TX.new_zeros(meta.seq_lens.shape[0], meta.max_query_len, *x_TX.shape[1:])
    out[meta.token_seq, meta.token_qpos] = x_TX
    return out


def _softmax(scores_BHQS: torch.Tensor, mask_BQS: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """transformers' eager order: scale, mask, softmax in float32, back to the activations' dtype."""
    scores = scores_BHQS.float() * scale
    scores.masked_fill_(~mask_BQS[:, None], float("-inf"))
    return torch.softmax(scores, dim=-1).to(dtype)


def expanded(q_nope_THN: torch.Tensor, q_rope_THR: torch.Tensor, cache_PSA: torch.Tensor, kv_b_UC: torch.Tensor,
             meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """[T, H, V]: every cached latent of the step's sequences up-projected through kv_b to per-head keys (with the
    shared rope key) and values, causal attention over them (transformers' expand_kv and eager attention)."""
    T, H, N = q_nope_THN.shape
    wk_HNC, wv_HVC = _up_projections(kv_b_UC, H, N)
    if T == 0:  # a rank with no requests this step still runs the layer for its collectives
        return q_nope_THN.new_zeros(0, H, wv_HVC.shape[1])
    latent_BSC, k_rope_BSR, mask_BQS = _gather(cache_PSA, meta, kv_b_UC.shape[1])
    k_nope_BSHN = torch.einsum("bsc,hnc->bshn", latent_BSC, wk_HNC)
    v_BSHV = torch.einsum("bsc,hvc->bshv", latent_BSC, wv_HVC)
    k_BSHK = torch.cat([k_nope_BSHN, k_rope_BSR[:, :, None].expand(-1, -1, H, -1)], dim=-1)
    q_BQHK = _padded(torch.cat([q_nope_THN, q_rope_THR], dim=-1), meta)
    probs = _softmax(torch.einsum("bqhk,bshk->bhqs", q_BQHK, k_BSHK), mask_BQS, scale, q_nope_THN.dtype)
    out_BQHV = torch.einsum("bhqs,bshv->bqhv", probs, v_BSHV)
    return out_BQHV[meta.token_seq, meta.token_qpos]


def absorbed(q_nope_THN: torch.Tensor, q_rope_THR: torch.Tensor, cache_PSA: torch.Tensor, kv_b_UC: torch.Tensor,
             meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """[T, H, V], equal to `expanded`, reading the latents as they are: q_nope @ W_UK per head scores against the
    latent, q_rope against the rope key; the weighted latent sum goes through W_UV per head after the softmax."""
    T, H, N = q_nope_THN.shape
    wk_HNC, wv_HVC = _up_projections(kv_b_UC, H, N)
    if T == 0:
        return q_nope_THN.new_zeros(0, H, wv_HVC.shape[1])
    latent_BSC, k_rope_BSR, mask_BQS = _gather(cache_PSA, meta, kv_b_UC.shape[1])
    q_latent_BQHC = _padded(torch.einsum("thn,hnc->thc", q_nope_THN, wk_HNC), meta)
    scores = (torch.einsum("bqhc,bsc->bhqs", q_latent_BQHC, latent_BSC)
              + torch.einsum("bqhr,bsr->bhqs", _padded(q_rope_THR, meta), k_rope_BSR))
    probs = _softmax(scores, mask_BQS, scale, q_nope_THN.dtype)
    o_latent_BQHC = torch.einsum("bhqs,bsc->bqhc", probs, latent_BSC)
    return torch.einsum("thc,hvc->thv", o_latent_BQHC[meta.token_seq, meta.token_qpos], wv_HVC)


def latent_kernels(q_latent_THC: torch.Tensor, q_rope_THR: torch.Tensor, cache_PSA: torch.Tensor,
                   meta: AttentionMetadata, scale: float, *, kc: KernelConfig = DEFAULT_KERNELS,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """The weighted latent sums [T, H, C] of an absorbed query (q_latent = q_nope through W_UK) through the Triton
    kernels (moebius/kernels/mla.py): a step of decodes only (max_query_len == 1) in the decode launch with
    meta.num_splits; with prompt chunks, the leading meta.decodes one-token sequences in the decode launch (the
    splits are theirs) and the sequences after them in the causal chunk launch. Reads no value the host would wait
    for (graph and overlap safe)."""
    from moebius.kernels.mla import latent_chunk_attention, latent_decode_attention

    out = torch.empty_like(q_latent_THC) if out is None else out
    if meta.max_query_len == 1:
        return latent_decode_attention(q_latent_THC, q_rope_THR, cache_PSA, meta.block_tables, meta.seq_lens,
                                       meta.query_start_loc, scale, meta.num_splits, kc=kc, out=out)
    d = meta.decodes
    if d:
        latent_decode_attention(q_latent_THC[:d], q_rope_THR[:d], cache_PSA, meta.block_tables[:d],
                                meta.seq_lens[:d], meta.query_start_loc[: d + 1], scale, meta.num_splits, kc=kc,
                                out=out[:d])
    # (query_start_loc[d:] still counts from the step's first token: the chunks' rows of the whole q and out)
    latent_chunk_attention(q_latent_THC, q_rope_THR, cache_PSA, meta.block_tables[d:], meta.seq_lens[d:],
                           meta.query_start_loc[d:], meta.max_query_len, scale, kc=kc, out=out)
    return out


def absorbed_kernel(q_nope_THN: torch.Tensor, q_rope_THR: torch.Tensor, cache_PSA: torch.Tensor,
                    kv_b_UC: torch.Tensor, meta: AttentionMetadata, scale: float, *,
                    kc: KernelConfig = DEFAULT_KERNELS) -> torch.Tensor:
    """`absorbed` through the Triton kernels (`latent_kernels`): W_UK folded into the query here, the kernels'
    weighted latent sums through W_UV."""
    T, H, N = q_nope_THN.shape
    wk_HNC, wv_HVC = _up_projections(kv_b_UC, H, N)
    if T == 0:
        return q_nope_THN.new_zeros(0, H, wv_HVC.shape[1])
    o_latent_THC = torch.empty(H, T, wk_HNC.shape[2], dtype=q_nope_THN.dtype, device=q_nope_THN.device).transpose(0, 1)
    latent_kernels(_absorb(q_nope_THN, wk_HNC), q_rope_THR, cache_PSA, meta, scale, kc=kc, out=o_latent_THC)
    return _unabsorb(o_latent_THC, wv_HVC)


def _absorb(q_nope_THN: torch.Tensor, wk_HNC: torch.Tensor, out_THC: torch.Tensor | None = None) -> torch.Tensor:
    """q_latent [T, H, C] = q_nope through W_UK, head by head: one batched GEMM over head-major views of both (the
    kernels take any token and head strides), where einsum's permutes copied a [T, H, C] tensor a layer
    (benchmarks/results/h100-p1-decode-profile-deepseek-big.json). Head-major in memory unless `out` is given."""
    if out_THC is None:
        return torch.bmm(q_nope_THN.transpose(0, 1), wk_HNC).transpose(0, 1)
    torch.bmm(q_nope_THN.transpose(0, 1), wk_HNC, out=out_THC.transpose(0, 1))
    return out_THC


def _unabsorb(o_latent_THC: torch.Tensor, wv_HVC: torch.Tensor) -> torch.Tensor:
    """[T, H, V] (contiguous: o_proj's input) = the weighted latent sums through W_UV, head by head, in one batched
    GEMM writing its token-major result in place."""
    T, H = o_latent_THC.shape[:2]
    o_THV = o_latent_THC.new_empty(T, H, wv_HVC.shape[1])
    torch.bmm(o_latent_THC.transpose(0, 1), wv_HVC.transpose(1, 2), out=o_THV.transpose(0, 1))
    return o_THV


def latent_attention(q_nope_THN: torch.Tensor, q_rope_THR: torch.Tensor, cache_PSA: torch.Tensor,
                     kv_b_UC: torch.Tensor, meta: AttentionMetadata, scale: float, absorb: bool | None = None, *,
                     kc: KernelConfig = DEFAULT_KERNELS) -> torch.Tensor:
    """[T, H, V] over the paged latent cache. absorb=None: on CUDA absorbed through the Triton kernels
    (`absorbed_kernel`); on the CPU the sequences bringing one token (decodes) absorbed, since that reads their
    cache once, the prompt chunks expanded (apart, so that no decode is padded to a chunk's length nor its cache
    expanded). True / False: one form for every sequence (True on CUDA: the kernels)."""
    if q_nope_THN.is_cuda and triton_available() and absorb is not False:
        return absorbed_kernel(q_nope_THN, q_rope_THR, cache_PSA, kv_b_UC, meta, scale, kc=kc)
    if absorb is not None:
        return (absorbed if absorb else expanded)(q_nope_THN, q_rope_THR, cache_PSA, kv_b_UC, meta, scale)
    decode_B = (meta.query_start_loc[1:] - meta.query_start_loc[:-1]) == 1
    if meta.max_query_len == 1 or not bool(decode_B.any()):
        return latent_attention(q_nope_THN, q_rope_THR, cache_PSA, kv_b_UC, meta, scale, meta.max_query_len == 1)
    T, H, N = q_nope_THN.shape
    out = q_nope_THN.new_empty(T, H, kv_b_UC.shape[0] // H - N)
    for sel, absorb_sel in ((decode_B, True), (~decode_B, False)):
        sub, rows = select_sequences(meta, sel)
        out[rows] = latent_attention(q_nope_THN[rows], q_rope_THR[rows], cache_PSA, kv_b_UC, sub, scale, absorb_sel)
    return out


def attend_absorbed(q_THA: torch.Tensor, cache_PSA: torch.Tensor, meta: AttentionMetadata, scale: float,
                    kc: KernelConfig, out_THC: torch.Tensor) -> None:
    """A layer's attention between two step pieces: the absorbed query [T, H, C + R] (q_latent then q_rope, as
    `mla_attention` writes it into the pieces' buffer) over the cache, its weighted latent sums into out [T, H, C]
    (the kernels: pieces run on the GPU only)."""
    C = out_THC.shape[2]
    latent_kernels(q_THA[..., :C], q_THA[..., C:], cache_PSA, meta, scale, kc=kc, out=out_THC)


def mla_attention(x_TD: torch.Tensor, w: MLAWeights, cache_PSA: torch.Tensor, meta: AttentionMetadata,
                  cfg: MLAConfig, table: torch.Tensor, *, absorb: bool | None = None,
                  kc: KernelConfig = DEFAULT_KERNELS) -> torch.Tensor:
    """This shard's heads' part of o_proj's output [T, D] (the whole output with every head; a sum over shards
    otherwise); the step's cache entries are written first. absorb: the form, as `latent_attention` takes it."""
    if x_TD.is_cuda and triton_available():  # rope, the latent's norm and the cache write in one launch
        from moebius.kernels.mla import rope_latent

        N = cfg.qk_nope_head_dim
        q, kv = projections(x_TD, w, kc)
        q_nope_THN = q.unflatten(-1, (-1, N + cfg.qk_rope_head_dim))[..., :N]
        q_rope_THR = rope_latent(q, kv, w.kv_a_norm, table, meta.positions, meta.slot_mapping, cache_PSA,
                                 q_nope_THN.shape[1], N, LATENT_NORM_EPS, cfg.rope_interleave, kc=kc)
    else:
        q_nope_THN, q_rope_THR, entry_TA = project(x_TD, w, cfg, meta.positions, table, kc=kc)
        write_latent(cache_PSA, entry_TA, meta)
    if meta.cut is not None:  # captured in pieces: the absorbed query into the static buffer, attention between
        T, H, N = q_nope_THN.shape
        wk_HNC, wv_HVC = _up_projections(w.kv_b_UC, H, N)
        q_THA = meta.cut.q_buffer(T)
        _absorb(q_nope_THN, wk_HNC, q_THA[..., : cfg.kv_lora_rank])
        q_THA[..., cfg.kv_lora_rank:] = q_rope_THR
        o_THV = _unabsorb(meta.cut.attend(q_THA, cache_PSA, cfg.softmax_scale, kc), wv_HVC)
    else:
        o_THV = latent_attention(q_nope_THN, q_rope_THR, cache_PSA, w.kv_b_UC, meta, cfg.softmax_scale, absorb,
                                 kc=kc)
    return linear(o_THV.flatten(1), w.o_DO, w.o_bias, kc=kc)
