"""TP and EP as placements of one model: which heads, experts and expert-intermediate rows a rank owns, which
requests it runs, which vocabulary rows it scores, and which communicator its layers use.

Shape arithmetic and views, no communication: the engine holds one `Layout` per mode and passes it in; no layer
reads a process-global rank, and nothing outside `parallel/` and `switch/` asks which mode it is.

The expert shard geometry is written once, here (`expert_shard`, `expert_block`): loading cuts a layout's experts
with it, and both switch directions move bytes between the same views.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from moebius.config import ConfigError, ModelConfig
from moebius.kernels.rows import holds, row_format

if TYPE_CHECKING:
    from moebius.parallel.dispatch import Communicator
    from moebius.parallel.groups import Groups

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


@functools.cache
def slot_shifts(cfg: ModelConfig) -> tuple[int, ...]:
    """The shifts a rank's slots may take (`Layout.slot_shift`, EP layer i in slot i + shift; N layers take N + shift
    slots): 1, and where the KV groups repeat (GPT-OSS alternates sliding and full layers) the least shift up to 4
    under which every slot holds layers of one KV group in both layouts, so that a window group's slots hold only
    its windows' pages (`worker/build.py`, which takes the one that leaves the first group more pages: the extra
    slot of experts can cost more than the windows save). Any shift keeps the switch's in-place order
    (`switch/executor.py`)."""
    group = cfg.kv_group_of
    if len(cfg.kv_groups) > 1:
        for s in range(1, 5):
            if all(group(i) == group(i + s) for i in range(cfg.num_layers - s)):
                return (1, s) if s > 1 else (1,)
    return (1,)


def num_slots(cfg: ModelConfig, shift: int = 1) -> int:
    """The layer slots of a rank's unified buffer: a layer's in each layout, and the spares between."""
    return cfg.num_layers + shift


def slot_layers(cfg: ModelConfig, modes: Iterable[str], shift: int = 1) -> list[frozenset[int]]:
    """The layers each slot holds in the layouts `modes` (none: a spare) under slot shift `shift`."""
    held: list[set[int]] = [set() for _ in range(num_slots(cfg, shift))]
    for mode in modes:
        lay = Layout(cfg, mode, 0, 1, shift)  # (a layer's slot is the same on every rank)
        for i in range(cfg.num_layers):
            held[lay.slot_of(i)].add(i)
    return [frozenset(h) for h in held]


def slot_groups(cfg: ModelConfig, modes: Iterable[str], shift: int = 1) -> list[frozenset[int]]:
    """The KV groups (`ModelConfig.kv_groups`) whose layers each slot holds in the layouts `modes` (none: a spare)
    under slot shift `shift`."""
    return [frozenset(map(cfg.kv_group_of, layers)) for layers in slot_layers(cfg, modes, shift)]


def expert_slots(cfg: ModelConfig, modes: Iterable[str], shift: int = 1) -> list[bool]:
    """Whether each slot holds a MoE layer's experts in some layout of `modes`: not one that holds only dense layers
    (DeepSeek's and GLM-4.5's first `first_k_dense_replace`), or none (a spare of one layout), whose expert bytes the
    buffer leaves out (worker/build.py)."""
    return [any(map(cfg.is_moe_layer, layers)) for layers in slot_layers(cfg, modes, shift)]


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
    slot_shift: int = 1  # EP layer i sits in slot i + slot_shift (`slot_shifts`; worker/build.py picks it)

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
        """Bytes of one layer's local expert weights (W13 + W2): the same in both modes (quantized rows: where TP
        cuts whole scale blocks, `check_quantized_layouts`)."""
        El, Il, D = self.num_local_experts, self.moe_inter, self.cfg.hidden_size
        fmt = row_format(self.cfg.quantization)
        if fmt is not None:
            # (down's rows whole where no TP over ranks cuts them: `specs.whole_rows`)
            return El * (2 * Il * fmt.width(D, True) + D * fmt.width(Il, self.world_size == 1))
        return 3 * El * Il * D * elt

    def slot_of(self, layer: int) -> int:
        """Physical layer slot of `layer`: TP layer i in slot i, EP layer i in slot i + `slot_shift` (the last slots
        are TP's spares, the first EP's)."""
        return layer if self.mode == "tp" else layer + self.slot_shift

    # ---- requests and the step ----
    @property
    def data_parallel(self) -> bool:
        """Requests are placed on ranks (EP over several ranks): each rank runs its own, every rank joins each
        layer's exchange, and the ranks agree on every step's size."""
        return self.mode == "ep" and self.world_size > 1

    def holds(self, owner: int) -> bool:
        """Whether this rank runs a request placed on rank `owner` (TP: every rank runs every request)."""
        return not self.data_parallel or owner == self.rank

    @property
    def reports_deltas(self) -> bool:
        """Whether this rank reports its requests' tokens (TP: every rank computes the same ones; rank 0 reports)."""
        return self.data_parallel or self.rank == 0

    def local_batch(self, batch: int) -> int:
        """Requests of a global decode batch this rank runs (EP: spread as evenly as placement spreads them)."""
        if not self.data_parallel:
            return batch
        return batch // self.world_size + (1 if self.rank < batch % self.world_size else 0)

    def step_tokens(self, batch: int) -> int:
        """The tokens every rank's step is sized for in a decode step of `batch` requests (EP: the largest rank's)."""
        return -(-batch // self.world_size) if self.data_parallel else batch

    # ---- vocabulary ----
    @property
    def splits_vocab(self) -> bool:
        """TP with a vocabulary the ranks divide: each rank scores a slice of lm_head's rows."""
        return self.tp > 1 and self.cfg.vocab_size % self.tp == 0

    @property
    def vocab_rows(self) -> range:
        """Vocabulary ids (lm_head rows) this rank scores."""
        if not self.splits_vocab:
            return range(self.cfg.vocab_size)
        n = self.cfg.vocab_size // self.tp
        return range(self.tp_rank * n, (self.tp_rank + 1) * n)

    def communicator(self, groups: Groups) -> Communicator:
        """The collectives this layout's layers use (TP: all-reduce; EP: all-to-all dispatch and combine)."""
        from moebius.parallel.dispatch import EPComm, LocalComm, TPComm

        if groups.world_size == 1:
            return LocalComm()
        if self.mode == "tp":
            return TPComm(groups.device, self.vocab_rows.start if self.splits_vocab else None)
        return EPComm(groups.device, groups.world_size, self.num_local_experts)

    # ---- cutting the checkpoint ----
    def shard_w13(self, w13_FD: torch.Tensor) -> torch.Tensor:
        """This rank's rows of one whole MLP's (an expert's or a dense layer's) [gate | up] stack: [2I, D] ->
        [2I/tp, D] (`w13_shard` of one expert)."""
        return w13_FD if self.tp == 1 else w13_shard(w13_FD[None], self.tp, self.tp_rank).reshape(-1, w13_FD.shape[1])

    def shard_w2(self, w2_DF: torch.Tensor) -> torch.Tensor:
        """This rank's columns of one whole MLP's down projection: [D, I] -> [D, I/tp] (`w2_shard`)."""
        return w2_DF if self.tp == 1 else w2_shard(w2_DF[None], self.tp, self.tp_rank).reshape(w2_DF.shape[0], -1)

    def shard_heads(self, w: torch.Tensor, heads: range, total: int) -> torch.Tensor:
        """Rows of `w` ([total * head_dim, ...]) belonging to the given global heads."""
        d = w.shape[0] // total
        return w[heads.start * d: heads.stop * d]


# ---- the expert shard geometry (load and both switch directions) ----
def check_quantized_rows(cfg: ModelConfig) -> None:
    """Quantized experts (--quantization, kernels/rows.py) in a format whose rows are whole blocks (MXFP4): the
    experts' hidden and intermediate sizes must be multiples of its block. ConfigError naming the sizes."""
    fmt, I, D = row_format(cfg.quantization), cfg.moe_intermediate_size, cfg.hidden_size
    if fmt is None:
        return
    bad = [f"{k} {n}" for k, n in (("hidden_size", D), ("moe_intermediate_size", I)) if not holds(fmt, n)]
    if bad:
        raise ConfigError(f"--quantization {fmt.name} holds the experts' rows in whole {fmt.chunk_cols}-value "
                          f"{fmt.name.upper()} blocks, and this model's {' and '.join(bad)} "
                          f"{'is' if len(bad) == 1 else 'are'} not a multiple of {fmt.chunk_cols}: serve it without "
                          "--quantization")


def tp_cuts_whole_blocks(cfg: ModelConfig, P: int) -> bool:
    """Whether TP over P ranks cuts each expert at whole scale blocks of its quantized rows (always, unquantized)."""
    fmt = row_format(cfg.quantization)
    return fmt is None or P == 1 or (cfg.moe_intermediate_size // P) % fmt.tp_unit == 0


def check_quantized_layouts(cfg: ModelConfig, world_size: int, modes: tuple[str, ...]) -> None:
    """Quantized experts (--quantization, kernels/rows.py) in TP over P ranks: each rank's I/P rows of an expert must
    be whole scale blocks (FP8: 128 rows; MXFP4: down's I/P columns whole 32-value blocks): a cut inside one would
    leave two ranks one scale; padding every shard to whole blocks would make the two layouts' experts different
    sizes in one slot. EP keeps whole experts: always served (where the format holds the rows, `check_quantized_rows`).
    ConfigError naming the sizes where TP is held and cannot be cut."""
    check_quantized_rows(cfg)
    fmt, I, P = row_format(cfg.quantization), cfg.moe_intermediate_size, world_size
    if fmt is None or "tp" not in modes or tp_cuts_whole_blocks(cfg, P):
        return
    raise ConfigError(f"--quantization {fmt.name} with TP over {P} ranks would cut each expert's "
                      f"moe_intermediate_size {I} into {I // P} rows a rank, splitting its "
                      f"{fmt.tp_unit}-{fmt.tp_what} {fmt.name.upper()} scale blocks; EP keeps whole experts: serve "
                      "it in EP alone (leave --mode unset, or --mode ep)")


def tp_block(t: torch.Tensor, dim: int, parts: int, q: int) -> torch.Tensor:
    """Block q of `parts` equal blocks of `t` along `dim`, as a view whatever the strides: the one TP cut of an MLP
    that loading, a weight update and a switch all make (`w13_shard`, `w2_shard`, the loader's expert cut)."""
    return t if parts == 1 else t.unflatten(dim, (parts, t.shape[dim] // parts)).select(dim, q)


def w13_shard(w13_EFD: torch.Tensor, parts: int, q: int) -> torch.Tensor:
    """TP shard q of `parts` of whole experts' [gate | up] stacks ([E, 2I, D]) as a 2-D view with contiguous rows,
    [E * 2, I/parts * D]: a row is one expert's gate (or up) rows q * I/parts .. (q + 1) * I/parts."""
    E, F, D = w13_EFD.shape
    return tp_block(w13_EFD.unflatten(1, (2, F // 2)), 2, parts, q).view(E * 2, F // 2 // parts * D)


def w2_shard(w2_EDF: torch.Tensor, parts: int, q: int) -> torch.Tensor:
    """TP shard q of `parts` of whole experts' down projections ([E, D, I]) as a 2-D view, [E * D, I/parts]: the
    columns that pair with `w13_shard`'s rows."""
    E, D, I = w2_EDF.shape
    return tp_block(w2_EDF, 2, parts, q).view(E * D, I // parts)


def expert_shard(w13_EFD: torch.Tensor, w2_EDF: torch.Tensor, parts: int, q: int) -> tuple[torch.Tensor, torch.Tensor]:
    """TP shard q of whole experts, both weights (`w13_shard`, `w2_shard`)."""
    return w13_shard(w13_EFD, parts, q), w2_shard(w2_EDF, parts, q)


def expert_block(t13_EFD: torch.Tensor, t2_EDF: torch.Tensor, parts: int, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Experts r * E/parts .. (r + 1) * E/parts of TP-shaped tensors ([E, 2I/P, D], [E, D, I/P]: one shard of every
    expert) in the 2-D form of `expert_shard`: what EP rank r's experts give to (or take from) this TP shard."""
    E, Fp, D = t13_EFD.shape
    El = E // parts
    return t13_EFD.view(parts, El * 2, Fp // 2 * D)[r], t2_EDF.view(parts, El * t2_EDF.shape[1], t2_EDF.shape[2])[r]
