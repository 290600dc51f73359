"""Pure unit tests of `moebius.parallel.layout`: the placement of heads, KV heads (replicated when fewer than the
ranks), experts, expert-intermediate shards and layer slots of each rank in TP and EP, the sharding functions, and
the start-up shape check. No processes, no checkpoints: every cut is checked against the full tensor it came from,
and the TP cuts are checked numerically (the per-rank partial results sum to the full computation).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from moebius.config import ConfigError, ModelConfig
from moebius.parallel.layout import MODES, Layout, check_shapes, expert_slots, slot_groups, slot_shifts

H, KV_CHOICES, E, I_MOE, I_DENSE, D, HEAD_DIM = 16, (1, 2, 4, 8, 16), 16, 64, 128, 32, 8
RANKS = (1, 2, 4, 8)


def mcfg(**overrides: Any) -> ModelConfig:
    kw: dict[str, Any] = dict(
        vocab_size=300, hidden_size=D, num_layers=3, num_heads=H, num_kv_heads=4, head_dim=HEAD_DIM,
        intermediate_size=I_DENSE, moe_intermediate_size=I_MOE, num_experts=E, top_k=2, norm_topk_prob=True,
        rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=128,
    )
    kw.update(overrides)
    return ModelConfig(**kw)


def layouts(cfg: ModelConfig, mode: str, P: int) -> list[Layout]:
    return [Layout(cfg, mode, r, P) for r in range(P)]


# ---------------------------------------------------------------------------------------------------------------
# Attention heads
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kv", KV_CHOICES)
@pytest.mark.parametrize("P", RANKS)
def test_tp_query_and_kv_heads(P: int, kv: int) -> None:
    cfg = mcfg(num_kv_heads=kv)
    check_shapes(cfg, P)
    lays = layouts(cfg, "tp", P)
    group = H // kv  # query heads per KV head
    # Query heads: contiguous, disjoint, in rank order, covering all heads.
    assert [h for lay in lays for h in lay.q_heads] == list(range(H))
    holders: dict[int, list[int]] = {k: [] for k in range(kv)}
    for lay in lays:
        assert lay.tp == P and lay.tp_rank == lay.rank
        assert lay.num_heads == H // P == len(lay.q_heads)
        assert lay.num_kv_heads == max(1, kv // P) == len(lay.kv_heads)
        assert 0 <= lay.kv_heads.start and lay.kv_heads.stop <= kv
        # Local GQA: local query head j uses local KV head j // (local group size); that must be the global KV
        # head of its global query head.
        local_group = lay.num_heads // lay.num_kv_heads
        assert local_group * lay.num_kv_heads == lay.num_heads
        for j, h in enumerate(lay.q_heads):
            assert lay.kv_heads[j // local_group] == h // group, f"rank {lay.rank}: q head {h}"
        for k in lay.kv_heads:
            holders[k].append(lay.rank)
    # Every KV head is held somewhere; replicated on P / kv ranks when there are fewer KV heads than ranks.
    for k, ranks in holders.items():
        assert len(ranks) == max(1, P // kv), f"KV head {k} held by ranks {ranks}"
        assert ranks == list(range(ranks[0], ranks[0] + len(ranks))), "replicas of a KV head on consecutive ranks"


@pytest.mark.parametrize("kv", KV_CHOICES)
@pytest.mark.parametrize("P", RANKS)
def test_ep_attention_is_data_parallel(P: int, kv: int) -> None:
    cfg = mcfg(num_kv_heads=kv)
    for lay in layouts(cfg, "ep", P):
        assert lay.tp == 1 and lay.tp_rank == 0
        assert lay.num_heads == H and lay.q_heads == range(H)
        assert lay.num_kv_heads == kv and lay.kv_heads == range(kv)
        assert lay.dense_inter == I_DENSE and lay.moe_inter == I_MOE


def test_kv_replication_examples() -> None:
    """The cases the serving tests rely on: 4 query heads and 2 (or 1) KV heads on 4 ranks."""
    cfg = mcfg(num_heads=4, num_kv_heads=2, head_dim=16)
    assert [(lay.q_heads, lay.kv_heads) for lay in layouts(cfg, "tp", 4)] == [
        (range(0, 1), range(0, 1)), (range(1, 2), range(0, 1)), (range(2, 3), range(1, 2)), (range(3, 4), range(1, 2))]
    cfg = mcfg(num_heads=4, num_kv_heads=1, head_dim=16)
    assert [lay.kv_heads for lay in layouts(cfg, "tp", 4)] == [range(0, 1)] * 4
    cfg = mcfg(num_heads=4, num_kv_heads=4, head_dim=16)
    assert [lay.kv_heads for lay in layouts(cfg, "tp", 2)] == [range(0, 2), range(2, 4)]


# ---------------------------------------------------------------------------------------------------------------
# Experts, intermediate shards, slots
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("P", RANKS)
def test_experts_and_intermediate_shards(P: int) -> None:
    cfg = mcfg()
    ep, tp = layouts(cfg, "ep", P), layouts(cfg, "tp", P)
    owned = [e for lay in ep for e in range(lay.first_expert, lay.first_expert + lay.num_local_experts)]
    assert owned == list(range(E)), "EP: E/P whole experts per rank, disjoint, in rank order"
    for lay in ep:
        assert lay.num_local_experts == E // P and lay.first_expert == lay.rank * (E // P)
        assert lay.moe_inter == I_MOE
    for lay in tp:
        assert lay.num_local_experts == E and lay.first_expert == 0
        assert lay.moe_inter == I_MOE // P and lay.dense_inter == I_DENSE // P
    # One layer's local expert bytes are the same in both modes: 3 * E * I * D / P elements.
    for elt in (2, 4):
        sizes = {lay.expert_bytes(elt) for lay in ep + tp}
        assert sizes == {3 * E * I_MOE * D * elt // P}


@pytest.mark.parametrize("P", RANKS)
def test_slots(P: int) -> None:
    cfg = mcfg()
    n = cfg.num_layers
    for r in range(P):
        tp, ep = Layout(cfg, "tp", r, P), Layout(cfg, "ep", r, P)
        assert [tp.slot_of(i) for i in range(n)] == list(range(n))
        assert [ep.slot_of(i) for i in range(n)] == list(range(1, n + 1))


FULL4_WINDOW2 = (None,) * 4 + (8,) * 2


@pytest.mark.parametrize("windows,shift", [((), 1), ((8, None) * 3, 2), ((8, 8, None) * 2, 3), (FULL4_WINDOW2, 1),
                                           ((8,) * 6, 1)],
                         ids=["no-window", "alternating", "period-3", "contiguous", "all-window"])
def test_ep_may_sit_as_many_slots_past_tp_as_keeps_each_slot_to_one_kv_group(windows: tuple[int | None, ...],
                                                                              shift: int) -> None:
    """Where the KV groups repeat (GPT-OSS alternates sliding and full layers), EP layer i may sit in the slot of TP
    layer i + period, so that every slot's KV region is one group's; otherwise one slot past (a contiguous run of
    window layers mixes one slot), as every model but those."""
    cfg = mcfg(num_layers=6, layer_windows=windows)
    assert slot_shifts(cfg) == ((1, shift) if shift > 1 else (1,))
    tp, ep = Layout(cfg, "tp", 0, 2, shift), Layout(cfg, "ep", 1, 2, shift)
    assert [ep.slot_of(i) - tp.slot_of(i) for i in range(6)] == [shift] * 6
    held = slot_groups(cfg, MODES, shift)
    assert len(held) == 6 + shift and all(held)  # every slot holds a layer in some layout
    assert sum(len(g) > 1 for g in held) == (windows == FULL4_WINDOW2)
    assert slot_groups(cfg, ("tp",), shift)[6:] == [frozenset()] * shift  # the spares of one layout


def test_slots_of_dense_layers_only_hold_no_experts() -> None:
    """A model's first dense layers (DeepSeek's first_k_dense_replace: mlp_only_layers) sit in slots that no layout
    puts a MoE layer in, at shift 1 the first k: those hold no experts; a spare of one layout none either."""
    cfg = mcfg(num_layers=6, mlp_only_layers=(0, 1))
    assert expert_slots(cfg, MODES) == [False, False, True, True, True, True, True]
    assert expert_slots(cfg, ("tp",)) == [False, False, True, True, True, True, False]
    assert expert_slots(cfg, ("ep",)) == [False, False, False, True, True, True, True]
    assert all(expert_slots(mcfg(num_layers=6), MODES))


# ---------------------------------------------------------------------------------------------------------------
# Sharding functions
# ---------------------------------------------------------------------------------------------------------------

def _swiglu_mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(x, w13).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w2)


@pytest.mark.parametrize("P", RANKS)
def test_mlp_shards(P: int) -> None:
    cfg = mcfg()
    g = torch.Generator().manual_seed(P)
    gate, up = (torch.randn(I_MOE, D, generator=g, dtype=torch.float64) for _ in range(2))
    w13, w2 = torch.cat([gate, up]), torch.randn(D, I_MOE, generator=g, dtype=torch.float64)
    x = torch.randn(5, D, generator=g, dtype=torch.float64)
    n = I_MOE // P
    partial = torch.zeros(5, D, dtype=torch.float64)
    for lay in layouts(cfg, "tp", P):
        r = lay.rank
        rows = lay.shard_w13(w13)
        assert torch.equal(rows, torch.cat([gate[r * n:(r + 1) * n], up[r * n:(r + 1) * n]]))
        assert rows.shape == (2 * lay.moe_inter, D)
        cols = lay.shard_w2(w2)
        assert torch.equal(cols, w2[:, r * n:(r + 1) * n]) and cols.shape == (D, lay.moe_inter)
        partial += _swiglu_mlp(x, rows, cols)
    # The row cut of [gate | up] pairs with the column cut of down: the partial sums add up to the full MLP.
    full = _swiglu_mlp(x, w13, w2)
    assert torch.allclose(partial, full, rtol=1e-9, atol=1e-9)
    assert torch.equal(torch.cat([lay.shard_w2(w2) for lay in layouts(cfg, "tp", P)], dim=-1), w2)
    for lay in layouts(cfg, "ep", P):  # EP never cuts a tensor
        assert torch.equal(lay.shard_w13(w13), w13) and torch.equal(lay.shard_w2(w2), w2)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal GQA attention of one sequence: q [T, Hq, d], k/v [T, Hkv, d] -> [T, Hq * d]."""
    T, hq, d = q.shape
    rep = hq // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    s = torch.einsum("thd,shd->hts", q, k) / math.sqrt(d)
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hts,shd->thd", s.softmax(-1), v).reshape(T, hq * d)


