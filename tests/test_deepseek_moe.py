"""DeepSeek-V2 / V3 routing and MoE block (moebius/models/deepseek/moe.py) against transformers' own modules on
random weights, float32 on the CPU. Routing: the same ids in the same order and the same weights (rtol 1e-6: the same
ops on the same values); the block: transformers' forward within rtol 1e-5 (the experts' sums run in another order);
partial blocks over expert subsets and intermediate slices sum to the whole within the same tolerance."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV2Config, DeepseekV3Config
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2DecoderLayer, DeepseekV2Moe
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3MoE

from moebius.config import ConfigError
from moebius.models.deepseek.moe import DenseWeights, MoEConfig, MoEWeights, moe_block, route, router_logits
from moebius.models.grouped_moe import route_tokens

D, E, INTER, T = 32, 16, 8, 24
RTOL, ATOL = 1e-5, 1e-6

# tiny attention shapes, only so transformers can build whole decoder layers
ATTN = dict(num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
            qk_nope_head_dim=8, v_head_dim=8)


def v3_config(**kw) -> DeepseekV3Config:
    fields = dict(hidden_size=D, intermediate_size=48, moe_intermediate_size=INTER, n_routed_experts=E,
                  num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=2, routed_scaling_factor=2.5,
                  norm_topk_prob=True, first_k_dense_replace=1, num_hidden_layers=4, **ATTN)
    return DeepseekV3Config(**(fields | kw))


def v2_config(**kw) -> DeepseekV2Config:
    fields = dict(hidden_size=D, intermediate_size=48, moe_intermediate_size=INTER, n_routed_experts=E,
                  num_experts_per_tok=3, n_group=4, topk_group=2, topk_method="group_limited_greedy",
                  n_shared_experts=2, routed_scaling_factor=2.0, norm_topk_prob=False, first_k_dense_replace=1,
                  num_hidden_layers=4, **ATTN)
    return DeepseekV2Config(**(fields | kw))


def hf_moe(config: DeepseekV2Config | DeepseekV3Config, seed: int = 0) -> DeepseekV2Moe | DeepseekV3MoE:
    """The transformers block with random weights: router logits of std ~1, so sigmoid / softmax scores spread and
    the groups and the bias change which experts win."""
    moe = DeepseekV3MoE(config) if isinstance(config, DeepseekV3Config) else DeepseekV2Moe(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
        if isinstance(moe, DeepseekV3MoE):
            moe.gate.e_score_correction_bias.copy_(torch.randn(E, generator=gen) * 0.1)
    return moe.eval()


def inputs(seed: int = 1, tokens: int = T) -> torch.Tensor:
    return torch.randn(tokens, D, generator=torch.Generator().manual_seed(seed))


def bias_of(moe: DeepseekV2Moe | DeepseekV3MoE) -> torch.Tensor | None:
    return moe.gate.e_score_correction_bias if isinstance(moe, DeepseekV3MoE) else None


def weights_of(moe: DeepseekV2Moe | DeepseekV3MoE, experts: slice = slice(None), inter: slice = slice(None),
               shared: slice | None = slice(None)) -> MoEWeights:
    """Our view of transformers' block: the experts in `experts` (a range), each cut to the intermediate slice
    `inter`, and the shared experts cut to `shared` (None: left out)."""
    gu_EFD = moe.experts.gate_up_proj.detach()[experts]
    w13_EFD = torch.cat([gu_EFD[:, :INTER][:, inter], gu_EFD[:, INTER:][:, inter]], dim=1)
    dense = None
    if shared is not None:
        s = moe.shared_experts
        dense = DenseWeights(torch.cat([s.gate_proj.weight[shared], s.up_proj.weight[shared]]).detach(),
                             s.down_proj.weight[:, shared].detach())
    return MoEWeights(gate_ED=moe.gate.weight.detach(), bias_E=bias_of(moe), w13_EFD=w13_EFD,
                      w2_EDF=moe.experts.down_proj.detach()[experts][:, :, inter],
                      first_expert=experts.start or 0, shared=dense)


def ours_route(moe: DeepseekV2Moe | DeepseekV3MoE, cfg: MoEConfig, x_TD: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    return route(router_logits(x_TD, moe.gate.weight), cfg, bias_of(moe))


def check_route(moe: DeepseekV2Moe | DeepseekV3MoE, cfg: MoEConfig) -> tuple[torch.Tensor, torch.Tensor]:
    x_TD = inputs()
    with torch.no_grad():
        logits_ref, w_ref, ids_ref = moe.gate(x_TD)
    assert torch.equal(router_logits(x_TD, moe.gate.weight), logits_ref)
    w_TK, ids_TK = ours_route(moe, cfg, x_TD)
    assert torch.equal(ids_TK, ids_ref)
    torch.testing.assert_close(w_TK, w_ref, rtol=1e-6, atol=0)
    return logits_ref, ids_ref


def differs(ids_a: torch.Tensor, ids_b: torch.Tensor) -> bool:
    """Some token picks another set of experts."""
    return not torch.equal(ids_a.sort(dim=-1).values, ids_b.sort(dim=-1).values)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_v3_grouped_sigmoid_routing_matches_transformers(norm_topk_prob: bool) -> None:
    config = v3_config(norm_topk_prob=norm_topk_prob)
    moe = hf_moe(config)
    cfg = MoEConfig.from_hf(config.to_dict())
    logits_TE, ids_TK = check_route(moe, cfg)
    # the inputs exercise both rules: without the groups, or without the bias, other experts would win
    ungrouped = MoEConfig.from_hf(config.to_dict() | dict(n_group=1, topk_group=1))
    assert differs(route(logits_TE, ungrouped, bias_of(moe))[1], ids_TK)
    assert differs(route(logits_TE, cfg)[1], ids_TK)
    # the bias picks the experts only: the weights are the unbiased scores
    w_TK, _ = route(logits_TE, cfg, bias_of(moe))
    expected = logits_TE.sigmoid().gather(1, ids_TK)
    if norm_topk_prob:
        expected = expected / expected.sum(-1, keepdim=True)
    torch.testing.assert_close(w_TK, expected * 2.5, rtol=1e-6, atol=0)


@pytest.mark.parametrize("topk_method", ["greedy", "group_limited_greedy"])
def test_v2_softmax_routing_matches_transformers(topk_method: str) -> None:
    config = v2_config(topk_method=topk_method)
    moe = hf_moe(config)
    cfg = MoEConfig.from_hf(config.to_dict())
    logits_TE, ids_TK = check_route(moe, cfg)
    if topk_method == "group_limited_greedy":
        greedy = MoEConfig.from_hf(config.to_dict() | dict(topk_method="greedy"))
        assert differs(route(logits_TE, greedy)[1], ids_TK)


@pytest.mark.parametrize("make,topk_method", [(v2_config, "greedy"), (v2_config, "group_limited_greedy"),
                                               (v3_config, "noaux_tc")])
def test_ties_break_as_in_transformers(make, topk_method: str) -> None:
    """Inputs and router weights on a coarse grid (and V3's bias on a grid of 1/8): many tokens have experts tied at
    the k-th place, and transformers' ids (which of the tied, in which order) come back."""
    config = make() if topk_method == "noaux_tc" else make(topk_method=topk_method)
    moe = hf_moe(config)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        moe.gate.weight.copy_(torch.randint(-1, 2, (E, D), generator=gen) * 0.25)
        if isinstance(moe, DeepseekV3MoE):
            moe.gate.e_score_correction_bias.copy_(torch.randint(-1, 2, (E,), generator=gen) * 0.125)
        x_TD = torch.randint(-1, 2, (T, D), generator=gen).float()
        _, w_ref, ids_ref = moe.gate(x_TD)
    cfg = MoEConfig.from_hf(config.to_dict())
    logits_TE = router_logits(x_TD, moe.gate.weight)
    scores_TE = logits_TE.sigmoid() if cfg.scoring_func == "sigmoid" else logits_TE.softmax(-1)
    bias_E = bias_of(moe)
    choice_TE = (scores_TE if bias_E is None else scores_TE + bias_E).sort(dim=-1, descending=True).values
    assert (choice_TE[:, cfg.top_k - 1] == choice_TE[:, cfg.top_k]).sum() >= 5  # ties at the boundary
    w_TK, ids_TK = route(logits_TE, cfg, bias_E)
    assert torch.equal(ids_TK, ids_ref)
    torch.testing.assert_close(w_TK, w_ref, rtol=1e-6, atol=0)


def test_route_empty_batch() -> None:
    """A rank may route no tokens in a step (EP with no requests of its own)."""
    cfg = MoEConfig.from_hf(v3_config().to_dict())
    w_TK, ids_TK = route(torch.empty(0, E), cfg, torch.zeros(E))
    assert w_TK.shape == ids_TK.shape == (0, 4)


@pytest.mark.parametrize("make", [v2_config, v3_config], ids=["v2", "v3"])
def test_moe_block_matches_transformers(make) -> None:
    config = make()
    moe = hf_moe(config)
    cfg = MoEConfig.from_hf(config.to_dict())
    x_TD = inputs()
    with torch.no_grad():
        expected = moe(x_TD[None])[0]
    w_TK, ids_TK = ours_route(moe, cfg, x_TD)
    torch.testing.assert_close(moe_block(x_TD, w_TK, ids_TK, weights_of(moe), cfg), expected, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("split", ["experts", "intermediate"])
def test_partial_blocks_sum_to_whole(split: str) -> None:
    """Two ranks: each holds half the experts whole (EP) or every expert's half intermediate slice (TP), and half the
    shared experts' intermediate dim; their outputs sum to the whole block."""
    config = v3_config()
    moe = hf_moe(config)
    cfg = MoEConfig.from_hf(config.to_dict())
    x_TD = inputs()
    w_TK, ids_TK = ours_route(moe, cfg, x_TD)
    whole = moe_block(x_TD, w_TK, ids_TK, weights_of(moe), cfg)
    shared_half = cfg.shared_intermediate_size // 2
    shared = [slice(0, shared_half), slice(shared_half, None)]
    if split == "experts":
        parts = [weights_of(moe, experts=slice(0, E // 2), shared=shared[0]),
                 weights_of(moe, experts=slice(E // 2, E), shared=shared[1])]
    else:
        parts = [weights_of(moe, inter=slice(0, INTER // 2), shared=shared[0]),
                 weights_of(moe, inter=slice(INTER // 2, None), shared=shared[1])]
    outs = [moe_block(x_TD, w_TK, ids_TK, w, cfg) for w in parts]
    assert all(out.abs().sum() > 0 for out in outs)
    torch.testing.assert_close(outs[0] + outs[1], whole, rtol=RTOL, atol=ATOL)
    # without the shared experts, the routed part alone: every token gets a share from some rank
    routed = [moe_block(x_TD, w_TK, ids_TK, MoEWeights(**{**vars(w), "shared": None}), cfg) for w in parts]
    shared_out = whole - routed[0] - routed[1]
    s = moe.shared_experts
    with torch.no_grad():
        torch.testing.assert_close(shared_out, s(x_TD), rtol=RTOL, atol=1e-5)


@pytest.mark.parametrize("make,layer_cls", [(v2_config, DeepseekV2DecoderLayer), (v3_config, DeepseekV3DecoderLayer)],
                         ids=["v2", "v3"])
@pytest.mark.parametrize("first_k_dense_replace", [0, 1, 3])
def test_moe_layers_as_transformers_builds_them(make, layer_cls, first_k_dense_replace: int) -> None:
    config = make(first_k_dense_replace=first_k_dense_replace)
    cfg = MoEConfig.from_hf(config.to_dict())
    for i in range(config.num_hidden_layers):
        is_moe = isinstance(layer_cls(config, i).mlp, (DeepseekV2Moe, DeepseekV3MoE))
        assert cfg.is_moe_layer(i) == is_moe, i


def test_moe_layer_freq_follows_deepseek_code() -> None:
    cfg = MoEConfig.from_hf(v3_config().to_dict() | dict(first_k_dense_replace=1, moe_layer_freq=2))
    assert [cfg.is_moe_layer(i) for i in range(6)] == [False, False, True, False, True, False]


# The MoE fields of published config.json files.
DEEPSEEK_V2_LITE = dict(architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", n_routed_experts=64,
                        num_experts_per_tok=6, n_group=1, topk_group=1, topk_method="greedy", scoring_func="softmax",
                        norm_topk_prob=False, routed_scaling_factor=1.0, n_shared_experts=2,
                        moe_intermediate_size=1408, intermediate_size=10944, first_k_dense_replace=1,
                        moe_layer_freq=1, hidden_act="silu")
DEEPSEEK_V3 = dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", n_routed_experts=256,
                   num_experts_per_tok=8, n_group=8, topk_group=4, topk_method="noaux_tc", scoring_func="sigmoid",
                   norm_topk_prob=True, routed_scaling_factor=2.5, n_shared_experts=1, moe_intermediate_size=2048,
                   intermediate_size=18432, first_k_dense_replace=3, moe_layer_freq=1, hidden_act="silu")


def test_published_configs() -> None:
    lite = MoEConfig.from_hf(DEEPSEEK_V2_LITE)
    assert (lite.scoring_func, lite.topk_method, lite.n_group, lite.topk_group) == ("softmax", "greedy", 1, 1)
    assert lite.shared_intermediate_size == 2816 and not lite.is_moe_layer(0) and lite.is_moe_layer(1)
    v3 = MoEConfig.from_hf(DEEPSEEK_V3)
    assert (v3.num_experts, v3.top_k, v3.n_group, v3.topk_group) == (256, 8, 8, 4)
    assert (v3.scoring_func, v3.topk_method, v3.norm_topk_prob, v3.routed_scaling_factor) == (
        "sigmoid", "noaux_tc", True, 2.5)
    assert [v3.is_moe_layer(i) for i in range(5)] == [False, False, False, True, True]
    # Kimi K2 ships model_type kimi_k2; transformers' own V3 dict carries neither scoring_func nor topk_method
    kimi = MoEConfig.from_hf(DEEPSEEK_V3 | dict(architectures=None, model_type="kimi_k2", n_group=1, topk_group=1))
    assert (kimi.scoring_func, kimi.topk_method) == ("sigmoid", "noaux_tc")
    bare = {k: v for k, v in DEEPSEEK_V3.items() if k not in ("scoring_func", "topk_method")}
    assert MoEConfig.from_hf(bare) == v3


@pytest.mark.parametrize("base,change,named", [
    (DEEPSEEK_V3, dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe"), "not a DeepSeek"),
    (DEEPSEEK_V2_LITE, dict(norm_topk_prob=True), "norm_topk_prob"),
    (DEEPSEEK_V3, dict(topk_method="greedy"), "topk_method"),
    (DEEPSEEK_V2_LITE, dict(scoring_func="sigmoid"), "scoring_func"),
    (DEEPSEEK_V3, dict(n_group=3), "n_group"),
    (DEEPSEEK_V3, dict(topk_group=9), "topk_group"),
    (DEEPSEEK_V3, dict(topk_group=1, num_experts_per_tok=40), "num_experts_per_tok"),
    (DEEPSEEK_V3, dict(n_group=256, topk_group=8), "best two"),
    (DEEPSEEK_V3, dict(hidden_act="gelu"), "hidden_act"),
    (DEEPSEEK_V2_LITE, dict(mlp_bias=True), "mlp_bias"),
    (DEEPSEEK_V2_LITE, dict(n_routed_experts=None), "n_routed_experts"),
    (DEEPSEEK_V2_LITE, dict(topk_method="group_limited_greedy", n_group=None), "n_group"),
])
def test_config_errors_name_the_field(base: dict, change: dict, named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        MoEConfig.from_hf(base | change)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float().cpu() - b.float().cpu()).norm() / b.float().cpu().norm()).item()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype,backend,tol", [(torch.bfloat16, "triton", 2e-2), (torch.bfloat16, "grouped_mm", 2e-2),
                                               (torch.float32, "triton", 1e-4)])
def test_gpu_route_and_block_match_the_cpu(dtype: torch.dtype, backend: str, tol: float) -> None:
    """On the GPU: route picks the experts the CPU picks on the same float32 logits, and moe_block through the
    engine's GPU experts (bf16: the fused Triton kernel or torch._grouped_mm; float32: the dense loop), for the
    upper half of the experts and half the shared experts, is the float32 CPU block within tol (relative norm)."""
    from moebius.kernels import KernelConfig

    d, inter, experts, tokens = 256, 192, 64, 77
    cfg = MoEConfig.from_hf(DEEPSEEK_V3 | dict(n_routed_experts=experts, moe_intermediate_size=inter,
                                               n_shared_experts=2))
    gen = torch.Generator().manual_seed(0)
    x_TD = torch.randn(tokens, d, generator=gen)
    gate_ED = torch.randn(experts, d, generator=gen) * 0.06
    bias_E = torch.randn(experts, generator=gen) * 0.1
    w13_EFD = torch.randn(experts, 2 * inter, d, generator=gen) * 0.05
    w2_EDF = torch.randn(experts, d, inter, generator=gen) * 0.05
    shared_FD = torch.randn(2 * 2 * inter, d, generator=gen) * 0.05
    shared_DF = torch.randn(d, 2 * inter, generator=gen) * 0.05
    half = experts // 2
    # the shared experts' first intermediate half: its gate rows, then its up rows
    shared = DenseWeights(torch.cat([shared_FD[:inter], shared_FD[2 * inter:3 * inter]]), shared_DF[:, :inter])
    part = MoEWeights(gate_ED, bias_E, w13_EFD[half:], w2_EDF[half:], half, shared)

    logits_TE = router_logits(x_TD, gate_ED)
    w_TK, ids_TK = route(logits_TE, cfg, bias_E)
    w_gpu, ids_gpu = route(logits_TE.cuda(), cfg, bias_E.cuda())
    order, order_gpu = ids_TK.argsort(dim=-1), ids_gpu.cpu().argsort(dim=-1)  # sorted=False: the order may differ
    assert torch.equal(ids_TK.gather(1, order), ids_gpu.cpu().gather(1, order_gpu))
    torch.testing.assert_close(w_TK.gather(1, order), w_gpu.cpu().gather(1, order_gpu), rtol=1e-5, atol=1e-6)
    # from the hidden states: the float32 router's split-K partials, summed inside the routing launch
    x_in = x_TD.to(dtype).float()  # the hidden states as the engine holds them
    w_in, ids_in = route(router_logits(x_in, gate_ED), cfg, bias_E)
    w_h, ids_h = route_tokens(x_in.to("cuda", dtype), gate_ED.cuda(), cfg, bias_E.cuda())
    order, order_h = ids_in.argsort(dim=-1), ids_h.cpu().argsort(dim=-1)
    assert torch.equal(ids_in.gather(1, order), ids_h.cpu().gather(1, order_h))
    torch.testing.assert_close(w_in.gather(1, order), w_h.cpu().gather(1, order_h), rtol=1e-4, atol=1e-5)

    ref = moe_block(x_TD, w_TK, ids_TK, part, cfg)
    on_gpu = MoEWeights(gate_ED.cuda(), bias_E.cuda(), part.w13_EFD.to("cuda", dtype), part.w2_EDF.to("cuda", dtype),
                        half, DenseWeights(shared.w13_FD.to("cuda", dtype), shared.w2_DF.to("cuda", dtype)))
    out = moe_block(x_TD.to("cuda", dtype), w_gpu, ids_gpu, on_gpu, cfg, kc=KernelConfig(moe_backend=backend))
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert rel(out, ref) < tol


def test_the_engine_block_hands_the_shared_output_on_with_the_pairs(monkeypatch) -> None:
    """The engine's MoE block (models/grouped_moe.py `moe`): where the experts come back per pair (the fused GPU
    kernels), the shared experts' output rides with them (`PairRows.plus`) to the combine's launch that sums them,
    unsummed here; where they come back summed (the CPU), it is added at once."""
    from moebius.kernels import DEFAULT_KERNELS
    from moebius.kernels.pairs import PairRows
    from moebius.layers.moe import dense_mlp
    from moebius.models import grouped_moe
    from moebius.parallel.dispatch import LocalComm

    config = v3_config()
    cfg = MoEConfig.from_hf(config.to_dict())
    g = torch.Generator().manual_seed(3)
    shared = DenseWeights(torch.randn(2 * 2 * INTER, D, generator=g), torch.randn(D, 2 * INTER, generator=g))
    w = grouped_moe.GroupedMoEWeights(torch.randn(E, D, generator=g), torch.randn(E, 2 * INTER, D, generator=g),
                                      torch.randn(E, D, INTER, generator=g), 0, torch.zeros(E), shared)
    x = inputs()
    summed, _ = grouped_moe.moe(x, w, cfg, LocalComm(), DEFAULT_KERNELS)
    assert isinstance(summed, torch.Tensor)
    per_pair = PairRows(torch.zeros(T * cfg.top_k, D), torch.zeros(T, cfg.top_k, dtype=torch.long), 0, E)
    monkeypatch.setattr(grouped_moe, "experts", lambda *a, **kw: per_pair)
    pairs, _ = grouped_moe.moe(x, w, cfg, LocalComm(), DEFAULT_KERNELS)
    assert isinstance(pairs, PairRows) and pairs.y_ND is per_pair.y_ND
    assert torch.equal(pairs.add_TD, dense_mlp(x, shared.w13_FD, shared.w2_DF))
