"""Token sampling: greedy, temperature, top-k, top-p, with counter-based per-request randomness.

The noise for output token j of a request is a hash of (request seed, j, vocab id), so a request's samples do not
depend on the batch it runs in, survive preemption, and move between ranks as two integers. No host sync: every
operation is batched on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser on int64 tensors holding values in [0, 2^32) (products stay below 2^63)."""
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _M32
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _M32
    return x ^ (x >> 16)


def uniform_noise(seeds_B: torch.Tensor, steps_B: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, V] float32 uniforms in (0, 1), a pure function of (seed, step, vocab id)."""
    s = _mix32(seeds_B & _M32) ^ _mix32((seeds_B >> 32) & _M32 ^ 0x5BD1E995)
    s = _mix32(s ^ _mix32((steps_B + 0x9E3779B9) & _M32))
    v = torch.arange(vocab, device=seeds_B.device, dtype=torch.int64)
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


def sample(logits_BV: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """Next token of each row: argmax for greedy rows, else a draw from the tempered, top-k/top-p-cut softmax."""
    logits = logits_BV.float()
    greedy = logits.argmax(dim=-1)
    if sb.all_greedy:
        return greedy
    B, V = logits.shape
    t = torch.where(sb.temperature > 0, sb.temperature, torch.ones_like(sb.temperature))
    logits = logits / t[:, None]
    if sb.any_top_k or sb.any_top_p:
        sorted_l, _ = logits.sort(dim=-1, descending=True)
        if sb.any_top_k:
            kth = sorted_l.gather(1, (sb.top_k.clamp(1, V) - 1)[:, None])
            logits = logits.masked_fill(logits < kth, float("-inf"))
            sorted_l = sorted_l.masked_fill(sorted_l < kth, float("-inf"))
        if sb.any_top_p:
            sp = torch.softmax(sorted_l, dim=-1)
            # keep the smallest prefix whose mass reaches top_p (always the first token)
            drop = (sp.cumsum(dim=-1) - sp) >= sb.top_p[:, None]
            cut = sorted_l.masked_fill(drop, float("inf")).min(dim=-1, keepdim=True).values
            logits = logits.masked_fill(logits < cut, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    # Exponential race: argmax p_i / E_i with E_i ~ Exp(1) draws i with probability p_i.
    e = -torch.log(uniform_noise(sb.seeds, sb.steps, V))
    drawn = (probs / e).argmax(dim=-1)
    return torch.where(sb.temperature > 0, drawn, greedy)
