"""DeepSeek-V2 / V3 routing and MoE block (transformers' DeepseekV2TopkRouter / DeepseekV2Moe and
DeepseekV3TopkRouter / DeepseekV3MoE semantics), the torch reference.

Layout-free: the functions take whatever weights the caller holds (a contiguous range of whole experts in EP, every
expert's intermediate slice in TP, a slice of the shared experts' intermediate dim) and never know a rank; a sum over
the ranks of their outputs is the whole block. Shapes: T tokens, D hidden, E experts (every expert for the router,
the local ones for the expert weights), G expert groups, K top-k, F rows of a [gate | up] stack.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from moebius.config import ConfigError
from moebius.kernels import DEFAULT_KERNELS, KernelConfig
from moebius.layers.moe import dense_mlp, experts, summed

# (scoring_func, topk_method) pairs transformers computes: V2 softmax greedy / group-limited greedy, V3 sigmoid with
# the correction bias and group-limited top-k ("noaux_tc", the only method DeepSeek-V3's own code accepts).
ROUTINGS = (("softmax", "greedy"), ("softmax", "group_limited_greedy"), ("sigmoid", "noaux_tc"))


@dataclass(frozen=True)
class MoEConfig:
    """The MoE fields of a DeepSeek-V2 / V3 config.json (Hugging Face names, but num_experts = n_routed_experts and
    top_k = num_experts_per_tok)."""

    num_experts: int
    top_k: int
    scoring_func: str  # "softmax" (V2) or "sigmoid" (V3)
    topk_method: str  # "greedy", "group_limited_greedy" (V2) or "noaux_tc" (V3)
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    n_shared_experts: int
    moe_intermediate_size: int  # one routed expert
    intermediate_size: int  # the dense layers' MLP
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> MoEConfig:
        """Build from a config.json dict (DeepseekV2ForCausalLM or DeepseekV3ForCausalLM, by `architectures`, else
        by `model_type`); raise ConfigError naming what is unsupported or missing."""
        version = _version(hf)
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"unsupported hidden_act {act!r}; DeepSeek's experts use 'silu'")
        if hf.get("mlp_bias"):
            raise ConfigError("mlp_bias = true is not supported: DeepSeek's MLPs and experts have no bias")
        # transformers' V3 config has neither field and always routes this way; DeepSeek's V2 code defaults them so
        default_scoring, default_method = ("softmax", "greedy") if version == 2 else ("sigmoid", "noaux_tc")
        method = hf.get("topk_method") or default_method
        grouped = method != "greedy"
        return cls(
            num_experts=_need(hf, "n_routed_experts"),
            top_k=_need(hf, "num_experts_per_tok"),
            scoring_func=hf.get("scoring_func") or default_scoring,
            topk_method=method,
            # greedy routing ignores the groups: one group holding every expert
            n_group=_need(hf, "n_group") if grouped else 1,
            topk_group=_need(hf, "topk_group") if grouped else 1,
            norm_topk_prob=bool(_need(hf, "norm_topk_prob")),
            routed_scaling_factor=float(_need(hf, "routed_scaling_factor")),
            n_shared_experts=hf.get("n_shared_experts") or 0,  # null: no shared experts, as DeepSeek's own code
            moe_intermediate_size=_need(hf, "moe_intermediate_size"),
            intermediate_size=_need(hf, "intermediate_size"),
            first_k_dense_replace=hf.get("first_k_dense_replace") or 0,
            moe_layer_freq=hf.get("moe_layer_freq") or 1,
        )

    def __post_init__(self) -> None:
        if (self.scoring_func, self.topk_method) not in ROUTINGS:
            raise ConfigError(f"unsupported routing scoring_func={self.scoring_func!r} with topk_method="
                              f"{self.topk_method!r}; supported: " + ", ".join(f"{s} + {m}" for s, m in ROUTINGS))
        if self.scoring_func == "softmax" and self.norm_topk_prob:
            # transformers' DeepseekV2TopkRouter never renormalises, DeepSeek's V2 code does (and then skips the
            # scaling factor): the two disagree, and no published V2 checkpoint sets it
            raise ConfigError("norm_topk_prob = true with softmax (DeepSeek-V2) routing is not supported")
        if not 1 <= self.top_k <= self.num_experts:
            raise ConfigError(f"num_experts_per_tok {self.top_k} must be in 1..n_routed_experts {self.num_experts}")
        if self.n_group < 1 or self.num_experts % self.n_group:
            raise ConfigError(f"n_routed_experts {self.num_experts} is not a multiple of n_group {self.n_group}")
        per_group = self.num_experts // self.n_group
        if not 1 <= self.topk_group <= self.n_group:
            raise ConfigError(f"topk_group {self.topk_group} must be in 1..n_group {self.n_group}")
        if self.top_k > self.topk_group * per_group:
            raise ConfigError(f"num_experts_per_tok {self.top_k} exceeds the {self.topk_group * per_group} experts "
                              f"of topk_group {self.topk_group} groups of {per_group}")
        if self.topk_method == "noaux_tc" and per_group < 2:
            raise ConfigError(f"noaux_tc routing scores a group by its best two experts; n_group {self.n_group} "
                              f"leaves {per_group} expert a group")
        if self.moe_intermediate_size <= 0 or self.n_shared_experts < 0:
            raise ConfigError(f"moe_intermediate_size {self.moe_intermediate_size} must be positive and "
                              f"n_shared_experts {self.n_shared_experts} not negative")
        if self.first_k_dense_replace < 0 or self.moe_layer_freq < 1:
            raise ConfigError(f"first_k_dense_replace {self.first_k_dense_replace} must be >= 0 and moe_layer_freq "
                              f"{self.moe_layer_freq} >= 1")

    @property
    def shared_intermediate_size(self) -> int:
        """The shared experts run as one dense SwiGLU MLP of this intermediate size."""
        return self.n_shared_experts * self.moe_intermediate_size

    def is_moe_layer(self, layer: int) -> bool:
        """DeepSeek's own rule. transformers' decoder layers ignore moe_layer_freq (1 in every published config):
        a checkpoint with another value holds dense MLPs where this says so."""
        return layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0


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


def _need(hf: dict[str, Any], key: str) -> Any:
    value = hf.get(key)
    if value is None:
        raise ConfigError(f"config.json has no {key}, which DeepSeek's MoE layers need")
    return value


@dataclass
class DenseWeights:
    """A SwiGLU MLP: the dense layers' (first_k_dense_replace) and the shared experts'."""

    w13_FD: torch.Tensor  # [2 * I_local, D]: this rank's gate rows, then its up rows
    w2_DF: torch.Tensor  # [D, I_local]


@dataclass
class MoEWeights:
    gate_ED: torch.Tensor  # router, [E, D], every expert
    bias_E: torch.Tensor | None  # V3's e_score_correction_bias, every expert; None for V2
    w13_EFD: torch.Tensor  # [E_local, 2 * I_local, D], gate rows then up rows
    w2_EDF: torch.Tensor  # [E_local, D, I_local]
    first_expert: int  # global id of w13_EFD[0]
    shared: DenseWeights | None  # None when n_shared_experts = 0


def router_logits(x_TD: torch.Tensor, gate_ED: torch.Tensor) -> torch.Tensor:
    """[T, E] in float32, as both routers compute them (inputs and weight upcast before the product)."""
    return F.linear(x_TD.float(), gate_ED.float())


def route(logits_TE: torch.Tensor, cfg: MoEConfig, bias_E: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing weights [T, K] (float32) and global expert ids [T, K] from the router's float32 logits.

    V2: softmax scores, top-k over all experts (greedy) or over the topk_group groups with the best single score.
    V3: sigmoid scores; bias_E (e_score_correction_bias) is added for choosing the groups (each scored by its best
    two) and the experts only, the weights are the unbiased scores. Then norm_topk_prob's renormalisation and the
    routed_scaling_factor. Every top-k is torch.topk(sorted=False) on the values transformers feeds it, so the ids
    come in its order and ties break as in transformers.
    """
    if cfg.scoring_func == "sigmoid":
        scores_TE = logits_TE.sigmoid()
    else:
        scores_TE = logits_TE.softmax(dim=-1, dtype=torch.float32)
    choice_TE = scores_TE if bias_E is None else scores_TE + bias_E
    if cfg.topk_group < cfg.n_group:  # keeping every group masks nothing
        choice_TE = _mask_groups(choice_TE, cfg)
    ids_TK = torch.topk(choice_TE, cfg.top_k, dim=-1, sorted=False)[1]
    w_TK = scores_TE.gather(1, ids_TK)
    if cfg.norm_topk_prob:
        w_TK = w_TK / (w_TK.sum(dim=-1, keepdim=True) + 1e-20)
    return w_TK * cfg.routed_scaling_factor, ids_TK


