"""What a model family is to the engine (`Family`), and the weight-spec machinery every family shares.

A family's `weight_specs` lists every view of one layout: dense parts (attention, norms, router, embeddings, dense
MLPs) as named regions, expert weights at the head of their layer slot. A region's name encodes its shard, so
layouts with the same shard (e.g. P = 1) share one copy. The cut is the layout's sharding function
(parallel/layout.py); the experts' cut (`ExpertCut`: per-expert or fused tensors, Hugging Face's names) is shared.
Load, switch and weight update all read these specs.
"""

from __future__ import annotations

import functools
import itertools
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from moebius.config import ModelConfig
from moebius.kernels.rows import FP8, RowFormat, row_format
from moebius.memory.umm import MemoryPlan, UnifiedMemory
from moebius.models.fp8_blocks import fp8_rows_fetch
from moebius.models.weights import shared_tag
from moebius.parallel.layout import Layout, tp_block, w2_shard, w13_shard

# fetch(hf_name, full_shape) -> the checkpoint tensor, checked against the shape
Fetch = Callable[[str, tuple[int, ...]], torch.Tensor]

# transformers 5's Qwen3-MoE holds a layer's experts in two tensors (a trainer's named_parameters() gives them):
# gate_up_proj [E, 2I, D] (each expert's gate rows, then its up rows) and down_proj [E, D, I]
FUSED_W13, FUSED_W2 = "mlp.experts.gate_up_proj", "mlp.experts.down_proj"
_MEMORY_ROUTER = re.compile(r"(model\.layers\.\d+\.)mlp\.gate\.weight$")
_FUSED = re.compile(r"(model\.layers\.\d+\.)(mlp\.experts\.(?:gate_up_proj|down_proj))$")


@dataclass(frozen=True)
class ExpertNames:
    """How a checkpoint names a MoE layer's router and its experts one by one (under "model.layers.{i}."): the MoE
    block's module `block`, each expert's projections `gate`, `up`, `down`. The fused tensors (`FUSED_W13`,
    `FUSED_W2`: transformers 5's modules, whatever names its checkpoints use) are the same for every naming. A family
    whose checkpoints use another naming than `HF_EXPERTS` gives it as its `ModelConfig.extra` (or as that extra's
    `expert_names` field): the cut, the names an update takes and the fused tensors' per-expert names follow it."""

    block: str = "mlp"
    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"

    def router(self, p: str) -> str:
        return f"{p}{self.block}.gate.weight"

    def checkpoint_name(self, name: str) -> str:
        """The checkpoint's name of a tensor as transformers 5's modules name it in memory (a trainer's
        named_parameters()): the router of a block named otherwise in checkpoints (Mixtral's `mlp.gate.weight` is
        `block_sparse_moe.gate.weight`); any other name as it is."""
        m = _MEMORY_ROUTER.match(name)
        return self.router(m.group(1)) if m is not None and self.block != "mlp" else name

    def expert(self, p: str, e: int, proj: str) -> str:
        return f"{p}{self.block}.experts.{e}.{proj}.weight"

    def projections(self, which: str) -> tuple[str, ...]:
        """An expert's tensors of `which` ("w13": gate then up; "w2": down)."""
        return (self.gate, self.up) if which == "w13" else (self.down,)

    @functools.cached_property
    def pattern(self) -> re.Pattern[str]:
        """A per-expert name of this naming: (layer prefix, projection)."""
        projs = "|".join(map(re.escape, (self.gate, self.up, self.down)))
        return re.compile(rf"(model\.layers\.\d+\.){re.escape(self.block)}\.experts\.\d+\.({projs})\.weight$")


HF_EXPERTS = ExpertNames()  # mlp.experts.{e}.{gate,up,down}_proj (Qwen3-MoE, Qwen2-MoE, DeepSeek)
# Mixtral's checkpoints (transformers saves them so, and so are they on the Hub): w1 the gate, w3 the up, w2 the down
W1W3W2_EXPERTS = ExpertNames(block="block_sparse_moe", gate="w1", up="w3", down="w2")
NAMINGS = (HF_EXPERTS, W1W3W2_EXPERTS)  # every naming a per-expert name of an update may have (`fused_name`)


