"""The MoE block of DeepSeek-V2 / V3 and of the families that took it over (GLM-4.5): grouped top-k routing
(softmax, or sigmoid with a correction bias used for the choice only), routed experts, and shared experts every token
runs. What the families share: the block's config (`MoEConfig`), the router (`router_logits`, `route`), its weight
specs with Hugging Face's names (`moe_specs`) and views (`GroupedMoEWeights`, `moe_weights`), and its forward over
the `Communicator` (`moe`).

Shared experts: one 1/P shard of their intermediate dim on every rank in both layouts (the same region, so a switch
moves none of their bytes), run on the tokens the routed experts see and added to the routed output before the
combine sums over the ranks. TP: every token on every rank, summed by the all-reduce, as a dense MLP sharded by TP.
EP: the tokens of every rank (after the dispatch), summed by the combine's reduce-scatter: the FLOPs of running a
whole replica on one's own tokens, with 1/P of its bytes a rank and no bytes added to the exchange (the combine
carries a D-row a token anyway). Its cost: EP runs it on the dispatch's padding rows too (each rank's step padded to
the largest rank's token count).

Shapes: T tokens, D hidden, E experts (every expert for the router, the local ones for the expert weights), G expert
groups, K top-k, F rows of a [gate | up] stack.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Self

import torch
import torch.nn.functional as F

from moebius.config import ConfigError, ModelConfig
from moebius.kernels import DEFAULT_KERNELS, KernelConfig, triton_available
from moebius.kernels.pairs import PairRows
from moebius.layers.moe import beside, dense_mlp, experts, plus
from moebius.models.specs import ParamSpec, routed_expert_specs, shared_expert_specs
from moebius.models.weights import DenseWeights, MoEWeights, shared_expert_weights
from moebius.parallel.dispatch import Communicator
from moebius.parallel.layout import Layout

# (scoring_func, topk_method) pairs transformers computes: V2 softmax greedy / group-limited greedy, V3 and GLM-4.5
# sigmoid with the correction bias and group-limited top-k ("noaux_tc", the only method DeepSeek-V3's code accepts).
ROUTINGS = (("softmax", "greedy"), ("softmax", "group_limited_greedy"), ("sigmoid", "noaux_tc"))


@dataclass(frozen=True)
class MoEConfig:
    """The MoE fields of a config.json (Hugging Face names, but num_experts = n_routed_experts and top_k =
    num_experts_per_tok)."""

    num_experts: int
    top_k: int
    scoring_func: str  # "softmax" (DeepSeek-V2) or "sigmoid" (V3, GLM-4.5)
    topk_method: str  # "greedy", "group_limited_greedy" (V2) or "noaux_tc" (V3, GLM-4.5)
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
    def read(cls, hf: dict[str, Any], family: str, *, scoring_func: str, topk_method: str, moe_layer_freq: int = 1
             ) -> Self:
        """The fields from a config.json dict, the routing as the family says; ConfigError naming what is
        unsupported or missing (`family` names who needs it)."""
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"unsupported hidden_act {act!r}; {family}'s experts use 'silu'")
        if hf.get("mlp_bias"):
            raise ConfigError(f"mlp_bias = true is not supported: {family}'s MLPs and experts have no bias")

        def need(key: str) -> Any:
            value = hf.get(key)
            if value is None:
                raise ConfigError(f"config.json has no {key}, which {family}'s MoE layers need")
            return value

        grouped = topk_method != "greedy"
        return cls(
            num_experts=need("n_routed_experts"),
            top_k=need("num_experts_per_tok"),
            scoring_func=scoring_func,
            topk_method=topk_method,
            # greedy routing ignores the groups: one group holding every expert
            n_group=need("n_group") if grouped else 1,
            topk_group=need("topk_group") if grouped else 1,
            norm_topk_prob=bool(need("norm_topk_prob")),
            routed_scaling_factor=float(need("routed_scaling_factor")),
            n_shared_experts=hf.get("n_shared_experts") or 0,  # null: no shared experts, as DeepSeek's own code
            moe_intermediate_size=need("moe_intermediate_size"),
            intermediate_size=need("intermediate_size"),
            first_k_dense_replace=hf.get("first_k_dense_replace") or 0,
            moe_layer_freq=moe_layer_freq,
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
        """DeepSeek's own rule (GLM-4.5's with moe_layer_freq = 1). transformers' decoder layers ignore
        moe_layer_freq (1 in every published config): a checkpoint with another value holds dense MLPs where this
        says so."""
        return layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0


def router_logits(x_TD: torch.Tensor, gate_ED: torch.Tensor) -> torch.Tensor:
    """[T, E] in float32, as the routers compute them (inputs and weight upcast before the product)."""
    return F.linear(x_TD.float(), gate_ED.float())


def route_tokens(h_TD: torch.Tensor, gate_ED: torch.Tensor, cfg: MoEConfig, bias_E: torch.Tensor | None = None, *,
                 kc: KernelConfig = DEFAULT_KERNELS) -> tuple[torch.Tensor, torch.Tensor]:
    """`route(router_logits(h_TD, gate_ED), ...)`. On the GPU the float32 logits come as split-K partials of one
    Triton launch (`kernels.fused.router_partials_f32`), summed inside the routing launch: cuBLAS's float32 GEMM,
    after an upcast copy of h, ran as two launches on a few SMs (benchmarks/results/
    h100-p1-decode-profile-deepseek-big.json)."""
    if (h_TD.is_cuda and triton_available() and h_TD.stride(1) == 1 and gate_ED.dtype == torch.float32
            and gate_ED.is_contiguous()):
        from moebius.kernels.fused import router_partials_f32

        return route(router_partials_f32(h_TD, gate_ED, kc=kc), cfg, bias_E, kc=kc)
    return route(router_logits(h_TD, gate_ED), cfg, bias_E, kc=kc)


def route(logits_TE: torch.Tensor, cfg: MoEConfig, bias_E: torch.Tensor | None = None, *,
          kc: KernelConfig = DEFAULT_KERNELS) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing weights [T, K] (float32) and global expert ids [T, K] from the router's float32 logits [T, E] (on the
    GPU also their split-K partials [S, T, E], `route_tokens`).

    softmax: softmax scores, top-k over all experts (greedy) or over the topk_group groups with the best single
    score. sigmoid: sigmoid scores; bias_E (e_score_correction_bias) is added for choosing the groups (each scored by
    its best two) and the experts only, the weights are the unbiased scores. Then norm_topk_prob's renormalisation
    and the routed_scaling_factor. Every top-k is torch.topk(sorted=False) on the values transformers feeds it, so
    the ids come in its order and ties break as in transformers. On the GPU one Triton launch (`kernels.fused.
    grouped_topk`: each token's ids in descending order of choice, in place of the torch ops' many small launches).
    """
    if logits_TE.is_cuda and triton_available():
        from moebius.kernels.fused import grouped_topk

        return grouped_topk(logits_TE.contiguous(), bias_E, cfg.top_k, cfg.scoring_func == "sigmoid", cfg.n_group,
                            cfg.topk_group, cfg.topk_method == "noaux_tc", cfg.norm_topk_prob,
                            cfg.routed_scaling_factor, kc=kc)
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
    """choice_TE with the experts outside each token's topk_group best groups masked: noaux_tc masks with -inf,
    softmax with 0 (its scores are positive, so a masked expert is never chosen while its kept groups hold top_k
    experts)."""
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


