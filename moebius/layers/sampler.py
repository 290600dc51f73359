"""Token sampling: greedy, temperature, top-k, top-p, with counter-based per-request randomness.

The noise for output token j of a request is a hash of (request seed, j, vocab id), so a request's samples do not
depend on the batch it runs in, survive preemption, and move between ranks as two integers. No host sync: every
operation is batched on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moebius.kernels import DEFAULT_KERNELS, KernelConfig, triton_available

_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser on int64 tensors holding values in [0, 2^32) (products stay below 2^63)."""
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _M32
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _M32
    return x ^ (x >> 16)


def uniform_noise(seeds_B: torch.Tensor, steps_B: torch.Tensor, vocab: int, first: int = 0) -> torch.Tensor:
    """[B, vocab] float32 uniforms in (0, 1), a pure function of (seed, step, vocab id) for ids first .. first+vocab-1
    (so a rank holding a vocabulary slice draws exactly the whole vocabulary's noise for its ids)."""
    s = _mix32(seeds_B & _M32) ^ _mix32((seeds_B >> 32) & _M32 ^ 0x5BD1E995)
    s = _mix32(s ^ _mix32((steps_B + 0x9E3779B9) & _M32))
    v = torch.arange(first, first + vocab, device=seeds_B.device, dtype=torch.int64)
    h = _mix32(s[:, None] ^ _mix32((v * 0x27D4EB2F + 0x165667B1) & _M32)[None, :])
    return ((h >> 8).float() + 0.5) * (1.0 / (1 << 24))


@dataclass
class SamplingBatch:
    """Per-row sampling parameters of one step, as device tensors."""

    temperature: torch.Tensor  # [B] float32; 0 = greedy
    top_k: torch.Tensor  # [B] int64; vocab size = disabled
    top_p: torch.Tensor  # [B] float32
    seeds: torch.Tensor  # [B] int64
    steps: torch.Tensor  # [B] int64, index of the output token being sampled
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    min_p: torch.Tensor | None = None  # [B] float32, where any row has min_p > 0


def race_scores(logits_BV: torch.Tensor, sb: SamplingBatch, first: int = 0,
                tempered_BV: torch.Tensor | None = None) -> torch.Tensor:
    """Scores whose argmax over the vocabulary is the row's next token: the logits for greedy rows; for the others
    logits / temperature - log(E) with E ~ Exp(1) per vocab id (an exponential race, i.e. the Gumbel-max trick:
    argmax p_i / E_i draws i with probability p_i, and the softmax's normaliser is the same for every i, so no
    softmax is needed). Elementwise per vocab id, so a rank holding ids first.. scores its slice exactly as the
    whole vocabulary would (TP then takes the best across ranks). tempered_BV: logits / temperature already cut
    by top-k / top-p (-inf outside)."""
    logits = logits_BV.float()
    if sb.all_greedy:
        return logits
    if tempered_BV is None:
        t = torch.where(sb.temperature > 0, sb.temperature, torch.ones_like(sb.temperature))
        tempered_BV = logits / t[:, None]
    e = -torch.log(uniform_noise(sb.seeds, sb.steps, logits.shape[1], first))
    return torch.where((sb.temperature > 0)[:, None], tempered_BV - torch.log(e), logits)


def argmax_keys(scores_TV: torch.Tensor, first: int = 0, *, kc: KernelConfig = DEFAULT_KERNELS) -> torch.Tensor:
    """[T] int64 keys whose max over any split of the vocabulary is the row's argmax: the best score (float32,
    ordered as an integer) in the high 32 bits, then 2^32 - 1 - its vocab id (ids first.. for these columns), so
    equal scores go to the lowest id, as argmax does. A rank holding a slice sends T keys instead of logits."""
    if scores_TV.is_cuda and triton_available():
        from moebius.kernels.fused import argmax_keys as fast

        return fast(scores_TV, first, kc=kc)
    idx = scores_TV.argmax(dim=-1)
    bits = (scores_TV.gather(1, idx[:, None]).squeeze(1).float() + 0.0).view(torch.int32)  # -0.0 -> +0.0
    ordered = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).long()
    return (ordered << 32) | (_M32 - (idx + first))


