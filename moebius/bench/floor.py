"""Floors: the least time a decode step, any engine step (prefill chunks and decodes mixed) and a switch can take on
the given hardware (the decode and switch floors are the project's copy of the team's reference model, in terms of
ModelConfig; tests check the two agree).

floor = max(HBM bytes / HBM bandwidth, FLOPs / matmul rate) + link bytes / link bandwidth, where HBM bytes count the
layout's attention weights, the distinct experts the batch hits (uniform routing), the batch's KV, the MoE
activations of the (token, expert) pairs a rank computes, and the lm_head; link bytes are TP's two all-reduces per
layer or EP's dispatch + combine per MoE layer. What attention, the cache and the dense parts cost is the model
family's (`Family.floor_terms`: GQA heads for Qwen3-MoE; MLA's projections, its latent cache replicated in TP and
the absorbed form's FLOPs, shared experts and dense first layers for DeepSeek); the rest is the same for every
family.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from moebius.config import ConfigError, ModelConfig
from moebius.kernels.rows import row_format
from moebius.link.messages import StepWork, attended_pairs, split_evenly, window_reads
from moebius.models.registry import family_of
from moebius.models.specs import FloorTerms
from moebius.parallel.layout import (
    MODES,
    Layout,
    expert_slots,
    slot_groups,
    slot_shifts,
    tp_cuts_whole_blocks,
)


@dataclass(frozen=True)
class Hardware:
    hbm_bytes_per_s: float = 4.28e12  # H200 device-to-device copy, read + write counted (measured)
    link_bytes_per_s: float = 395e9  # H200 -> H200 peer copy over NVLink, one direction (measured)
    bf16_flops: float = 790e12  # dense bf16 matmul on random data (measured)
    memory_bytes: float = 143771 * 2**20  # an H200's memory as nvidia-smi gives it (143771 MiB)


# The cards a floor is stated for. The H100's copy rate and bf16 matmul rate were measured on the lent H100 machine
# (the device library's KINDS.md, 2026-11-13); its link is taken as the H200's (the same NVLink 4, not measured).
HARDWARE = {"H200": Hardware(),
            "H100": Hardware(hbm_bytes_per_s=3.0e12, bf16_flops=798e12, memory_bytes=81559 * 2**20)}


def hardware_of(gpu: str) -> Hardware:
    """The floor's figures for the card `gpu` names (torch.cuda.get_device_name, e.g. "NVIDIA H100 80GB HBM3"): an
    H100's or an H200's; the H200's for anything else (a CPU run's floor is one H200's)."""
    return next((hw for card, hw in HARDWARE.items() if card in gpu.upper()), HARDWARE["H200"])


def _experts_hit(cfg: ModelConfig, tokens: float, candidates: float) -> float:
    """Expected distinct experts hit among `candidates` when `tokens` tokens each pick top-k of E uniformly."""
    return 0.0 if tokens <= 0 else candidates * (1.0 - (1.0 - cfg.top_k / cfg.num_experts) ** tokens)


def floor_terms(cfg: ModelConfig, P: int, mode: str) -> FloorTerms:
    """The model's family's terms for a rank of `mode` on P ranks (attention, dense MLPs, cache, shared experts)."""
    if mode not in ("tp", "ep"):
        raise ValueError(f"mode must be tp or ep, not {mode!r}")
    family = family_of(cfg)
    if family.floor_terms is None:
        raise ValueError(f"the {family.name} family gives the floor model no terms (Family.floor_terms)")
    return family.floor_terms(cfg, Layout(cfg, mode, 0, P))


def quantized_bytes_per_element(cfg: ModelConfig, dtype_bytes: int, experts: bool = True) -> float:
    """HBM bytes of a weight element the engine may hold quantized (--quantization, kernels/rows.py): the routed
    experts' (`experts`) or the dense Linear weights' (FP8 only; MXFP4 holds the experts alone): the dtype's, or the
    released format's (`RowFormat.release_bytes_per_value`; FP8: a byte a value and a float32 scale a 128 x 128
    block; MXFP4: half a byte a value and a scale byte a 32-value block; their FLOPs are counted at bf16's rate). Not
    the engine's rows' bytes: the scale each FP8 row repeats and its padding are the engine's cost, not the floor's.
    For the dense weights a lower bound: some stay in the dtype (`specs.linear_spec`: a TP cut inside a chunk, MLA's
    kv_b_proj, what a checkpoint leaves unquantized, all of them with --quantization-scope experts: the FP8 model's
    floor, stricter than that engine's)."""
    fmt = row_format(cfg.quantization)
    if fmt is None or (fmt.experts_only and not experts):
        return dtype_bytes
    return fmt.release_bytes_per_value