def expert_names(cfg: ModelConfig) -> ExpertNames:
    """The naming of a model's expert tensors: its family's (`ModelConfig.extra`), `HF_EXPERTS` by default."""
    extra = cfg.extra
    names = extra if isinstance(extra, ExpertNames) else getattr(extra, "expert_names", None)
    return names if isinstance(names, ExpertNames) else HF_EXPERTS


@dataclass(frozen=True)
class ParamSpec:
    name: str  # region name (dense parts) or a descriptive name (slot parts)
    shape: tuple[int, ...]
    load: Callable[[Fetch], torch.Tensor] | None  # None: computed, not loaded (the RoPE table)
    slot: int | None = None  # expert weights: layer slot and byte offset in it
    offset: int = 0
    # the cut written straight into the view, each byte once from the source (`load` is this into a fresh tensor);
    # a source piece fetched as a meta tensor is skipped (an update of some experts leaves the others' rows)
    fill: Callable[[Fetch, torch.Tensor], None] | None = None
    # the view's dtype where it is not the model's: float32 for computed tables and for the routers transformers
    # keeps in float32 (a bf16 copy could flip a near-tie between experts), uint8 for quantized rows
    dtype: torch.dtype | None = None


def tp_cut(t: torch.Tensor, dim: int, lay: Layout) -> torch.Tensor:
    """This rank's 1/tp block of `t` along `dim` (`tp_block`: the rows of gate and of up `Layout.shard_w13` keeps,
    the columns of down `Layout.shard_w2` keeps)."""
    return tp_block(t, dim, lay.tp, lay.tp_rank)


def whole_rows(which: str, lay: Layout) -> bool:
    """Whether a layer's experts' `which` ("w13" or "w2") quantized rows are whole rows (`RowFormat.pack`'s `whole`):
    no layout cuts [gate | up]'s columns, and down's only TP over more than one rank."""
    return which == "w13" or lay.world_size == 1


