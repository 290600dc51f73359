"""DeepSeek-V2 / V3's MoE: its config.json's routing by version (`MoEConfig.from_hf`) over the block the families
share (models/grouped_moe.py: the router `route`, the weight specs, the forward), and the block as one function of
the weights a caller holds (`moe_block`, the torch reference the tests compare with transformers' DeepseekV2Moe /
DeepseekV3MoE).

Layout-free: `moe_block` takes whatever weights the caller holds (a contiguous range of whole experts in EP, every
expert's intermediate slice in TP, a slice of the shared experts' intermediate dim) and never knows a rank; a sum
over the ranks of its outputs is the whole block. Shapes: T tokens, D hidden, E experts (the local ones), F rows of
a [gate | up] stack.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from moebius.config import ConfigError
from moebius.kernels import DEFAULT_KERNELS, KernelConfig
from moebius.layers.moe import dense_mlp, experts, summed
from moebius.models import grouped_moe
from moebius.models.grouped_moe import ROUTINGS, route, router_logits  # noqa: F401  (DeepSeek's routing)
from moebius.models.weights import DenseWeights


class MoEConfig(grouped_moe.MoEConfig):
    """The MoE fields of a DeepSeek-V2 / V3 config.json (`grouped_moe.MoEConfig`), with the routing its version
    implies where config.json leaves it out."""

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> MoEConfig:
        """Build from a config.json dict (DeepseekV2ForCausalLM or DeepseekV3ForCausalLM, by `architectures`, else
        by `model_type`); raise ConfigError naming what is unsupported or missing."""
        # transformers' V3 config has neither field and always routes this way; DeepSeek's V2 code defaults them so
        default_scoring, default_method = ("softmax", "greedy") if _version(hf) == 2 else ("sigmoid", "noaux_tc")
        return cls.read(hf, "DeepSeek", scoring_func=hf.get("scoring_func") or default_scoring,
                        topk_method=hf.get("topk_method") or default_method,
                        moe_layer_freq=hf.get("moe_layer_freq") or 1)


def _version(hf: dict[str, Any]) -> int:
    archs = hf.get("architectures") or []
    if "DeepseekV2ForCausalLM" in archs:
        return 2
    if "DeepseekV3ForCausalLM" in archs:
        return 3
    model_type = hf.get("model_type")
    if model_type == "deepseek_v2":
        return 2
    if model_type in ("deepseek_v3", "kimi_k2"):
        return 3
    raise ConfigError(f"not a DeepSeek-V2 / V3 config: architectures {archs!r}, model_type {model_type!r}")


@dataclass
class MoEWeights:
    """The block's weights as `moe_block` takes them (the engine's views are `grouped_moe.GroupedMoEWeights`)."""

    gate_ED: torch.Tensor  # router, [E, D], every expert
    bias_E: torch.Tensor | None  # V3's e_score_correction_bias, every expert; None for V2
    w13_EFD: torch.Tensor  # [E_local, 2 * I_local, D], gate rows then up rows
    w2_EDF: torch.Tensor  # [E_local, D, I_local]
    first_expert: int  # global id of w13_EFD[0]
    shared: DenseWeights | None  # None when n_shared_experts = 0


def moe_block(x_TD: torch.Tensor, w_TK: torch.Tensor, ids_TK: torch.Tensor, w: MoEWeights, cfg: MoEConfig, *,
              kc: KernelConfig = DEFAULT_KERNELS) -> torch.Tensor:
    """This rank's share of the MoE block for tokens x_TD routed to ids_TK with weights w_TK: its local experts'
    SwiGLU outputs summed with their weights (pairs whose expert is elsewhere add nothing), plus its slice of the
    shared experts, which every token runs. Summed over the ranks that split the experts or their intermediate dims,
    and the shared experts' intermediate dim, it is transformers' DeepseekV2Moe / DeepseekV3MoE output. Where the
    routed experts see other tokens than the rank's own (EP's dispatch), the forward adds the shared experts itself
    (`dense_mlp`) and passes a `MoEWeights` without them."""
    # the engine's experts take weights in x's dtype (transformers multiplies in float32, then rounds)
    shared_TD = None if w.shared is None else dense_mlp(x_TD, w.shared.w13_FD, w.shared.w2_DF, kc=kc)
    return summed(experts(x_TD, w_TK.to(x_TD.dtype), ids_TK, w.w13_EFD, w.w2_EDF, w.first_expert, cfg.num_experts,
                          keep_pairs=True, kc=kc), shared_TD, kc=kc)