def decode_step_terms(cfg: ModelConfig, P: int, mode: str, batch: int, context: int, dtype_bytes: int = 2,
                      hw: Hardware = Hardware()) -> dict[str, float]:
    """A decode step's floor on a rank with its parts: the HBM bytes of each kind (attention and dense MLP weights,
    routed experts, shared experts, the KV read, MoE activations, lm_head), FLOPs, link bytes, and `floor_ms`."""
    b, D = dtype_bytes, cfg.hidden_size
    f = floor_terms(cfg, P, mode)
    Lm = f.moe_layers
    expert = 3 * D * cfg.moe_intermediate_size  # elements of one whole expert
    lm_head = cfg.vocab_size * D
    weights = f.attn_weights + f.dense_weights  # run on the rank's own tokens
    if mode == "tp":
        toks = batch
        moe_w = _experts_hit(cfg, batch, cfg.num_experts) * expert / P
        lm = lm_head / P
        pairs, inter = batch * cfg.top_k, cfg.moe_intermediate_size / P
        routed_flops = Lm * toks * 2 * cfg.top_k * expert / P
        # two all-reduces a layer (attention, MLP)
        link = cfg.num_layers * 2 * (2 * (P - 1) / P) * batch * D * b if P > 1 else 0.0
    else:
        toks = math.ceil(batch / P)
        moe_w = _experts_hit(cfg, batch, cfg.num_experts / P) * expert
        lm = lm_head
        pairs, inter = batch * cfg.top_k / P, cfg.moe_intermediate_size
        routed_flops = Lm * 2 * cfg.top_k * batch / P * expert
        remote = (P - 1) * (1.0 - (1.0 - 1.0 / P) ** cfg.top_k) if P > 1 else 0.0
        link = Lm * 2 * toks * remote * D * b  # dispatch and combine of each MoE layer
    seen = min(context, f.window)  # keys a sliding-window layer's query reads
    flops = (toks * 2 * weights + routed_flops + toks * (context * f.attn_flops_per_key
                                                         + seen * f.window_attn_flops_per_key)
             + batch * 2 * f.shared_weights + 2 * lm * toks)
    wb, eb = quantized_bytes_per_element(cfg, b, experts=False), quantized_bytes_per_element(cfg, b)
    terms = {"weights_bytes": weights * wb, "experts_bytes": Lm * moe_w * eb, "shared_bytes": f.shared_weights * wb,
             "kv_bytes": toks * (context * f.kv_per_token + seen * f.window_kv_per_token) * b,
             "act_bytes": Lm * pairs * (3 * D + 2 * inter) * b,
             "lm_bytes": lm * b}
    hbm = sum(terms.values())
    t = max(hbm / hw.hbm_bytes_per_s, flops / hw.bf16_flops) + link / hw.link_bytes_per_s
    return {**terms, "hbm_bytes": hbm, "flops": flops, "link_bytes": link, "floor_ms": t * 1e3}


def decode_step_floor_ms(cfg: ModelConfig, P: int, mode: str, batch: int, context: int, dtype_bytes: int = 2,
                         hw: Hardware = Hardware()) -> float:
    return decode_step_terms(cfg, P, mode, batch, context, dtype_bytes, hw)["floor_ms"]