class ExpertCut:
    """A layer's local experts, [gate | up] (`w13`: the slot's [El, 2, Il, D]) or down (`w2`: [El, D, Il]), cut from
    per-expert (named by `names`) or fused (transformers 5) tensors as views of the source, each with where it lands
    in the slot: one piece for a fused tensor, one per expert and projection otherwise. Both the load and an update
    write these."""

    def __init__(self, p: str, which: str, lay: Layout, fused: tuple[int, ...],
                 per_expert_shapes: tuple[tuple[int, ...], ...], names: ExpertNames = HF_EXPERTS,
                 fmt: RowFormat | None = None) -> None:
        self.p, self.which, self.lay, self.fused_shape = p, which, lay, fused
        self.shapes, self.names = per_expert_shapes, names
        self.local = range(lay.first_expert, lay.first_expert + lay.num_local_experts)
        # quantized rows (kernels/rows.py): each source tensor is packed as fetched, then cut as bytes
        self.rows = None if fmt is None else rows_fetch(fmt, gate_up=which == "w13", whole=whole_rows(which, lay))

    def _names(self, e: int) -> tuple[str, ...]:
        return tuple(self.names.expert(self.p, e, proj) for proj in self.names.projections(self.which))

    def pieces(self, fetch: Fetch) -> Iterator[tuple[tuple[int | slice, ...], torch.Tensor]]:
        """(index into the destination, seen as [El, 2, Il, D] or [El, D, Il]; the source view that goes there), each
        fetched as the one before is written: a layer's experts are never all held at once (DeepSeek-V3's, whole on
        one rank, outweigh a GPU's room beside the model)."""
        w13, local, raw = self.which == "w13", slice(self.local.start, self.local.stop), fetch

        def fused(name: str, shape: tuple[int, ...]) -> torch.Tensor:  # the local experts of a fused tensor
            return raw(name, shape)[local]

        if self.rows is not None:  # each tensor packed as fetched (a fused one's local experts only), cut as bytes
            fetch, fused = self.rows(fetch), self.rows(fused)
        try:
            first = fetch(self._names(self.local.start)[0], self.shapes[0])
        except KeyError as missing:
            try:
                t = fused(self.p + (FUSED_W13 if w13 else FUSED_W2), self.fused_shape)
            except KeyError:
                raise missing from None  # name the per-expert tensor (the usual format) as the missing one
            # fused [El, 2I, D]: gate and up rows split, then each cut; [El, D, I]: columns cut
            yield ((slice(None),), tp_cut(t.unflatten(1, (2, t.shape[1] // 2)), 2, self.lay) if w13
                   else tp_cut(t, 2, self.lay))
            return
        for j, e in enumerate(self.local):
            for k, (name, shape) in enumerate(zip(self._names(e), self.shapes, strict=True)):
                t = first if j == 0 and k == 0 else fetch(name, shape)
                first = None  # each source dropped once written
                yield ((j, k) if w13 else (j,)), tp_cut(t, 0 if w13 else 1, self.lay)

    def fill(self, fetch: Fetch, dst: torch.Tensor) -> None:
        """Each piece copied once into its place in `dst` (the slot's view, [El, 2Il, D] or [El, D, Il])."""
        _write(self.pieces(fetch), dst.unflatten(1, (2, dst.shape[1] // 2)) if self.which == "w13" else dst)

    def load(self, fetch: Fetch) -> torch.Tensor:
        """The cut as a tensor of its own: the pieces written into a fresh one (its last dims the source's: a
        shape-only check passes tensors of width 0)."""
        pieces = self.pieces(fetch)
        at, src = next(pieces)
        El = len(self.local)
        shape = (El, 2, *src.shape[-2:]) if self.which == "w13" else (El, *src.shape[-2:])
        out = torch.empty(shape, dtype=src.dtype, device=src.device)
        _write(itertools.chain([(at, src)], pieces), out)
        return out.flatten(1, 2) if self.which == "w13" else out


def _write(pieces: Iterable[tuple[tuple[int | slice, ...], torch.Tensor]], into: torch.Tensor) -> None:
    for at, src in pieces:
        if not src.is_meta:  # a tensor the update does not give: its rows keep their values
            into[at].copy_(src)


def spec_reads(s: ParamSpec) -> tuple[str, ...]:
    """The checkpoint tensors a spec's cut reads, in order (its per-expert names), found by running the cut on meta
    tensors: shapes only, no bytes."""
    names: list[str] = []

    def fetch(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        names.append(name)
        return torch.empty(shape, device="meta")

    if s.load is not None:
        s.load(fetch)
    return tuple(names)


@functools.cache  # asked once per expert and weight at every update: a bounded set of names
def fused_name(name: str) -> str | None:
    """The fused expert tensor a per-expert name (of any naming in `NAMINGS`) is part of (None for any other
    name)."""
    for names in NAMINGS:
        m = names.pattern.match(name)
        if m is not None:
            return m.group(1) + (FUSED_W2 if m.group(2) == names.down else FUSED_W13)
    return None


def per_expert_names(cfg: ModelConfig, name: str, experts: int) -> list[str]:
    """The per-expert names (the model's naming, `expert_names`) a fused expert tensor of `experts` experts stands
    for, in expert order (as `per_expert` names its views); any other name as it is."""
    m = _FUSED.match(name)
    if m is None:
        return [name]
    names = expert_names(cfg)
    projs = names.projections("w2" if m.group(2) == FUSED_W2 else "w13")
    return [names.expert(m.group(1), e, proj) for e in range(experts) for proj in projs]


def per_expert(cfg: ModelConfig, name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """A fused expert tensor as the per-expert tensors the weight specs read (views of it, in expert order, named
    as the model's checkpoints name them); any other tensor as it is."""
    m = _FUSED.match(name)
    if m is None:
        return [(name, t)]
    names, p, I = expert_names(cfg), m.group(1), cfg.moe_intermediate_size
    if m.group(2) == FUSED_W2:
        return [(names.expert(p, e, names.down), t[e]) for e in range(t.shape[0])]
    return [(names.expert(p, e, proj), rows) for e in range(t.shape[0])
            for proj, rows in ((names.gate, t[e, :I]), (names.up, t[e, I:]))]


def spec_view(umm: UnifiedMemory, s: ParamSpec, dtype: torch.dtype) -> torch.Tensor:
    if s.slot is not None:
        return umm.slot_view(s.slot, s.offset, s.shape, s.dtype or dtype)
    return umm.view(s.name, s.shape, s.dtype or dtype)


def linear_spec(cfg: ModelConfig, name: str, shape: tuple[int, int], load: Callable[[Fetch], torch.Tensor], *,
                columns: tuple[int, int] = (0, 1), cut: int | None = None) -> ParamSpec:
    """A dense region of Linear weights [rows, columns] (`load`: its cut of the checkpoint's `.weight` tensors, rows
    by any cut, columns by `kernels.fp8_rows.column_block`). With --quantization fp8 it holds FP8 rows (a checkpoint's
    float8 values and scales as stored) where every rank's columns are whole 128-value chunks (`columns`: the full
    column count and the equal parts some layout's ranks cut it in: o_proj's by heads in TP, down's by TP, a shared
    expert's on every rank) and no tensor it reads is one the checkpoint leaves unquantized (`quant_skip`); else in
    the dtype, in every layout alike (--quantization mxfp4 holds the routed experts alone, and so does any format with
    --quantization-scope experts: `cfg.quantize_dense`). `cut`: the parts this region's own layout cuts the columns in
    (by default `columns`' parts): where 1, its rows are the format's whole rows (`RowFormat.pack`)."""
    spec = ParamSpec(name, shape, load)
    full, parts = columns
    fmt = row_format(cfg.quantization)
    if fmt is None or fmt.experts_only or not cfg.quantize_dense or (parts > 1 and full % (parts * fmt.chunk_cols)):
        return spec
    if cfg.quant_skip and any(n.removesuffix(".weight") in cfg.quant_skip for n in spec_reads(spec)):
        return spec
    whole = (parts if cut is None else cut) == 1  # (this region's rows are not cut by columns)
    rows = rows_fetch(fmt, gate_up=False, whole=whole)
    return ParamSpec(name, (shape[0], fmt.width(shape[1], whole)), lambda f: load(rows(f)), dtype=torch.uint8)


def rows_fetch(fmt: RowFormat, gate_up: bool, whole: bool) -> Callable[[Fetch], Fetch]:
    """What turns a spec's fetch into one whose tensors come as `fmt`'s rows (`whole`: rows no layout cuts by
    columns, `RowFormat.pack`): FP8 rows with a checkpoint's own scales where it stores them (`fp8_rows_fetch`: its
    float8 values come back exactly); MXFP4 rows quantized from the values (an MXFP4 checkpoint's come back exactly,
    kernels/mxfp4_rows.py). A meta tensor stays one."""
    if fmt is FP8:
        return functools.partial(fp8_rows_fetch, gate_up=gate_up, whole=whole)

    def wrap(fetch: Fetch) -> Fetch:
        return lambda name, shape: fmt.rows_of(fetch(name, shape), whole)

    return wrap


class SlotCut(Protocol):
    """A layer's local experts [gate | up] or down as its slot holds them (`ExpertCut`; GPT-OSS's own cut)."""

    def load(self, fetch: Fetch) -> torch.Tensor:
        ...

    def fill(self, fetch: Fetch, dst: torch.Tensor) -> None:
        ...


def expert_slot_specs(cfg: ModelConfig, lay: Layout, i: int, elt: int, w13: SlotCut, w2: SlotCut
                      ) -> list[ParamSpec]:
    """Layer i's local experts at the head of its slot, [gate | up] rows [El, 2Il, D] then down [El, D, Il] (`w13`,
    `w2`: their cuts, giving the slot's form): in the dtype, or as --quantization's rows (uint8 [..., width], each
    row's scales in it, kernels/rows.py)."""
    p, D, El, Il, slot = f"model.layers.{i}.", cfg.hidden_size, lay.num_local_experts, lay.moe_inter, lay.slot_of(i)
    fmt = row_format(cfg.quantization)
    dtype, cols13, cols2 = ((None, D, Il) if fmt is None else
                            (torch.uint8, fmt.width(D, whole_rows("w13", lay)), fmt.width(Il, whole_rows("w2", lay))))
    return [ParamSpec(p + "mlp.experts.w13", (El, 2 * Il, cols13), w13.load, slot=slot, fill=w13.fill, dtype=dtype),
            ParamSpec(p + "mlp.experts.w2", (El, D, cols2), w2.load, slot=slot,
                      offset=El * 2 * Il * cols13 * (1 if fmt else elt), fill=w2.fill, dtype=dtype)]


def norm_spec(name: str, D: int) -> ParamSpec:
    """An RMSNorm's weight, region and checkpoint named alike (`name` + ".weight")."""
    return ParamSpec(name, (D,), lambda f: f(name + ".weight", (D,)))


def decoder_specs(cfg: ModelConfig, rope_width: int, layer_specs: Callable[[str, int], list[ParamSpec]]
                  ) -> list[ParamSpec]:
    """A decoder model's views: the embedding, the lm_head (unless tied to it), the final norm and the computed
    rope table (`rope_width` values a position), then each layer's two norms and what `layer_specs(p, i)` adds
    (its attention and MLP; p: its name prefix "model.layers.{i}.")."""
    V, D = cfg.vocab_size, cfg.hidden_size
    specs = [ParamSpec("model.embed_tokens", (V, D), lambda f: f("model.embed_tokens.weight", (V, D)))]
    if not cfg.tie_word_embeddings:
        specs.append(ParamSpec("lm_head", (V, D), lambda f: f("lm_head.weight", (V, D))))
    specs += [norm_spec("model.norm", D), ParamSpec("rope", (cfg.max_position_embeddings, rope_width), None,
                                                   dtype=torch.float32)]
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        specs += [norm_spec(p + "input_layernorm", D), norm_spec(p + "post_attention_layernorm", D),
                  *layer_specs(p, i)]
    return specs


def spec_views(umm: UnifiedMemory, specs: list[ParamSpec], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every spec's view over the buffer, by region name."""
    return {s.name: spec_view(umm, s, dtype) for s in specs}


def dense_mlp_specs(cfg: ModelConfig, lay: Layout, p: str) -> list[ParamSpec]:
    """A dense SwiGLU layer's views (`p`: the layer's name prefix): [gate | up] rows and down columns, TP-sharded
    (`Layout.shard_w13` / `shard_w2`), whole in EP."""
    D, I, It = cfg.hidden_size, cfg.intermediate_size, lay.dense_inter
    return [
        linear_spec(cfg, p + f"mlp.w13.tp{lay.tp_rank}of{lay.tp}", (2 * It, D), lambda f: lay.shard_w13(torch.cat(
            [f(p + "mlp.gate_proj.weight", (I, D)), f(p + "mlp.up_proj.weight", (I, D))]))),
        linear_spec(cfg, p + f"mlp.w2.tp{lay.tp_rank}of{lay.tp}", (D, It),
                    lambda f: lay.shard_w2(f(p + "mlp.down_proj.weight", (D, I))), columns=(I, lay.world_size),
                    cut=lay.tp),
    ]


def shared_expert_specs(cfg: ModelConfig, lay: Layout, p: str, module: str, width: int) -> list[ParamSpec]:
    """Layer `p`'s shared expert(s) as this rank's 1/P shard of their intermediate dim `width` (the same region in
    both layouts, so a switch moves none of its bytes): [gate | up] rows and down columns of `p + module`'s
    {gate,up,down}_proj (DeepSeek's and GLM's mlp.shared_experts., Qwen2-MoE's mlp.shared_expert.)."""
    D, P, r, s, tag = cfg.hidden_size, lay.world_size, lay.rank, p + module, shared_tag(lay.rank, lay.world_size)
    return [
        linear_spec(cfg, p + f"mlp.shared.w13.{tag}", (2 * width // P, D), lambda f: w13_shard(torch.cat(
            [f(s + "gate_proj.weight", (width, D)), f(s + "up_proj.weight", (width, D))])[None], P, r).reshape(
                2 * width // P, -1)),
        linear_spec(cfg, p + f"mlp.shared.w2.{tag}", (D, width // P),
                    lambda f: w2_shard(f(s + "down_proj.weight", (D, width))[None], P, r).reshape(D, -1),
                    columns=(width, P)),
    ]


def routed_expert_specs(cfg: ModelConfig, lay: Layout, i: int, elt: int, router_dtype: torch.dtype | None = None
                        ) -> list[ParamSpec]:
    """An MoE layer's router (in `router_dtype` where not the model's) and its local experts' views, [gate | up]
    then down at the head of the layer's slot (the checkpoint's per-expert names, `expert_names`, or fused tensors,
    through `ExpertCut`; `expert_slot_specs`)."""
    p, D, names = f"model.layers.{i}.", cfg.hidden_size, expert_names(cfg)
    E, I, fmt = cfg.num_experts, cfg.moe_intermediate_size, row_format(cfg.quantization)
    w13 = ExpertCut(p, "w13", lay, (E, 2 * I, D), ((I, D), (I, D)), names, fmt)
    w2 = ExpertCut(p, "w2", lay, (E, D, I), ((D, I),), names, fmt)
    router = ParamSpec(p + "mlp.gate", (E, D), lambda f: f(names.router(p), (E, D)), dtype=router_dtype)
    return [router, *expert_slot_specs(cfg, lay, i, elt, w13, w2)]


WeightSpecs = Callable[[ModelConfig, Layout, int], list[ParamSpec]]


@dataclass(frozen=True)
class FloorTerms:
    """What one rank of a layout reads and computes beside the routed experts, summed over the model's layers, for
    the floor model (bench/floor.py, which adds the routed experts, activations, lm_head and links itself): elements
    and FLOPs, no dtype. A family answers these from its own shapes (GQA heads, MLA's projections and latent)."""

    attn_weights: float  # attention's weight elements a rank reads (its heads' shard; replicated parts whole)
    dense_weights: float  # dense MLP layers' weight elements a rank reads (TP: its shard; EP: whole)
    kv_per_token: float  # cache elements a rank reads for one cached token of a request it runs
    attn_flops_per_key: float  # FLOPs one query token spends on one cached token (scores and weighted sum)
    moe_layers: int  # layers with routed experts
    # weight elements a rank runs on every token of the batch in either layout (DeepSeek's shared experts: a 1/P
    # shard on every rank); attention and dense MLPs run on the rank's own tokens (EP) or all (TP)
    shared_weights: float = 0.0
    # sliding-window layers (kv_per_token and attn_flops_per_key count the others): their cache elements and FLOPs
    # per key, each query reading at most `window` keys
    window_kv_per_token: float = 0.0
    window_attn_flops_per_key: float = 0.0
    window: int = 0


class Packing(Protocol):
    """How a quantized checkpoint of one quant_method stores the float tensors it packs: each as a few stored
    pieces (MXFP4: `<name>_blocks` and `<name>_scales`), dequantized together; a tensor it does not pack is stored
    as it is. A family lists those it reads in `Family.packings`; models/loader.py serves them."""

    method: str  # config.json's quantization_config quant_method

    def pieces(self, name: str) -> tuple[str, ...] | None:
        """The stored names of float tensor `name` (None: the method does not pack it)."""
        ...

    def base_of(self, name: str) -> str | None:
        """The float tensor a stored piece `name` is part of (None: no piece of this method)."""
        ...

    def stored(self, shape: tuple[int, ...]) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
        """Each piece's shape and dtype for a float tensor of `shape`; ValueError where the method cannot hold it."""
        ...

    def unpack(self, pieces: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """The float tensor of its pieces (in `pieces` order), in `dtype`."""
        ...


@dataclass(frozen=True)
class Family:
    """A model family: what the engine asks of it. `parse_config`: config.json (and --num-layers) -> ModelConfig
    (ConfigError naming what it cannot serve); `weight_specs`: every view of a layout (cfg, layout, bytes an element);
    `build_weights`: the layout's weight views over the buffer, in the form its `model` takes; `model`: the layout-
    free forward (`forward`, `logits`, `num_moe_layers`, `attention_geometry`, `attend`); `rope_table`: the float32
    table the region named "rope" holds (None: plain RoPE over head_dim, `layers/rotary.rope_table`); `packings`: the
    quantized checkpoint formats it reads, by quant_method (`Packing`); `checkpoint_shapes`: its checkpoint tensors
    and shapes where `checkpoint_tensors`' rule does not hold; `quantizations`: the --quantization values it serves;
    `cpu_only`: why the family is refused on a GPU (""
    where it is not; a family whose GPU path is written but not yet checked on one says so, and its GPU tests set
    MOEBIUS_UNCHECKED_GPU to its name); `checks_own_keys`: parse_config refuses missing or ill-typed shape keys itself
    (the front end's Qwen3-MoE-shaped key check in models/source.py is skipped); `floor_terms`: a layout's
    `FloorTerms` for the floor model (None: the floor model refuses the family, naming it); `reasoning_parser`: the
    server's reasoning parser for its chat answers by default (entrypoints/openai/reasoning.py; None: none)."""

    name: str
    architectures: tuple[str, ...]
    parse_config: Callable[[dict[str, Any], int | None], ModelConfig]
    weight_specs: WeightSpecs
    build_weights: Callable[[UnifiedMemory, ModelConfig, Layout, torch.dtype], Any]
    model: Any
    rope_table: Callable[[ModelConfig, torch.device], torch.Tensor] | None = None
    cpu_only: str = ""
    checks_own_keys: bool = False
    floor_terms: Callable[[ModelConfig, Layout], FloorTerms] | None = None
    packings: Mapping[str, Packing] = field(default_factory=dict)
    checkpoint_shapes: Callable[[ModelConfig], dict[str, tuple[int, ...]]] | None = None
    # the --quantization values it serves (its routed experts through `expert_slot_specs` and `layers/moe`)
    quantizations: tuple[str, ...] = ("fp8", "mxfp4")
    reasoning_parser: str | None = None

    def resident_specs(self, cfg: ModelConfig, layouts: dict[str, Layout], mode: str, elt: int) -> list[ParamSpec]:
        """What a rank holds with `mode` active: every view of that layout (its experts in their slots) and the
        dense regions of the other layouts it keeps, each region once. Loading writes these; so does an update."""
        specs = self.weight_specs(cfg, layouts[mode], elt)
        names = {s.name for s in specs}
        for m, lay in layouts.items():
            if m != mode:
                specs += [s for s in self.weight_specs(cfg, lay, elt) if s.slot is None and s.name not in names]
                names.update(s.name for s in specs)
        return specs

    def plan_weights(self, plan: MemoryPlan, cfg: ModelConfig, layouts: list[Layout], dtype: torch.dtype) -> None:
        """Reserve the dense regions of every layout (shared where the shard is the same)."""
        for lay in layouts:
            for s in self.weight_specs(cfg, lay, dtype.itemsize):
                if s.slot is None and s.name not in plan.regions:  # (rope is computed, not loaded: kept on release)
                    plan.add(s.name, s.shape, s.dtype or dtype,
                             tag=None if s.load is None else "weights")

    def checkpoint_tensors(self, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        """Every checkpoint tensor the model reads, with its full shape: the names of a Hugging Face checkpoint
        (experts one by one) and the fused expert tensors (`FUSED_W13`, `FUSED_W2`) that stand for a layer's; a
        family whose fused tensors are its own names and shapes says them (`checkpoint_shapes`)."""
        if self.checkpoint_shapes is not None:
            return self.checkpoint_shapes(cfg)
        return _checkpoint_tensors(self.weight_specs, cfg)


@functools.cache
def _checkpoint_tensors(weight_specs: WeightSpecs, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}

    def fetch(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        shapes[name] = tuple(shape)
        # no bytes past the first dim: one rank's TP cut (cat, stack, rows) runs on shapes only (check_checkpoint)
        return torch.empty(shape[:1] + (0,) * (len(shape) - 1))

    for s in weight_specs(cfg, Layout(cfg, "tp", 0, 1), 4):
        if s.load is not None:
            s.load(fetch)
    E, I, D = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    for i in filter(cfg.is_moe_layer, range(cfg.num_layers)):
        shapes[f"model.layers.{i}.{FUSED_W13}"] = (E, 2 * I, D)
        shapes[f"model.layers.{i}.{FUSED_W2}"] = (E, D, I)
    return shapes
