"""Rotary position embedding (the rotate-half / NeoX form used by Qwen3), cos/sin table precomputed in float32;
YaRN's frequencies and attention factor (`YarnScaling`, `rope_frequencies`) as transformers computes them, for any
family whose config says `rope_type = yarn` (DeepSeek's MLA rope dims, GPT-OSS's heads)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class YarnScaling:
    """`rope_scaling.type = yarn` as transformers' _compute_yarn_parameters reads it (None: its default)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    @classmethod
    def from_rope(cls, rope: dict[str, Any], max_pos: int, original: int | None = None) -> YarnScaling:
        """From a config's rope_scaling / rope_parameters dict of type yarn; `original`: a config's top-level
        original_max_position_embeddings (DeepSeek's), which wins over the dict's."""
        original = int(original or rope.get("original_max_position_embeddings", max_pos))
        factor = rope.get("factor")
        return cls(factor=float(factor) if factor is not None else max_pos / original,
                   original_max_position_embeddings=original, beta_fast=float(rope.get("beta_fast") or 32),
                   beta_slow=float(rope.get("beta_slow") or 1), mscale=rope.get("mscale"),
                   mscale_all_dim=rope.get("mscale_all_dim"), attention_factor=rope.get("attention_factor"),
                   truncate=bool(rope.get("truncate", True)))


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's Eq. 21: 0.1 * mscale * ln(factor) + 1 (1 when nothing is stretched)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_frequencies(dim: int, base: float, yarn: YarnScaling | None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [dim / 2] float32, the factor cos and sin are multiplied by), as transformers' default
    and yarn rope initialisers compute them over `dim` rotated dims."""
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    y = yarn
    if y is None:
        return 1.0 / pos_freqs, 1.0
    attention_factor = y.attention_factor
    if attention_factor is None:
        attention_factor = (yarn_mscale(y.factor, y.mscale) / yarn_mscale(y.factor, y.mscale_all_dim)
                            if y.mscale and y.mscale_all_dim else yarn_mscale(y.factor))

    def correction_dim(rotations: float) -> float:
        """The dim whose wavelength fits `rotations` times into the original context."""
        return dim * math.log(y.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(y.beta_fast), correction_dim(y.beta_slow)
    if y.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolate = 1 - ramp  # 1: the dim keeps its frequency (short wavelengths), 0: interpolated by the factor
    inv_freq = (1.0 / (y.factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv_freq, float(attention_factor)


def scaled_rope_table(dim: int, max_pos: int, base: float, yarn: YarnScaling | None,
                      device: torch.device | str = "cpu") -> torch.Tensor:
    """[max_pos, dim] float32 (`rope_frequencies`, computed on the CPU): cos in the first half, sin in the second,
    both times YaRN's attention factor (so q.k carries its square)."""
    inv_freq, factor = rope_frequencies(dim, base, yarn)
    freqs = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return (torch.cat([freqs.cos(), freqs.sin()], dim=-1) * factor).to(device)


def rope_table(head_dim: int, max_pos: int, theta: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """[max_pos, head_dim] float32: cos in the first half of the last dim, sin in the second."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
    freqs = torch.arange(max_pos, device=device, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def apply_rope(x_THd: torch.Tensor, positions_T: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate each head of each token by its position: x = [x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin]. A table
    narrower than the heads (partial rotary, GLM's partial_rotary_factor) rotates their first table-width dims and
    passes the rest through."""
    rot = table.shape[-1]
    if rot < x_THd.shape[-1]:
        return torch.cat([apply_rope(x_THd[..., :rot], positions_T, table), x_THd[..., rot:]], dim=-1)
    half = rot // 2
    cs = table[positions_T]  # [T, head_dim]
    cos = cs[:, None, :half].to(x_THd.dtype)
    sin = cs[:, None, half:].to(x_THd.dtype)
    x1, x2 = x_THd[..., :half], x_THd[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