@dataclass
class GroupedMoEWeights(MoEWeights):
    """The engine's MoE views (the switch moves w13 / w2) and the block's own: the routing bias and this rank's
    shard of the shared experts."""

    bias_E: torch.Tensor | None = None  # e_score_correction_bias, every expert (sigmoid routing); None for softmax
    shared: DenseWeights | None = None  # this rank's 1/P of the shared experts' intermediate dim; None without them


def moe_specs(cfg: ModelConfig, moe: MoEConfig, lay: Layout, i: int, elt: int) -> list[ParamSpec]:
    """MoE layer `i`'s views: the router and its local experts (`routed_expert_specs`), the sigmoid router's
    correction bias (mlp.gate.e_score_correction_bias), and this rank's 1/P shard of the shared experts
    (mlp.shared_experts.{gate,up,down}_proj: gate rows then up rows, down columns)."""
    E, p = cfg.num_experts, f"model.layers.{i}."
    specs = routed_expert_specs(cfg, lay, i, elt, router_dtype=torch.float32)  # as transformers keeps it
    if moe.scoring_func == "sigmoid":
        specs.append(ParamSpec(p + "mlp.gate.bias", (E,), lambda f: f(p + "mlp.gate.e_score_correction_bias", (E,)),
                               dtype=torch.float32))
    if moe.n_shared_experts:
        specs += shared_expert_specs(cfg, lay, p, "mlp.shared_experts.", moe.shared_intermediate_size)
    return specs


def moe_weights(views: dict[str, torch.Tensor], lay: Layout, i: int) -> GroupedMoEWeights:
    """MoE layer `i`'s `GroupedMoEWeights` from the views of `moe_specs`."""
    p = f"model.layers.{i}."
    return GroupedMoEWeights(views[p + "mlp.gate"], views[p + "mlp.experts.w13"], views[p + "mlp.experts.w2"],
                             lay.first_expert, bias_E=views.get(p + "mlp.gate.bias"),
                             shared=shared_expert_weights(views, lay.rank, lay.world_size, p))


def moe(h_TD: torch.Tensor, w: GroupedMoEWeights, cfg: MoEConfig, comm: Communicator, kc: KernelConfig,
        routed_TK: torch.Tensor | None = None) -> tuple[torch.Tensor | PairRows, object]:
    """This rank's part of the MoE block's output for the tokens dispatched to it (its local experts' pairs plus its
    shard of the shared experts), and the handle that combines it. routed_TK: where the router's global expert ids
    are written (taken before the dispatch: the same in every layout)."""
    w_TK, ids_TK = route_tokens(h_TD, w.gate_ED, cfg, w.bias_E, kc=kc)
    if routed_TK is not None:
        routed_TK[: ids_TK.shape[0]].copy_(ids_TK)
    # the engine's experts take weights in x's dtype (transformers multiplies in float32, then rounds)
    x_TD, w_TK, ids_TK, handle = comm.dispatch(h_TD, w_TK.to(h_TD.dtype), ids_TK, kc=kc)
    # the shared experts: a 1/P shard on the dispatched tokens (the combine's sum over ranks completes it), added
    # inside the sum over each token's pairs, the combine's (`plus`; with kc.shared_stream computed beside the routed
    # experts)
    shared = None if w.shared is None else beside(
        lambda: dense_mlp(x_TD, w.shared.w13_FD, w.shared.w2_DF, kc=kc), x_TD, kc)
    pairs = experts(x_TD, w_TK, ids_TK, w.w13_EFD, w.w2_EDF, w.first_expert, cfg.num_experts, keep_pairs=True, kc=kc)
    return plus(pairs, None if shared is None else shared()), handle