def key_ids(keys: torch.Tensor) -> torch.Tensor:
    """The vocab ids of argmax_keys' keys."""
    return _M32 - (keys & _M32)


# What a step's log-probabilities are taken from (vLLM's logprobs_mode): the model's logits (raw) or those the
# token is drawn from (processed: after temperature, top-k, top-p, min-p); as log-probabilities or as logits.
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


def _cuts(sb: SamplingBatch) -> bool:
    return sb.any_top_k or sb.any_top_p or sb.min_p is not None


def sample(logits_BV: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """Next token of each row: argmax for greedy rows, else a draw from the tempered, top-k/top-p-cut softmax."""
    logits = logits_BV.float()
    if sb.all_greedy or not _cuts(sb):
        return race_scores(logits, sb).argmax(dim=-1)
    return race_scores(logits, sb, tempered_BV=processed_logits(logits, sb)).argmax(dim=-1)


def processed_logits(logits_BV: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """[B, V] float32: the logits a row's token is drawn from: divided by the temperature (greedy rows: by 1), -inf
    outside its top-k, top-p and min-p cuts."""
    logits = logits_BV.float()
    if sb.all_greedy:
        return logits
    t = torch.where(sb.temperature > 0, sb.temperature, torch.ones_like(sb.temperature))
    tempered = logits / t[:, None]
    if not _cuts(sb):
        return tempered
    B, V = logits.shape
    sorted_l, _ = tempered.sort(dim=-1, descending=True)
    if sb.any_top_k:
        kth = sorted_l.gather(1, (sb.top_k.clamp(1, V) - 1)[:, None])
        tempered = tempered.masked_fill(tempered < kth, float("-inf"))
        sorted_l = sorted_l.masked_fill(sorted_l < kth, float("-inf"))
    if sb.any_top_p:
        sp = torch.softmax(sorted_l, dim=-1)
        # keep the smallest prefix whose mass reaches top_p (always the first token)
        drop = (sp.cumsum(dim=-1) - sp) >= sb.top_p[:, None]
        drop[:, 0] = False  # a top_p too small for float32 (it reads 0) would drop the first too
        cut = sorted_l.masked_fill(drop, float("inf")).min(dim=-1, keepdim=True).values
        tempered = tempered.masked_fill(tempered < cut, float("-inf"))
    if sb.min_p is not None:  # p_i < min_p * p_max  <=>  l_i < l_max + log(min_p), in tempered logits
        floor = tempered.max(dim=-1, keepdim=True).values + torch.log(sb.min_p.clamp_min(1e-30))[:, None]
        tempered = tempered.masked_fill((tempered < floor) & (sb.min_p > 0)[:, None], float("-inf"))
    return tempered


def logprobs_of(logits_BV: torch.Tensor, tokens_B: torch.Tensor, k: int, mode: str = "raw_logprobs"
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The log-probabilities (softmax of the whole vocabulary's logits given: the raw ones, or `processed_logits`)
    of each row's sampled token and of its k most likely tokens: ([B, 1 + k] float32, [B, 1 + k] int64 ids), the
    sampled first; in a *_logits mode the logits themselves."""
    if mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs mode must be one of {', '.join(LOGPROBS_MODES)}, got {mode!r}")
    lp = logits_BV.float() if mode.endswith("_logits") else torch.log_softmax(logits_BV.float(), dim=-1)
    vals, ids = lp.gather(1, tokens_B[:, None]), tokens_B[:, None]
    if k:
        top_v, top_i = lp.topk(k, dim=-1)
        vals, ids = torch.cat([vals, top_v], dim=1), torch.cat([ids, top_i], dim=1)
    return vals, ids
