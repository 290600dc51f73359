"""TP and EP as placements of one model: which heads, experts and expert-intermediate rows a rank owns.

Pure shape arithmetic, no communication and no tensors beyond slicing: the engine holds one `Layout` per mode
and passes it in; no layer reads a process-global rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moebius.config import ConfigError, ModelConfig

MODES = ("tp", "ep")


def check_shapes(cfg: ModelConfig, world_size: int) -> None:
    """Start-up check that both layouts exist for this model on `world_size` ranks; names the numbers."""
    P = world_size
    if P < 1:
        raise ConfigError(f"number of ranks must be >= 1, got {P}")
    if cfg.num_experts and cfg.num_experts % P:
        raise ConfigError(f"num_experts {cfg.num_experts} is not divisible by {P} ranks (EP needs E/P whole experts)")
    if cfg.num_heads % P:
        raise ConfigError(f"num_attention_heads {cfg.num_heads} is not divisible by {P} ranks")
    if cfg.num_kv_heads % P and P % cfg.num_kv_heads:
        raise ConfigError(f"num_key_value_heads {cfg.num_kv_heads} is neither a multiple nor a divisor of {P} ranks")
    if cfg.moe_intermediate_size % P:
        raise ConfigError(f"moe_intermediate_size {cfg.moe_intermediate_size} is not divisible by {P} ranks")
    if cfg.intermediate_size % P and any(not cfg.is_moe_layer(i) for i in range(cfg.num_layers)):
        raise ConfigError(f"intermediate_size {cfg.intermediate_size} (dense layers) is not divisible by {P} ranks")


@dataclass(frozen=True)
class Layout:
    """One rank's placement in one mode.

    tp: attention heads and every expert's intermediate dim are sharded over the P ranks; KV heads are replicated
        when there are fewer than P. ep: attention is data-parallel (all heads), each rank owns E/P whole experts.
    Embeddings and lm_head are replicated in both modes (vocab-parallel would save V*H*(P-1)/P per rank but adds a
    gather to every step; at Qwen3 sizes the copy is ~1.2 GB in bf16).
    """

    cfg: ModelConfig
    mode: str
    rank: int
    world_size: int

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"mode must be one of {MODES}, got {self.mode!r}")
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank {self.rank} out of range for {self.world_size} ranks")

    @property
    def tp(self) -> int:
        """Tensor-parallel degree of attention and experts in this mode."""
        return self.world_size if self.mode == "tp" else 1

    @property
    def tp_rank(self) -> int:
        return self.rank if self.mode == "tp" else 0

    # ---- attention ----
    @property
    def num_heads(self) -> int:
        return self.cfg.num_heads // self.tp

    @property
    def num_kv_heads(self) -> int:
        return max(1, self.cfg.num_kv_heads // self.tp)

    @property
    def q_heads(self) -> range:
        return range(self.tp_rank * self.num_heads, (self.tp_rank + 1) * self.num_heads)

    @property
    def kv_heads(self) -> range:
        """Global KV-head ids stored on this rank (one replica of a shared head when KV heads < ranks)."""
        first = self.tp_rank * self.cfg.num_kv_heads // self.tp
        return range(first, first + self.num_kv_heads)

    # ---- experts ----
    @property
    def num_local_experts(self) -> int:
        return self.cfg.num_experts // self.world_size if self.mode == "ep" else self.cfg.num_experts

    @property
    def first_expert(self) -> int:
        return self.rank * self.num_local_experts if self.mode == "ep" else 0

    @property
    def moe_inter(self) -> int:
        """Expert intermediate rows (per gate / up) held for each local expert."""
        return self.cfg.moe_intermediate_size // self.tp

    @property
    def dense_inter(self) -> int:
        return self.cfg.intermediate_size // self.tp

    def expert_bytes(self, elt: int) -> int:
        """Bytes of one layer's local expert weights (W13 + W2): the same in both modes."""
        return 3 * self.num_local_experts * self.moe_inter * self.cfg.hidden_size * elt

    def slot_of(self, layer: int) -> int:
        """Physical layer slot of `layer`: TP layer i in slot i, EP layer i in slot i + 1 (slot N is the spare)."""
        return layer if self.mode == "tp" else layer + 1

    # ---- the one sharding function (used by load and, later, switch) ----
    def shard_rows(self, w: torch.Tensor, parts: int = 1) -> torch.Tensor:
        """This rank's TP shard along dim 0 of `w`, which stacks `parts` equal blocks (e.g. gate|up) sharded apart."""
        if self.tp == 1:
            return w
        blocks = w.chunk(parts, dim=0)
        return torch.cat([b.chunk(self.tp, dim=0)[self.tp_rank] for b in blocks], dim=0)

    def shard_cols(self, w: torch.Tensor) -> torch.Tensor:
        return w if self.tp == 1 else w.chunk(self.tp, dim=-1)[self.tp_rank]

    def shard_heads(self, w: torch.Tensor, heads: range, total: int) -> torch.Tensor:
        """Rows of `w` ([total * head_dim, ...]) belonging to the given global heads."""
        d = w.shape[0] // total
        return w[heads.start * d: heads.stop * d]