@pytest.mark.parametrize("kv", KV_CHOICES)
@pytest.mark.parametrize("P", RANKS)
def test_shard_heads_tp_attention_sums_to_full(P: int, kv: int) -> None:
    """Cutting q/k/v rows by the rank's heads and o_proj columns by its query heads, the per-rank attention outputs
    (GQA over the local heads, replicated KV heads included) sum to the full attention."""
    cfg = mcfg(num_kv_heads=kv)
    d = HEAD_DIM
    g = torch.Generator().manual_seed(100 * P + kv)
    wq = torch.randn(H * d, D, generator=g, dtype=torch.float64)
    wk, wv = (torch.randn(kv * d, D, generator=g, dtype=torch.float64) for _ in range(2))
    wo = torch.randn(D, H * d, generator=g, dtype=torch.float64)
    x = torch.randn(6, D, generator=g, dtype=torch.float64)

    def attn_out(wq_: torch.Tensor, wk_: torch.Tensor, wv_: torch.Tensor, wo_: torch.Tensor) -> torch.Tensor:
        q = (x @ wq_.T).view(6, -1, d)
        k, v = (x @ wk_.T).view(6, -1, d), (x @ wv_.T).view(6, -1, d)
        return _attention(q, k, v) @ wo_.T

    full = attn_out(wq, wk, wv, wo)
    total = torch.zeros_like(full)
    for lay in layouts(cfg, "tp", P):
        q_rows = lay.shard_heads(wq, lay.q_heads, H)
        assert torch.equal(q_rows, wq.view(H, d, D)[lay.q_heads.start:lay.q_heads.stop].reshape(-1, D))
        k_rows, v_rows = lay.shard_heads(wk, lay.kv_heads, kv), lay.shard_heads(wv, lay.kv_heads, kv)
        assert k_rows.shape == (lay.num_kv_heads * d, D) and q_rows.shape == (lay.num_heads * d, D)
        o_cols = wo[:, lay.q_heads.start * d: lay.q_heads.stop * d]
        total += attn_out(q_rows, k_rows, v_rows, o_cols)
    assert torch.allclose(total, full, rtol=1e-9, atol=1e-9)
    for lay in layouts(cfg, "ep", P):  # EP: all heads on every rank
        assert torch.equal(lay.shard_heads(wq, lay.q_heads, H), wq)
        assert torch.equal(lay.shard_heads(wk, lay.kv_heads, kv), wk)