def switch_floor_ms(cfg: ModelConfig, P: int, kv_tokens: int, dtype_bytes: int = 2, hw: Hardware = Hardware()
                    ) -> float:
    """The least time one EP <-> TP switch can take on a rank: the bytes whose owner changes over the link (one
    direction; the KV of `kv_tokens` live tokens counted the EP -> TP way, the larger), plus the local share of the
    experts read and written in HBM."""
    b, L = dtype_bytes, cfg.num_layers
    Lm = sum(1 for i in range(L) if cfg.is_moe_layer(i))  # (DeepSeek's dense first layers hold no experts)
    experts = (Lm * cfg.num_experts * 3 * cfg.hidden_size * cfg.moe_intermediate_size
               * quantized_bytes_per_element(cfg, b) / P)  # a rank's, either way
    remote, local = experts * (P - 1) / P, experts / P
    spec = cfg.kv_spec
    replicas = max(1, P // spec.heads)  # TP holds each KV head on this many ranks
    kv = kv_tokens * L * spec.heads * spec.parts * spec.dim * b / P * (P - 1) / P * replicas
    return ((remote + kv) / hw.link_bytes_per_s + 2 * local / hw.hbm_bytes_per_s) * 1e3


def step_floor_ms(cfg: ModelConfig, P: int, mode: str, work: StepWork, dtype_bytes: int = 2,
                  hw: Hardware = Hardware()) -> float:
    """The least time one engine step of this work (prefill chunks and decodes together, `engine.messages.StepWork`)
    can take: as the decode floor, with the step's own terms: weights read once (attention, the experts its tokens
    hit, lm_head when a row samples), the KV its attention reads (every sequence's length) and writes (its new
    tokens), the MoE activations of its (token, expert) pairs; FLOPs of the projections and experts per token,
    attention per (query, key) pair, lm_head per sampled row; TP's all-reduces or EP's exchange per token. EP
    spreads the work evenly over the ranks."""
    b, D, L = dtype_bytes, cfg.hidden_size, cfg.num_layers
    T, expert = work.tokens, 3 * D * cfg.moe_intermediate_size
    ep = mode == "ep"
    f = floor_terms(cfg, P, mode)
    Lm = f.moe_layers
    share = 1.0 / P if ep else 1.0  # of the tokens, KV, pairs and sampled rows a rank computes
    tp = 1 if ep else P  # the tensor-parallel degree of attention, experts and lm_head
    weights = f.attn_weights + f.dense_weights
    moe_w = _experts_hit(cfg, T, cfg.num_experts / (P if ep else 1)) * expert / tp
    # read every sequence's KV, write the new tokens' (sliding-window layers: the keys in each sequence's window)
    kv = ((work.kv_tokens + T) * f.kv_per_token + (work.window_kv_tokens + T) * f.window_kv_per_token) * share
    lm = cfg.vocab_size * D / tp if work.sampled else 0.0
    pairs, inter = T * cfg.top_k * share, cfg.moe_intermediate_size / tp
    # (MLA: the absorbed form's FLOPs a (query, key) pair, though a long prompt chunk may be cheaper expanded)
    flops = (T * share * 2 * weights + Lm * 2 * pairs * expert / tp + work.attended * share * f.attn_flops_per_key
             + work.window_attended * share * f.window_attn_flops_per_key
             + T * 2 * f.shared_weights + 2 * lm * work.sampled * share)
    if ep:
        remote = (P - 1) * (1.0 - (1.0 - 1.0 / P) ** cfg.top_k) if P > 1 else 0.0
        link = Lm * 2 * math.ceil(T / P) * remote * D * b
    else:
        link = L * 2 * (2 * (P - 1) / P) * T * D * b if P > 1 else 0.0
    hbm = (kv * b + (weights + f.shared_weights) * quantized_bytes_per_element(cfg, b, experts=False)
           + Lm * moe_w * quantized_bytes_per_element(cfg, b)
           + Lm * pairs * (3 * D + 2 * inter) * b + lm * b)
    return (max(hbm / hw.hbm_bytes_per_s, flops / hw.bf16_flops) + link / hw.link_bytes_per_s) * 1e3


def prefill_work(tokens: int, prefix: int = 0, sequences: int = 1, decodes: int = 0, decode_context: int = 0,
                 window: int = 0) -> StepWork:
    """Prompt chunks of `tokens` tokens in all, split evenly over `sequences` prompts (`split_evenly`), each after
    `prefix` cached tokens, each prompt's last token sampled; beside them `decodes` requests each decoding a token
    after `decode_context` cached ones (a mixed step). `window`: the model's largest sliding window (0: none,
    `ModelConfig.largest_window`)."""
    chunks = split_evenly(tokens, sequences)
    n = decode_context + 1
    return StepWork(tokens=tokens + decodes, decode_tokens=decodes, sequences=sequences + decodes,
                    kv_tokens=sequences * prefix + tokens + decodes * n,
                    attended=sum(attended_pairs(prefix, c) for c in chunks) + decodes * n, sampled=sequences + decodes,
                    window_kv_tokens=sum(window_reads(prefix, c, window) for c in chunks)
                    + decodes * window_reads(decode_context, 1, window),
                    window_attended=sum(attended_pairs(prefix, c, window) for c in chunks)
                    + decodes * attended_pairs(decode_context, 1, window) if window else 0)


def prefill_floor_ms(cfg: ModelConfig, P: int, mode: str, tokens: int, prefix: int = 0, dtype_bytes: int = 2,
                     hw: Hardware = Hardware()) -> float:
    """The least time a prefill step of one chunk can take (`step_floor_ms` of `prefill_work`)."""
    return step_floor_ms(cfg, P, mode, prefill_work(tokens, prefix, window=cfg.largest_window), dtype_bytes, hw)



def rank_weight_bytes(cfg: ModelConfig, P: int, dtype_bytes: int = 2, shift: int = 1) -> int:
    """Bytes of weights a rank of the switchable engine holds (worker/build.py's plan): the dense regions of both
    layouts (EP's alone where TP cannot cut quantized experts, `tp_cuts_whole_blocks`), each distinct shard once
    (the rope table in float32), and the layer slots' experts (at slot shift `shift`: a slot of dense layers only, or
    a spare of the one layout held, holds none, `expert_slots`)."""
    family, regions = family_of(cfg), {}
    held = MODES if tp_cuts_whole_blocks(cfg, P) else ("ep",)
    for mode in held:
        lay = Layout(cfg, mode, 0, P)
        for s in family.weight_specs(cfg, lay, dtype_bytes):
            if s.slot is None:
                regions[s.name] = math.prod(s.shape) * (s.dtype.itemsize if s.dtype is not None else dtype_bytes)
    return sum(regions.values()) + sum(expert_slots(cfg, held, shift)) * Layout(cfg, "ep", 0, P).expert_bytes(
        dtype_bytes)


def kv_capacity_tokens(cfg: ModelConfig, P: int, kv_bytes: float, dtype_bytes: int = 2, shift: int = 1
                       ) -> dict[str, int]:
    """Tokens of KV each layout holds engine-wide when a rank's KV cache is `kv_bytes` (over the layer slots that
    hold full-attention layers, as worker/build.py lays it out; a window group's slots, a few windows a request,
    left out): a rank holds its KV heads of the family's KV spec (`Layout`) for each token of the requests it runs;
    TP runs every request on every rank, EP each on one. So for MLA (one latent replicated in TP) TP holds 1/P of
    EP's tokens; for GQA with fewer KV heads than ranks, KV heads / P of them."""
    spec, out = cfg.kv_spec, {}
    first = sum(1 for held in slot_groups(cfg, MODES, shift) if 0 in held)  # slots of the first KV group's pages
    for mode in MODES:
        lay = Layout(cfg, mode, 0, P)
        per_token = first * lay.num_kv_heads * spec.parts * spec.dim * dtype_bytes
        out[mode] = int(kv_bytes // per_token) * (P if lay.data_parallel else 1)
    return out


def floor_kv_capacity(cfg: ModelConfig, P: int, mem_fraction: float = 0.85, dtype_bytes: int = 2,
                      hw: Hardware = Hardware()) -> dict[str, int]:
    """`kv_capacity_tokens` of what `mem_fraction` of a GPU leaves after a rank's weights (step buffers left out), at
    the slot shift that holds the most (`layout.slot_shifts`, as worker/build.py picks it); ConfigError naming the
    bytes when the weights alone do not fit."""
    best: dict[str, int] | None = None
    for shift in slot_shifts(cfg):
        weights = rank_weight_bytes(cfg, P, dtype_bytes, shift)
        left = hw.memory_bytes * mem_fraction - weights
        if left <= 0:
            if shift == 1:
                raise ConfigError(f"a rank's weights take {weights / 2**30:.1f} GiB ({cfg.num_layers} layers on {P} "
                                  f"ranks, {dtype_bytes} bytes an element), more than {mem_fraction} of the GPU's "
                                  f"{hw.memory_bytes / 2**30:.1f} GiB: cut the layers (--floor-layers) or add ranks")
            continue
        tokens = kv_capacity_tokens(cfg, P, left, dtype_bytes, shift)
        if best is None or tokens["ep"] > best["ep"]:
            best = tokens
    assert best is not None  # (shift 1 comes first: it raised or set it)
    return best
