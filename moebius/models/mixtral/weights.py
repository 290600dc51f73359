"""Mixtral's weights: every view of a layout with the checkpoint names it is cut from (`weight_specs`), and the views
as the forward takes them (`build_weights`). Attention is models/gqa.py's without q/k norm or bias; the experts are
the shared `ExpertCut`'s under Mixtral's names (`block_sparse_moe.gate`, `block_sparse_moe.experts.{e}.w1 / w3 /
w2`, from the config's `expert_names`) or transformers 5's fused tensors."""

from __future__ import annotations

import torch

from moebius.config import ModelConfig
from moebius.memory.umm import UnifiedMemory
from moebius.models.gqa import attention_specs, attention_weights
from moebius.models.specs import ParamSpec, decoder_specs, routed_expert_specs, spec_views
from moebius.models.weights import ModelWeights, MoEWeights, decoder_weights
from moebius.parallel.layout import Layout


def weight_specs(cfg: ModelConfig, lay: Layout, elt: int) -> list[ParamSpec]:
    """GQA attention without q/k norm or bias; every layer MoE."""
    return decoder_specs(cfg, cfg.head_dim, lambda p, i: [*attention_specs(cfg, lay, p, qk_norm=False, bias=False),
                                                          *routed_expert_specs(cfg, lay, i, elt)])


def build_weights(umm: UnifiedMemory, cfg: ModelConfig, lay: Layout, dtype: torch.dtype) -> ModelWeights:
    """The layout's weight views over the buffer (contents are whatever was loaded there)."""
    views = spec_views(umm, weight_specs(cfg, lay, dtype.itemsize), dtype)
    return decoder_weights(views, cfg, lay.vocab_rows, lambda p, i: (
        attention_weights(views, lay, p),
        MoEWeights(views[p + "mlp.gate"], views[p + "mlp.experts.w13"], views[p + "mlp.experts.w2"], lay.first_expert)))