# ---------------------------------------------------------------------------------------------------------------
# Invalid layouts and the shape check
# ---------------------------------------------------------------------------------------------------------------

def test_layout_rejects_bad_mode_and_rank() -> None:
    cfg = mcfg()
    with pytest.raises(ConfigError, match="mode"):
        Layout(cfg, "dp", 0, 2)
    for rank in (-1, 2, 5):
        with pytest.raises(ConfigError, match=f"rank {rank}"):
            Layout(cfg, "tp", rank, 2)


VALID = [
    # (overrides, P)
    ({}, 1), ({}, 2), ({}, 4), ({}, 8), ({}, 16),
    (dict(num_kv_heads=1), 8),  # MQA: the one KV head on every rank
    (dict(num_kv_heads=2), 8),  # KV heads divide the ranks
    (dict(num_kv_heads=16), 8),  # KV heads a multiple of the ranks
    (dict(num_heads=12, num_kv_heads=6, num_experts=6, moe_intermediate_size=48, intermediate_size=96), 3),
    (dict(intermediate_size=90), 4),  # no dense layer: its size does not matter
    (dict(num_experts=0, intermediate_size=96, moe_intermediate_size=0), 4),  # a dense model
    (dict(num_heads=4, num_kv_heads=2, num_experts=8, moe_intermediate_size=32), 4),  # the serving tests' model
]