def _mask_groups(choice_TE: torch.Tensor, cfg: MoEConfig) -> torch.Tensor:
    """choice_TE with the experts outside each token's topk_group best groups masked: V3 masks with -inf, V2 with 0
    (softmax scores are positive, so a masked expert is never chosen while its kept groups hold top_k experts)."""
    T = choice_TE.shape[0]
    choice_TGX = choice_TE.view(T, cfg.n_group, cfg.num_experts // cfg.n_group)
    if cfg.topk_method == "noaux_tc":
        group_TG = choice_TGX.topk(2, dim=-1)[0].sum(dim=-1)
        fill = float("-inf")
    else:
        group_TG = choice_TGX.max(dim=-1).values
        fill = 0.0
    kept_TG = torch.topk(group_TG, cfg.topk_group, dim=-1, sorted=False)[1]
    keep_TG = torch.zeros_like(group_TG, dtype=torch.bool).scatter_(1, kept_TG, True)
    keep_TE = keep_TG.unsqueeze(-1).expand_as(choice_TGX).reshape(T, cfg.num_experts)
    return choice_TE.masked_fill(~keep_TE, fill)


def moe_block(x_TD: torch.Tensor, w_TK: torch.Tensor, ids_TK: torch.Tensor, w: MoEWeights, cfg: MoEConfig, *,
              kc: KernelConfig = DEFAULT_KERNELS) -> torch.Tensor:
    """This rank's share of the MoE block for tokens x_TD routed to ids_TK with weights w_TK: its local experts'
    SwiGLU outputs summed with their weights (pairs whose expert is elsewhere add nothing), plus its slice of the
    shared experts, which every token runs. Summed over the ranks that split the experts or their intermediate dims,
    and the shared experts' intermediate dim, it is transformers' DeepseekV2Moe / DeepseekV3MoE output. Where the
    routed experts see other tokens than the rank's own (EP's dispatch), the forward adds the shared experts itself
    (`dense_mlp`) and passes a `MoEWeights` without them."""
    # the engine's experts take weights in x's dtype (transformers multiplies in float32, then rounds)
    y_TD = summed(experts(x_TD, w_TK.to(x_TD.dtype), ids_TK, w.w13_EFD, w.w2_EDF, w.first_expert, cfg.num_experts,
                          kc=kc), kc=kc)
    if w.shared is not None:
        y_TD = y_TD + dense_mlp(x_TD, w.shared.w13_FD, w.shared.w2_DF, kc=kc)
    return y_TD
