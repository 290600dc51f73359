"""GPT-OSS's weights: every view of a layout with the checkpoint names transformers writes (`weight_specs`), and
the views as the forward takes them (`build_weights`).

Attention: the shared GQA cut (models/gqa.py: q|k|v and their biases by heads, o_proj by columns), and the
family's own: the sinks by heads (one logit a head), o_proj's bias given to TP rank 0 only (TP sums the shards'
outputs, so it is added once).

Experts: transformers keeps a layer's experts fused and transposed, gate and up interleaved in the last dim:
gate_up_proj [E, D, 2I] (column 2i gate row i, 2i + 1 up row i), gate_up_proj_bias [E, 2I], down_proj [E, I, D],
down_proj_bias [E, D]. `FusedExperts` cuts them into the engine's slot form, [gate | up] rows [El, 2Il, D] and down
[El, D, Il], so that the switch's geometry (parallel/layout.py: TP blocks of the gate and of the up rows, the
matching down columns) moves them as any family's. The biases are dense regions of each layout (a switch moves
none of their bytes): gate_up's rows cut like the weights' (the experts of the layout, TP blocks of gate and up),
down's whole for the experts of the layout on TP rank 0 and each EP rank (added once a (token, expert) pair, times
the routing weight as transformers adds it; the other TP ranks hold none).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from moebius.config import ModelConfig
from moebius.kernels.rows import row_format
from moebius.memory.umm import UnifiedMemory
from moebius.models.gpt_oss.config import GptOssConfig
from moebius.models.gqa import AttnWeights, attention_specs, attention_weights, attn_tag
from moebius.models.specs import Fetch, ParamSpec, decoder_specs, expert_slot_specs, spec_views, tp_cut, whole_rows
from moebius.models.weights import ModelWeights, MoEWeights, decoder_weights
from moebius.parallel.layout import Layout

GATE_UP, GATE_UP_BIAS = "mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj_bias"
DOWN, DOWN_BIAS = "mlp.experts.down_proj", "mlp.experts.down_proj_bias"


@dataclass
class GptOssAttnWeights(AttnWeights):
    sinks_H: torch.Tensor | None = None  # this rank's heads' sink logits
    o_bias: torch.Tensor | None = None  # [D], on the rank that adds it (TP rank 0; every EP rank)


@dataclass
class GptOssMoEWeights(MoEWeights):
    """The engine's MoE views (the switch moves w13 / w2) and the family's biases, of the same local experts."""

    router_bias_E: torch.Tensor | None = None  # every expert
    b13_EF: torch.Tensor | None = None  # [El, 2Il]: each local expert's gate bias rows, then its up bias rows
    b2_ED: torch.Tensor | None = None  # [El, D]; None on the TP ranks that do not add it


def ext_of(cfg: ModelConfig) -> GptOssConfig:
    return cfg.extra_as(GptOssConfig)


def deinterleave(t: torch.Tensor) -> torch.Tensor:
    """[..., 2I] with gate and up interleaved (gate at even places) -> [..., 2, I] ([..., 0, :] gate), a view."""
    return t.unflatten(-1, (t.shape[-1] // 2, 2)).transpose(-1, -2)


class FusedExperts:
    """A layer's local experts cut from transformers' fused tensors, as views of the source: `w13` [El, 2, Il, D]
    (gate_up_proj's columns of each projection transposed to rows, then TP blocks of each) or `w2` [El, D, Il]
    (down_proj transposed, TP blocks of its columns); with --quantization mxfp4 the cut packed as MXFP4 rows (the
    rows are the transposed tensors', so the packing follows the cut; an MXFP4 checkpoint's values come back
    exactly). The load and an update both write these."""

    def __init__(self, cfg: ModelConfig, lay: Layout, p: str, which: str) -> None:
        self.lay, self.which, self.fmt = lay, which, row_format(cfg.quantization)
        E, D, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.name, self.shape = (p + GATE_UP, (E, D, 2 * I)) if which == "w13" else (p + DOWN, (E, I, D))
        self.local = slice(lay.first_expert, lay.first_expert + lay.num_local_experts)

    def piece(self, fetch: Fetch) -> torch.Tensor:
        t = fetch(self.name, self.shape)[self.local]
        if self.which == "w13":  # [El, D, 2I] -> [El, 2, I, D]
            cut = tp_cut(deinterleave(t).permute(0, 2, 3, 1), 2, self.lay)
        else:
            cut = tp_cut(t.transpose(1, 2), 2, self.lay)  # [El, I, D] -> [El, D, I]
        return cut if self.fmt is None else self.fmt.rows_of(cut, whole_rows(self.which, self.lay))

    def fill(self, fetch: Fetch, dst: torch.Tensor) -> None:
        """The cut copied into `dst` (the slot's view, [El, 2Il, D] or [El, D, Il]); a tensor an update does not
        give (a meta tensor) leaves the view as it is."""
        src = self.piece(fetch)
        if not src.is_meta:
            (dst.unflatten(1, (2, dst.shape[1] // 2)) if self.which == "w13" else dst).copy_(src)

    def load(self, fetch: Fetch) -> torch.Tensor:
        src = self.piece(fetch)
        return src.flatten(1, 2).contiguous() if self.which == "w13" else src.contiguous()


def _experts_tag(lay: Layout) -> str:
    return f"e{lay.first_expert}-{lay.first_expert + lay.num_local_experts}"


def _moe_specs(cfg: ModelConfig, lay: Layout, i: int, elt: int) -> list[ParamSpec]:
    p, D = f"model.layers.{i}.", cfg.hidden_size
    E, I, El, Il = cfg.num_experts, cfg.moe_intermediate_size, lay.num_local_experts, lay.moe_inter
    local, tag = slice(lay.first_expert, lay.first_expert + El), _experts_tag(lay)
    w13, w2 = FusedExperts(cfg, lay, p, "w13"), FusedExperts(cfg, lay, p, "w2")

    def b13(f: Fetch) -> torch.Tensor:  # [El, 2I] interleaved -> [El, 2, Il] -> [El, 2Il]
        return tp_cut(deinterleave(f(p + GATE_UP_BIAS, (E, 2 * I))[local]), 2, lay).flatten(1)

    specs = [
        ParamSpec(p + "mlp.router", (E, D), lambda f: f(p + "mlp.router.weight", (E, D))),
        ParamSpec(p + "mlp.router.bias", (E,), lambda f: f(p + "mlp.router.bias", (E,))),
        *expert_slot_specs(cfg, lay, i, elt, w13, w2),
        ParamSpec(p + f"mlp.experts.b13.{tag}.tp{lay.tp_rank}of{lay.tp}", (El, 2 * Il), b13),
    ]
    if lay.tp_rank == 0:  # the down projection's shards are summed over TP ranks: its bias on one of them
        specs.append(ParamSpec(p + f"mlp.experts.b2.{tag}", (El, D), lambda f: f(p + DOWN_BIAS, (E, D))[local]))
    return specs


def _layer_specs(cfg: ModelConfig, lay: Layout, p: str, i: int, elt: int) -> list[ParamSpec]:
    """Layer i's attention (q|k|v bias, the sinks of its heads, o_proj's bias on one TP rank) and its experts."""
    D, H, qh = cfg.hidden_size, cfg.num_heads, lay.q_heads
    specs = [
        *attention_specs(cfg, lay, p, qk_norm=False, bias=cfg.attention_bias),
        ParamSpec(p + f"sinks.{attn_tag(lay)}", (len(qh),),
                  lambda f: f(p + "self_attn.sinks", (H,))[qh.start: qh.stop]),
    ]
    if cfg.attention_bias and lay.tp_rank == 0:  # o_proj's shards are summed over TP ranks: its bias on one
        specs.append(ParamSpec(p + "o_bias", (D,), lambda f: f(p + "self_attn.o_proj.bias", (D,))))
    return specs + _moe_specs(cfg, lay, i, elt)


def weight_specs(cfg: ModelConfig, lay: Layout, elt: int) -> list[ParamSpec]:
    ext_of(cfg)
    return decoder_specs(cfg, cfg.head_dim, lambda p, i: _layer_specs(cfg, lay, p, i, elt))


def build_weights(umm: UnifiedMemory, cfg: ModelConfig, lay: Layout, dtype: torch.dtype) -> ModelWeights:
    """The layout's weight views over the buffer (contents are whatever was loaded there)."""
    views = spec_views(umm, weight_specs(cfg, lay, dtype.itemsize), dtype)
    tag, experts = attn_tag(lay), _experts_tag(lay)

    def layer(p: str, i: int) -> tuple[GptOssAttnWeights, GptOssMoEWeights]:
        a = attention_weights(views, lay, p)
        attn = GptOssAttnWeights(a.qkv_QD, a.qkv_bias, a.o_DQ, None, None, sinks_H=views[p + f"sinks.{tag}"],
                                 o_bias=views.get(p + "o_bias"))
        mlp = GptOssMoEWeights(views[p + "mlp.router"], views[p + "mlp.experts.w13"], views[p + "mlp.experts.w2"],
                               lay.first_expert, router_bias_E=views[p + "mlp.router.bias"],
                               b13_EF=views[p + f"mlp.experts.b13.{experts}.tp{lay.tp_rank}of{lay.tp}"],
                               b2_ED=views.get(p + f"mlp.experts.b2.{experts}"))
        return attn, mlp

    return decoder_weights(views, cfg, lay.vocab_rows, layer)


@functools.cache  # asked at every update's check: a ModelConfig is a cache key
def checkpoint_tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every checkpoint tensor the model reads, with its full shape (the fused expert tensors as transformers
    saves them: no per-expert names)."""
    shapes: dict[str, tuple[int, ...]] = {}

    def fetch(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        shapes[name] = tuple(shape)
        return torch.empty(shape, device="meta")

    for s in weight_specs(cfg, Layout(cfg, "tp", 0, 1), 4):
        if s.load is not None:
            s.load(fetch)
    return shapes