INVALID = [
    # (overrides, P, words of the message)
    ({}, 0, ["ranks must be >= 1", "0"]),
    (dict(num_experts=6), 4, ["num_experts 6", "4 ranks"]),
    (dict(num_experts=12), 8, ["num_experts 12", "8 ranks"]),
    (dict(num_heads=12, num_kv_heads=4, moe_intermediate_size=48), 8,
     ["num_attention_heads 12", "8 ranks"]),
    (dict(num_heads=12, num_kv_heads=6, num_experts=8), 4, ["num_key_value_heads 6", "4 ranks"]),
    (dict(num_heads=6, num_kv_heads=3, num_experts=8), 2, ["num_key_value_heads 3", "2 ranks"]),
    (dict(moe_intermediate_size=36), 8, ["moe_intermediate_size 36", "8 ranks"]),
    (dict(intermediate_size=90, mlp_only_layers=(1,)), 4, ["intermediate_size 90", "4 ranks"]),
    (dict(intermediate_size=90, decoder_sparse_step=2), 4, ["intermediate_size 90", "4 ranks"]),
]


@pytest.mark.parametrize("overrides,P", VALID)
def test_check_shapes_accepts(overrides: dict[str, Any], P: int) -> None:
    cfg = mcfg(**overrides)
    check_shapes(cfg, P)
    # Both layouts exist on every rank and the numbers are whole.
    for r in range(P):
        tp, ep = Layout(cfg, "tp", r, P), Layout(cfg, "ep", r, P)
        assert tp.num_heads * P == cfg.num_heads
        assert tp.num_kv_heads * P == cfg.num_kv_heads or (P % cfg.num_kv_heads == 0 and tp.num_kv_heads == 1)
        assert ep.num_local_experts * P == cfg.num_experts
        assert tp.moe_inter * P == cfg.moe_intermediate_size


@pytest.mark.parametrize("overrides,P,words", INVALID)
def test_check_shapes_rejects(overrides: dict[str, Any], P: int, words: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        check_shapes(mcfg(**overrides), P)
    for w in words:
        assert w in str(info.value), f"{str(info.value)!r} should contain {w!r}"
