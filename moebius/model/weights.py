"""Where each weight of a layout lives in the unified buffer, and how it is cut from the checkpoint's full tensor.

`weight_specs` lists every view of one layout: dense parts (attention, norms, router, embeddings, dense MLPs) as
named regions, expert weights at the head of their layer slot. A region's name encodes its shard, so layouts with
the same shard (e.g. P = 1) share one copy. The cut is the layout's sharding function (parallel/layout.py).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from moebius.config import ModelConfig
from moebius.memory.umm import MemoryPlan, UnifiedMemory
from moebius.model.qwen3_moe import AttnWeights, DenseWeights, LayerWeights, ModelWeights, MoEWeights
from moebius.parallel.layout import Layout, tp_block

# fetch(hf_name, full_shape) -> the checkpoint tensor, checked against the shape
Fetch = Callable[[str, tuple[int, ...]], torch.Tensor]

# transformers 5's Qwen3-MoE holds a layer's experts in two tensors (a trainer's named_parameters() gives them):
# gate_up_proj [E, 2I, D] (each expert's gate rows, then its up rows) and down_proj [E, D, I]
FUSED_W13, FUSED_W2 = "mlp.experts.gate_up_proj", "mlp.experts.down_proj"
_FUSED = re.compile(r"(model\.layers\.\d+\.)(mlp\.experts\.(?:gate_up_proj|down_proj))$")


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


def _attn_tag(lay: Layout) -> str:
    """Names an attention shard by the heads it holds, so layouts holding the same heads share the region."""
    return f"q{lay.q_heads.start}-{lay.q_heads.stop}.kv{lay.kv_heads.start}-{lay.kv_heads.stop}"


def _layer_specs(cfg: ModelConfig, lay: Layout, i: int, elt: int) -> list[ParamSpec]:
    D, d = cfg.hidden_size, cfg.head_dim
    p = f"model.layers.{i}."
    qh, kvh, tag = lay.q_heads, lay.kv_heads, _attn_tag(lay)
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
        ParamSpec(p + "input_layernorm", (D,), lambda f: f(p + "input_layernorm.weight", (D,))),
        ParamSpec(p + "post_attention_layernorm", (D,), lambda f: f(p + "post_attention_layernorm.weight", (D,))),
        ParamSpec(p + f"qkv.{tag}", (rows, D), qkv("weight")),
        ParamSpec(p + f"o_proj.{tag}", (D, len(qh) * d),
                  lambda f: f(p + "self_attn.o_proj.weight", (D, cfg.q_size))[:, qh.start * d: qh.stop * d]),
        ParamSpec(p + "q_norm", (d,), lambda f: f(p + "self_attn.q_norm.weight", (d,))),
        ParamSpec(p + "k_norm", (d,), lambda f: f(p + "self_attn.k_norm.weight", (d,))),
    ]
    if cfg.attention_bias:
        specs.append(ParamSpec(p + f"qkv_bias.{tag}", (rows,), qkv("bias")))
    if not cfg.is_moe_layer(i):
        I, It = cfg.intermediate_size, lay.dense_inter
        specs += [
            ParamSpec(p + f"mlp.w13.tp{lay.tp_rank}of{lay.tp}", (2 * It, D), lambda f: lay.shard_w13(torch.cat(
                [f(p + "mlp.gate_proj.weight", (I, D)), f(p + "mlp.up_proj.weight", (I, D))]))),
            ParamSpec(p + f"mlp.w2.tp{lay.tp_rank}of{lay.tp}", (D, It),
                      lambda f: lay.shard_w2(f(p + "mlp.down_proj.weight", (D, I)))),
        ]
        return specs
    E, I, El, Il = cfg.num_experts, cfg.moe_intermediate_size, lay.num_local_experts, lay.moe_inter
    slot = lay.slot_of(i)
    w13_bytes = El * 2 * Il * D * elt
    w13 = _ExpertCut(p, "w13", lay, (E, 2 * I, D), ((I, D), (I, D)))
    w2 = _ExpertCut(p, "w2", lay, (E, D, I), ((D, I),))
    specs += [
        ParamSpec(p + "mlp.gate", (E, D), lambda f: f(p + "mlp.gate.weight", (E, D))),
        ParamSpec(p + "mlp.experts.w13", (El, 2 * Il, D), w13.load, slot=slot, fill=w13.fill),
        ParamSpec(p + "mlp.experts.w2", (El, D, Il), w2.load, slot=slot, offset=w13_bytes, fill=w2.fill),
    ]
    return specs


def _tp_block(t: torch.Tensor, dim: int, lay: Layout) -> torch.Tensor:
    """This rank's 1/tp block of `t` along `dim` (`tp_block`: the rows of gate and of up `Layout.shard_w13` keeps,
    the columns of down `Layout.shard_w2` keeps)."""
    return tp_block(t, dim, lay.tp, lay.tp_rank)


class _ExpertCut:
    """A layer's local experts, [gate | up] (`w13`: the slot's [El, 2, Il, D]) or down (`w2`: [El, D, Il]), cut from
    per-expert or fused (transformers 5) tensors as views of the source, each with where it lands in the slot: one
    piece for a fused tensor, one per expert and projection otherwise. Both the load and an update write these."""

    def __init__(self, p: str, which: str, lay: Layout, fused: tuple[int, ...],
                 per_expert_shapes: tuple[tuple[int, ...], ...]) -> None:
        self.p, self.which, self.lay, self.fused_shape = p, which, lay, fused
        self.shapes = per_expert_shapes
        self.local = range(lay.first_expert, lay.first_expert + lay.num_local_experts)

    def _names(self, e: int) -> tuple[str, ...]:
        projs = ("gate_proj", "up_proj") if self.which == "w13" else ("down_proj",)
        return tuple(f"{self.p}mlp.experts.{e}.{proj}.weight" for proj in projs)

    def pieces(self, fetch: Fetch) -> list[tuple[tuple[int | slice, ...], torch.Tensor]]:
        """(index into the destination, seen as [El, 2, Il, D] or [El, D, Il]; the source view that goes there)."""
        w13 = self.which == "w13"
        try:
            first = fetch(self._names(self.local.start)[0], self.shapes[0])
        except KeyError as missing:
            try:
                t = fetch(self.p + (FUSED_W13 if w13 else FUSED_W2), self.fused_shape)[self.local.start:self.local.stop]
            except KeyError:
                raise missing from None  # name the per-expert tensor (the usual format) as the missing one
            # fused [El, 2I, D]: gate and up rows split, then each cut; [El, D, I]: columns cut
            return [((slice(None),), _tp_block(t.unflatten(1, (2, t.shape[1] // 2)), 2, self.lay) if w13
                     else _tp_block(t, 2, self.lay))]
        out: list[tuple[tuple[int | slice, ...], torch.Tensor]] = []
        for j, e in enumerate(self.local):
            for k, (name, shape) in enumerate(zip(self._names(e), self.shapes, strict=True)):
                t = first if j == 0 and k == 0 else fetch(name, shape)
                out.append(((j, k) if w13 else (j,), _tp_block(t, 0 if w13 else 1, self.lay)))
        return out

    def fill(self, fetch: Fetch, dst: torch.Tensor) -> None:
        """Each piece copied once into its place in `dst` (the slot's view, [El, 2Il, D] or [El, D, Il])."""
        _write(self.pieces(fetch), dst.unflatten(1, (2, dst.shape[1] // 2)) if self.which == "w13" else dst)

    def load(self, fetch: Fetch) -> torch.Tensor:
        """The cut as a tensor of its own: the pieces written into a fresh one (its last dims the source's: a
        shape-only check passes tensors of width 0)."""
        pieces = self.pieces(fetch)
        src = pieces[0][1]
        El = len(self.local)
        shape = (El, 2, *src.shape[-2:]) if self.which == "w13" else (El, *src.shape[-2:])
        out = torch.empty(shape, dtype=src.dtype, device=src.device)
        _write(pieces, out)
        return out.flatten(1, 2) if self.which == "w13" else out


def _write(pieces: list[tuple[tuple[int | slice, ...], torch.Tensor]], into: torch.Tensor) -> None:
    for at, src in pieces:
        if not src.is_meta:  # a tensor the update does not give: its rows keep their values
            into[at].copy_(src)


def weight_specs(cfg: ModelConfig, lay: Layout, elt: int) -> list[ParamSpec]:
    V, D = cfg.vocab_size, cfg.hidden_size
    embed = ParamSpec("model.embed_tokens", (V, D), lambda f: f("model.embed_tokens.weight", (V, D)))
    head = ParamSpec("lm_head", (V, D), lambda f: f("lm_head.weight", (V, D)))
    specs = [embed] + ([] if cfg.tie_word_embeddings else [head])
    specs.append(ParamSpec("model.norm", (D,), lambda f: f("model.norm.weight", (D,))))
    specs.append(ParamSpec("rope", (cfg.max_position_embeddings, cfg.head_dim), None))
    for i in range(cfg.num_layers):
        specs += _layer_specs(cfg, lay, i, elt)
    return specs


def resident_specs(cfg: ModelConfig, layouts: dict[str, Layout], mode: str, elt: int) -> list[ParamSpec]:
    """What a rank holds with `mode` active: every view of that layout (its experts in their slots) and the dense
    regions of the other layouts it keeps, each region once. Loading writes these; so does a weight update."""
    specs = weight_specs(cfg, layouts[mode], elt)
    names = {s.name for s in specs}
    for m, lay in layouts.items():
        if m != mode:
            specs += [s for s in weight_specs(cfg, lay, elt) if s.slot is None and s.name not in names]
            names.update(s.name for s in specs)
    return specs


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


@functools.cache
def checkpoint_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every checkpoint tensor the model reads, with its full shape: the names of a Hugging Face checkpoint
    (experts one by one) and the fused expert tensors (`FUSED_W13`, `FUSED_W2`) that stand for a layer's."""
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


_PER_EXPERT = re.compile(r"(model\.layers\.\d+\.mlp\.experts\.)\d+\.(gate_proj|up_proj|down_proj)\.weight$")


@functools.cache  # asked once per expert and weight at every update: a bounded set of names
def fused_name(name: str) -> str | None:
    """The fused expert tensor a per-expert name is part of (None for any other name)."""
    m = _PER_EXPERT.match(name)
    if m is None:
        return None
    return m.group(1) + ("down_proj" if m.group(2) == "down_proj" else "gate_up_proj")


def per_expert_names(cfg: ModelConfig, name: str, experts: int) -> list[str]:
    """The per-expert names a fused expert tensor of `experts` experts stands for, in expert order (as `per_expert`
    names its views); any other name as it is."""
    m = _FUSED.match(name)
    if m is None:
        return [name]
    p = m.group(1) + "mlp.experts."
    projs = ("down_proj",) if m.group(2) == FUSED_W2 else ("gate_proj", "up_proj")
    return [f"{p}{e}.{proj}.weight" for e in range(experts) for proj in projs]


def per_expert(cfg: ModelConfig, name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """A fused expert tensor as the per-expert tensors the weight specs read (views of it, in expert order); any
    other tensor as it is."""
    m = _FUSED.match(name)
    if m is None:
        return [(name, t)]
    p, I = m.group(1) + "mlp.experts.", cfg.moe_intermediate_size
    if m.group(2) == FUSED_W2:
        return [(f"{p}{e}.down_proj.weight", t[e]) for e in range(t.shape[0])]
    return [(f"{p}{e}.{proj}.weight", rows) for e in range(t.shape[0])
            for proj, rows in (("gate_proj", t[e, :I]), ("up_proj", t[e, I:]))]


def plan_weights(plan: MemoryPlan, cfg: ModelConfig, layouts: list[Layout], dtype: torch.dtype) -> None:
    """Reserve the dense regions of every layout (shared where the shard is the same)."""
    for lay in layouts:
        for s in weight_specs(cfg, lay, dtype.itemsize):
            if s.slot is None and s.name not in plan.regions:  # (rope is computed, not loaded: kept on release)
                plan.add(s.name, s.shape, torch.float32 if s.name == "rope" else dtype,
                         tag=None if s.load is None else "weights")


def spec_view(umm: UnifiedMemory, s: ParamSpec, dtype: torch.dtype) -> torch.Tensor:
    if s.slot is not None:
        return umm.slot_view(s.slot, s.offset, s.shape, dtype)
    return umm.view(s.name, s.shape, torch.float32 if s.name == "rope" else dtype)


def build_weights(umm: UnifiedMemory, cfg: ModelConfig, lay: Layout, dtype: torch.dtype) -> ModelWeights:
    """The layout's weight views over the buffer (contents are whatever was loaded there)."""
    views = {s.name: spec_view(umm, s, dtype) for s in weight_specs(cfg, lay, dtype.itemsize)}
    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        tag = _attn_tag(lay)
        attn = AttnWeights(views[p + f"qkv.{tag}"], views.get(p + f"qkv_bias.{tag}"), views[p + f"o_proj.{tag}"],
                           views[p + "q_norm"], views[p + "k_norm"])
        if cfg.is_moe_layer(i):
            mlp: MoEWeights | DenseWeights = MoEWeights(views[p + "mlp.gate"], views[p + "mlp.experts.w13"],
                                                        views[p + "mlp.experts.w2"], lay.first_expert)
        else:
            mlp = DenseWeights(views[p + f"mlp.w13.tp{lay.tp_rank}of{lay.tp}"],
                               views[p + f"mlp.w2.tp{lay.tp_rank}of{lay.tp}"])
        layers.append(LayerWeights(views[p + "input_layernorm"], views[p + "post_attention_layernorm"], attn, mlp))
    embed = views["model.embed_tokens"]
    head = embed if cfg.tie_word_embeddings else views["lm_head"]
    rows = lay.vocab_rows  # TP: this rank's vocabulary slice (a view; see TPComm)
    head = head[rows.start: rows.stop]
    return ModelWeights(embed, head, views["model.norm"], views["rope"], layers)
