"""Rotary position embedding (the rotate-half / NeoX form used by Qwen3), cos/sin table precomputed in float32."""

from __future__ import annotations

import torch


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
