"""Property tests of the pure switch plan (moebius/switch/plan.py): the expert reshard and the KV migration, run on
host tensors through a simulated all-to-all, checked against layouts computed independently with `Layout`.

Every property is a function of a `random.Random`; hypothesis drives it when installed (derandomized, so CI runs
are reproducible), otherwise a seeded loop over the same number of cases does.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from moebius.config import ModelConfig
from moebius.parallel.layout import Layout
from moebius.parallel.placement import Placement, partition
from moebius.switch.plan import (
    KVMove,
    LiveKV,
    ep_to_tp_pack,
    kv_ep_to_tp,
    kv_tp_to_ep,
    slots_of,
    token_slots,
    tp_to_ep_unpack,
)

try:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
except ImportError:  # not a declared test dependency: fall back to seeded loops
    given = None


def cases(n: int) -> Callable[[Callable[[random.Random], None]], Callable[[], None]]:
    """Run a property `f(rnd)` over n pseudo-random cases (hypothesis when available)."""

    def deco(f: Callable[[random.Random], None]) -> Callable[[], None]:
        if given is not None:
            test = settings(max_examples=n, deadline=None, derandomize=True, database=None,
                            suppress_health_check=list(HealthCheck))(given(st.randoms(use_true_random=False))(f))
        else:
            def test() -> None:
                for seed in range(n):
                    f(random.Random(seed))
        test.__name__, test.__doc__ = f.__name__, f.__doc__
        return test

    return deco


# ---------------------------------------------------------------------------------------------------------------
# Random shapes
# ---------------------------------------------------------------------------------------------------------------

RANKS = (1, 2, 3, 4, 6, 8)
KV_HEADS = (1, 2, 4, 8)


def random_config(rnd: random.Random, P: int | None = None) -> tuple[ModelConfig, int]:
    """A ModelConfig whose TP and EP layouts exist on P ranks (E % P == 0, I % P == 0, KV heads a multiple or a
    divisor of P, heads a multiple of both), and P."""
    P = P if P is not None else rnd.choice(RANKS)
    kv = rnd.choice([k for k in KV_HEADS if k % P == 0 or P % k == 0])
    step = math.lcm(kv, P)
    heads = step * rnd.choice((1, 2))
    cfg = ModelConfig(vocab_size=16, hidden_size=rnd.randint(1, 6), num_layers=1, num_heads=heads, num_kv_heads=kv,
                      head_dim=rnd.choice((2, 4)), intermediate_size=P, moe_intermediate_size=P * rnd.randint(1, 4),
                      num_experts=P * rnd.randint(1, 3), top_k=1, norm_topk_prob=True, rms_norm_eps=1e-6,
                      rope_theta=10000.0, max_position_embeddings=64)
    return cfg, P


def distinct(shape: tuple[int, ...], rnd: random.Random) -> torch.Tensor:
    """float64 tensor of pairwise distinct values (a random permutation of 1..n): any misplacement shows."""
    n = math.prod(shape)
    g = torch.Generator().manual_seed(rnd.getrandbits(32))
    return (torch.randperm(n, generator=g).to(torch.float64) + 1).reshape(shape)


def test_random_configs_are_valid() -> None:
    from moebius.parallel.layout import check_shapes

    rnd = random.Random(0)
    for _ in range(200):
        cfg, P = random_config(rnd)
        check_shapes(cfg, P)
        cfg.validate()


# ---------------------------------------------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------------------------------------------

def all_to_all(sends: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """sends[r][q] is what rank r sends to rank q; rank q receives the chunks from ranks 0..P-1 concatenated."""
    P = len(sends)
    return [torch.cat([sends[r][q] for r in range(P)]) for q in range(P)]


def split_rows(t: torch.Tensor, P: int) -> list[torch.Tensor]:
    n = t.shape[0] // P
    assert n * P == t.shape[0]
    return [t[q * n:(q + 1) * n] for q in range(P)]


def expert_tensors(cfg: ModelConfig, rnd: random.Random) -> tuple[torch.Tensor, torch.Tensor]:
    E, I, D = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    return distinct((E, 2 * I, D), rnd), distinct((E, D, I), rnd)  # W13: gate rows then up rows; W2


def ep_shards(cfg: ModelConfig, P: int, w13: torch.Tensor, w2: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
    out = []
    for r in range(P):
        lay = Layout(cfg, "ep", r, P)
        es = range(lay.first_expert, lay.first_expert + lay.num_local_experts)
        assert lay.moe_inter == cfg.moe_intermediate_size
        out.append((torch.stack([lay.shard_w13(w13[e]) for e in es]), torch.stack([lay.shard_w2(w2[e]) for e in es])))
    return out


def tp_shards(cfg: ModelConfig, P: int, w13: torch.Tensor, w2: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
    out = []
    for q in range(P):
        lay = Layout(cfg, "tp", q, P)
        assert lay.num_local_experts == cfg.num_experts and lay.first_expert == 0
        out.append((torch.stack([lay.shard_w13(w13[e]) for e in range(cfg.num_experts)]),
                    torch.stack([lay.shard_w2(w2[e]) for e in range(cfg.num_experts)])))
    return out


@cases(150)
def test_ep_to_tp_pack_then_exchange_gives_every_tp_shard(rnd: random.Random) -> None:
    cfg, P = random_config(rnd)
    w13, w2 = expert_tensors(cfg, rnd)
    ep, tp = ep_shards(cfg, P, w13, w2), tp_shards(cfg, P, w13, w2)
    El, I, D = cfg.num_experts // P, cfg.moe_intermediate_size, cfg.hidden_size
    sends13, sends2 = [], []
    for r in range(P):
        before = (ep[r][0].clone(), ep[r][1].clone())
        # into buffers shaped like the switch's staging (NaN first: every element must be written)
        out = (torch.full((P * El, 2 * I // P, D), float("nan")), torch.full((P * El, D, I // P), float("nan")))
        s13, s2 = ep_to_tp_pack(ep[r][0], ep[r][1], P, out)
        assert s13 is out[0] and s2 is out[1]
        assert torch.equal(ep[r][0], before[0]) and torch.equal(ep[r][1], before[1]), "pack modified its input"
        sends13.append(split_rows(s13, P))
        sends2.append(split_rows(s2, P))
    got13, got2 = all_to_all(sends13), all_to_all(sends2)
    for q in range(P):
        # rank r's chunk lands at experts r*El.. of q's output: exactly q's TP view, nothing to unpack
        assert torch.equal(got13[q], tp[q][0]), f"W13 of TP rank {q} (P={P}, El={El}, I={I}, D={D})"
        assert torch.equal(got2[q], tp[q][1]), f"W2 of TP rank {q} (P={P}, El={El}, I={I}, D={D})"


@cases(150)
def test_tp_to_ep_exchange_then_unpack_gives_every_ep_shard(rnd: random.Random) -> None:
    cfg, P = random_config(rnd)
    w13, w2 = expert_tensors(cfg, rnd)
    ep, tp = ep_shards(cfg, P, w13, w2), tp_shards(cfg, P, w13, w2)
    # the chunk of TP rank q for peer r is its contiguous expert block r*El.. (nothing packed)
    got13 = all_to_all([split_rows(tp[q][0], P) for q in range(P)])
    got2 = all_to_all([split_rows(tp[q][1], P) for q in range(P)])
    for r in range(P):
        out13 = torch.full_like(ep[r][0], float("nan"))
        out2 = torch.full_like(ep[r][1], float("nan"))
        tp_to_ep_unpack(got13[r], got2[r], P, out13, out2)
        assert torch.equal(out13, ep[r][0]), f"W13 of EP rank {r} (P={P})"
        assert torch.equal(out2, ep[r][1]), f"W2 of EP rank {r} (P={P})"


@cases(60)
def test_weight_round_trip_is_exact_in_bfloat16(rnd: random.Random) -> None:
    """EP -> TP -> EP through the plan reproduces the bytes (bf16: what the GPU engine moves)."""
    cfg, P = random_config(rnd)
    w13, w2 = (t.to(torch.bfloat16) for t in expert_tensors(cfg, rnd))
    ep = ep_shards(cfg, P, w13, w2)
    packed = [ep_to_tp_pack(a, b, P, (torch.empty(P * a.shape[0], a.shape[1] // P, a.shape[2], dtype=a.dtype),
                                      torch.empty(P * b.shape[0], b.shape[1], b.shape[2] // P, dtype=b.dtype)))
              for a, b in ep]
    tp13 = all_to_all([split_rows(s13, P) for s13, _ in packed])
    tp2 = all_to_all([split_rows(s2, P) for _, s2 in packed])
    back13 = all_to_all([split_rows(t, P) for t in tp13])
    back2 = all_to_all([split_rows(t, P) for t in tp2])
    for r in range(P):
        out13, out2 = torch.empty_like(ep[r][0]), torch.empty_like(ep[r][1])
        tp_to_ep_unpack(back13[r], back2[r], P, out13, out2)
        assert torch.equal(out13.view(torch.int16), ep[r][0].view(torch.int16))
        assert torch.equal(out2.view(torch.int16), ep[r][1].view(torch.int16))


# ---------------------------------------------------------------------------------------------------------------
# Requests
# ---------------------------------------------------------------------------------------------------------------

def reference_partition(lengths: list[int], P: int) -> list[int]:
    """Decreasing length (ties by index), each to the rank with the fewest requests, then fewest tokens, then the
    lowest id."""
    count, tokens, owner = [0] * P, [0] * P, [0] * len(lengths)
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(P), key=lambda r: (count[r], tokens[r], r))
        owner[i] = r
        count[r] += 1
        tokens[r] += lengths[i]
    return owner


@cases(300)
def test_partition_properties(rnd: random.Random) -> None:
    P = rnd.randint(1, 8)
    n = rnd.randint(0, 40)
    hi = rnd.choice((1, 5, 100, 5000))
    lengths = [rnd.randint(1, hi) for _ in range(n)]
    owner = partition(lengths, P)
    assert owner == partition(list(lengths), P), "not deterministic"
    assert len(owner) == n and all(0 <= o < P for o in owner), "a request is not placed"
    counts = [owner.count(r) for r in range(P)]
    assert max(counts) - min(counts) <= 1, f"request counts unbalanced: {counts}"
    assert owner == reference_partition(lengths, P)
    # the greedy on decreasing lengths: the longest request goes to rank 0, the P longest to distinct ranks
    order = sorted(range(n), key=lambda i: (-lengths[i], i))
    if order:
        assert owner[order[0]] == 0
    assert sorted(owner[i] for i in order[:P]) == list(range(min(n, P)))


def test_partition_equal_lengths_is_round_robin() -> None:
    for P in range(1, 9):
        for n in range(0, 20):
            assert partition([7] * n, P) == [i % P for i in range(n)]


def test_partition_balances_tokens_among_equal_counts() -> None:
    # 4 requests on 2 ranks: 10 -> r0, 9 -> r1, 8 -> r1 (fewer tokens among equal counts), 1 -> r0
    assert partition([1, 8, 9, 10], 2) == [0, 1, 1, 0]
    assert partition([], 3) == []
    assert partition([5, 5, 5], 1) == [0, 0, 0]


def test_placement_places_releases_and_repartitions_by_the_one_rule() -> None:
    """The front end's ownership table: new requests to the least-loaded rank (requests, then tokens), a release
    frees its share, and a switch into EP places every live request at once as `partition` does."""
    pl = Placement(2)
    assert [pl.place(r, w) for r, w in [("a", 10), ("b", 3), ("c", 5), ("d", 1)]] == [0, 1, 1, 0]
    assert pl.release("b") == 1 and pl.release("b") is None and pl.owner("b") is None
    assert pl.place("e", 2) == 1  # rank 1 holds one request again, rank 0 two
    weights = {"a": 1, "c": 8, "d": 9, "e": 10}
    owners = pl.repartition(weights)
    assert owners == dict(zip(weights, partition(list(weights.values()), 2), strict=True))
    assert all(pl.owner(r) == o for r, o in owners.items())
    pl.clear()
    assert pl.owner("a") is None and pl.place("x", 1) == 0


def test_token_slots() -> None:
    assert token_slots([3, 0, 7], 9, 4).tolist() == [12, 13, 14, 15, 0, 1, 2, 3, 28]
    assert token_slots([5], 0, 4).tolist() == []
    assert token_slots([2, 1], 2, 1).tolist() == [2, 1]
    # several tables at once: each table's own slots, concatenated (empty tables, zero counts, unused pages)
    tables, counts = [[3, 0, 7], [], [5], [9, 2], [4, 6, 8]], [9, 0, 0, 5, 7]
    want = sum((token_slots(t, n, 4).tolist() for t, n in zip(tables, counts, strict=True)), [])
    assert slots_of(tables, counts, 4).tolist() == want == [12, 13, 14, 15, 0, 1, 2, 3, 28, 36, 37, 38, 39, 8,
                                                            16, 17, 18, 19, 24, 25, 26]
    assert slots_of([], [], 4).tolist() == []
    # from whole-page starts: a table's first pages are left out (another request's move fills them)
    assert slots_of(tables, counts, 4, [4, 0, 0, 0, 4]).tolist() == [0, 1, 2, 3, 28, 36, 37, 38, 39, 8, 24, 25, 26]


# ---------------------------------------------------------------------------------------------------------------
# KV migration
# ---------------------------------------------------------------------------------------------------------------

NAN = float("nan")


def cache(num_pages: int, bs: int, heads: int, d: int) -> torch.Tensor:
    return torch.full((num_pages, 2, bs, heads, d), NAN, dtype=torch.float64)


def write(c: torch.Tensor, pages: list[int], content: torch.Tensor, heads: range) -> None:
    """content [n, 2, all heads, d] -> the cache slots of a page table, restricted to `heads`."""
    bs = c.shape[2]
    s = torch.from_numpy(token_slots(pages, content.shape[0], bs))
    c[s // bs, :, s % bs] = content[:, :, heads.start:heads.stop]


def read(c: torch.Tensor, pages: list[int], n: int) -> torch.Tensor:
    bs = c.shape[2]
    s = torch.from_numpy(token_slots(pages, n, bs))
    return c[s // bs, :, s % bs]


def execute(moves: list[KVMove], src: list[torch.Tensor], dst: list[torch.Tensor]) -> list[torch.Tensor]:
    """Apply every rank's KVMove through a simulated all-to-all, like the executor does for one layer; returns a
    per-rank count of writes per (page, token, head) of the destination cache."""
    P = len(moves)
    bs = src[0].shape[2]
    for m in moves:
        assert len(m.send_slots) == len(m.send_heads) == len(m.recv_slots) == len(m.recv_heads) == P
        # the executor concatenates the chunks of all peers: one width for every peer, each way
        assert len({len(h) for h in m.send_heads}) == 1 and len({len(h) for h in m.recv_heads}) == 1
    writes = [torch.zeros(d.shape[0], d.shape[2], d.shape[3], dtype=torch.int64) for d in dst]
    for s in range(P):
        for q in range(P):
            slots, heads = moves[s].send_slots[q], moves[s].send_heads[q]
            rslots, rheads = moves[q].recv_slots[s], moves[q].recv_heads[s]
            assert len(slots) == len(rslots), f"rank {s} sends {len(slots)} tokens to {q}, which expects {len(rslots)}"
            assert len(heads) == len(rheads), f"rank {s} sends {len(heads)} heads to {q}, which expects {len(rheads)}"
            assert 0 <= heads.start and heads.stop <= src[s].shape[3]
            assert 0 <= rheads.start and rheads.stop <= dst[q].shape[3]
            if not len(slots):
                continue
            si, ri = torch.from_numpy(np.asarray(slots)), torch.from_numpy(np.asarray(rslots))
            chunk = src[s][si // bs, :, si % bs][:, :, heads.start:heads.stop]
            dst[q][ri // bs, :, ri % bs, rheads.start:rheads.stop] = chunk
            writes[q][ri // bs, ri % bs, rheads.start:rheads.stop] += 1
    return writes


def random_pages(pool: list[int], n_tokens: int, bs: int, rnd: random.Random) -> list[int]:
    """Take ceil(n/bs) random distinct pages out of `pool` (removed from it)."""
    k = -(-n_tokens // bs)
    assert k <= len(pool)
    picked = rnd.sample(pool, k)
    for p in picked:
        pool.remove(p)
    return picked


def random_requests(rnd: random.Random) -> tuple[list[int], int]:
    """Up to 7 request lengths (0, 1, page edges, random) and a page size."""
    n = rnd.randint(0, 7)
    bs = rnd.choice((1, 2, 3, 4))
    return [rnd.choice((0, 1, bs, bs + 1, rnd.randint(1, 5 * bs))) for _ in range(n)], bs


def expected_writes(dst: torch.Tensor, tables: list[tuple[list[int], int]], heads: range) -> torch.Tensor:
    bs = dst.shape[2]
    exp = torch.zeros(dst.shape[0], bs, dst.shape[3], dtype=torch.int64)
    for pages, n in tables:
        s = torch.from_numpy(token_slots(pages, n, bs))
        exp[s // bs, s % bs, heads.start:heads.stop] = 1
    return exp


@dataclass
class KVScenario:
    """Random requests of a random model on P ranks: lengths, page size, every request's KV (all heads)."""

    P: int
    H: int  # KV heads of the model
    d: int
    bs: int
    lengths: list[int]
    tp: list[Layout]
    content: list[torch.Tensor]  # [L, 2, H, d] per request

    @staticmethod
    def draw(rnd: random.Random) -> KVScenario:
        cfg, P = random_config(rnd)
        lengths, bs = random_requests(rnd)
        H, d = cfg.num_kv_heads, cfg.head_dim
        return KVScenario(P, H, d, bs, lengths, [Layout(cfg, "tp", q, P) for q in range(P)],
                          [distinct((L, 2, H, d), rnd) for L in lengths])

    def pages(self, rnd: random.Random) -> int:
        """A pool size that holds every request, with a few pages to spare."""
        return rnd.randint(1, 3) + sum(-(-L // self.bs) for L in self.lengths)


def ep_to_tp_moves(sc: KVScenario, owners: list[int], ep_tables: list[list[int]], tp_tables: list[list[int]]
                   ) -> list:
    """What the executor hands the plan on each rank: only its own EP page tables."""
    rows = list(zip(owners, sc.lengths, ep_tables, tp_tables, strict=True))
    return [kv_ep_to_tp([LiveKV(o, L, e if o == me else [], t) for o, L, e, t in rows], me, sc.tp, sc.bs)
            for me in range(sc.P)]


def tp_to_ep_moves(sc: KVScenario, owners: list[int], tp_tables: list[list[int]], ep_tables: list[list[int]]
                   ) -> list:
    """The target EP page tables exist only on the new owner."""
    rows = list(zip(owners, sc.lengths, tp_tables, ep_tables, strict=True))
    return [kv_tp_to_ep([LiveKV(o, L, t, e if o == me else []) for o, L, t, e in rows], me, sc.tp, sc.bs)
            for me in range(sc.P)]


@cases(200)
def test_kv_ep_to_tp_moves_every_token_to_every_tp_head_shard(rnd: random.Random) -> None:
    sc = KVScenario.draw(rnd)
    P, H, d, bs, lengths, tp = sc.P, sc.H, sc.d, sc.bs, sc.lengths, sc.tp
    owners = [rnd.randrange(P) for _ in lengths]
    # EP: each rank's pool holds its requests, all heads; TP: one page table per request, the same on every rank
    ep_pages, tp_pages = sc.pages(rnd), sc.pages(rnd)
    ep_pools = [list(range(ep_pages)) for _ in range(P)]
    tp_pool = list(range(tp_pages))
    src_tables = [random_pages(ep_pools[o], L, bs, rnd) for o, L in zip(owners, lengths, strict=True)]
    dst_tables = [random_pages(tp_pool, L, bs, rnd) for L in lengths]
    src = [cache(ep_pages, bs, H, d) for _ in range(P)]
    for i, o in enumerate(owners):
        write(src[o], src_tables[i], sc.content[i], range(H))
    dst = [cache(tp_pages, bs, tp[q].num_kv_heads, d) for q in range(P)]
    writes = execute(ep_to_tp_moves(sc, owners, src_tables, dst_tables), src, dst)
    for q in range(P):
        heads = tp[q].kv_heads
        assert len(heads) == tp[q].num_kv_heads
        for i, L in enumerate(lengths):
            got = read(dst[q], dst_tables[i], L)
            assert torch.equal(got, sc.content[i][:, :, heads.start:heads.stop]), (
                f"TP rank {q}, request {i} (P={P}, KV heads {H}, bs {bs})")
        assert torch.equal(writes[q], expected_writes(dst[q], list(zip(dst_tables, lengths, strict=True)),
                                                      range(tp[q].num_kv_heads))), f"stray or double writes on {q}"


@cases(200)
def test_kv_tp_to_ep_gathers_every_head_at_the_new_owner(rnd: random.Random) -> None:
    sc = KVScenario.draw(rnd)
    P, H, d, bs, lengths, tp = sc.P, sc.H, sc.d, sc.bs, sc.lengths, sc.tp
    owners = partition(lengths, P) if rnd.random() < 0.5 else [rnd.randrange(P) for _ in lengths]
    tp_pages, ep_pages = sc.pages(rnd), sc.pages(rnd)
    tp_pool = list(range(tp_pages))
    ep_pools = [list(range(ep_pages)) for _ in range(P)]
    src_tables = [random_pages(tp_pool, L, bs, rnd) for L in lengths]
    dst_tables = [random_pages(ep_pools[o], L, bs, rnd) for o, L in zip(owners, lengths, strict=True)]
    src = [cache(tp_pages, bs, tp[q].num_kv_heads, d) for q in range(P)]
    for q in range(P):  # every TP rank holds its heads (replicas too when KV heads < P)
        for i in range(len(lengths)):
            write(src[q], src_tables[i], sc.content[i], tp[q].kv_heads)
    dst = [cache(ep_pages, bs, H, d) for _ in range(P)]
    writes = execute(tp_to_ep_moves(sc, owners, src_tables, dst_tables), src, dst)
    for r in range(P):
        mine = [i for i, o in enumerate(owners) if o == r]
        for i in mine:
            got = read(dst[r], dst_tables[i], lengths[i])
            assert torch.equal(got, sc.content[i]), f"EP rank {r}, request {i} (P={P}, KV heads {H}, bs {bs})"
        exp = expected_writes(dst[r], [(dst_tables[i], lengths[i]) for i in mine], range(H))
        assert torch.equal(writes[r], exp), f"stray or double writes on EP rank {r} (P={P}, KV heads {H})"


@cases(100)
def test_kv_round_trip_ep_tp_ep(rnd: random.Random) -> None:
    """EP -> TP -> EP (new owners by `partition`): every request's KV, all heads, is back, bit for bit."""
    sc = KVScenario.draw(rnd)
    P, H, d, bs, lengths, tp = sc.P, sc.H, sc.d, sc.bs, sc.lengths, sc.tp
    owners = [rnd.randrange(P) for _ in lengths]
    pages = sc.pages(rnd)
    pools = [list(range(pages)) for _ in range(P)]
    ep_tables = [random_pages(pools[o], L, bs, rnd) for o, L in zip(owners, lengths, strict=True)]
    tp_pool = list(range(pages))
    tp_tables = [random_pages(tp_pool, L, bs, rnd) for L in lengths]
    ep = [cache(pages, bs, H, d) for _ in range(P)]
    for i, o in enumerate(owners):
        write(ep[o], ep_tables[i], sc.content[i], range(H))
    tpc = [cache(pages, bs, tp[q].num_kv_heads, d) for q in range(P)]
    execute(ep_to_tp_moves(sc, owners, ep_tables, tp_tables), ep, tpc)
    new_owners = partition(lengths, P)
    pools = [list(range(pages)) for _ in range(P)]
    back_tables = [random_pages(pools[o], L, bs, rnd) for o, L in zip(new_owners, lengths, strict=True)]
    back = [cache(pages, bs, H, d) for _ in range(P)]
    execute(tp_to_ep_moves(sc, new_owners, tp_tables, back_tables), tpc, back)
    for i, L in enumerate(lengths):
        assert torch.equal(read(back[new_owners[i]], back_tables[i], L), sc.content[i])


@pytest.mark.parametrize("P,kv", [(4, 2), (8, 2), (8, 4), (4, 1), (2, 1)])
def test_kv_tp_to_ep_replicas_stay_silent(P: int, kv: int) -> None:
    """KV heads < ranks: exactly one replica of each head shard sends (the lowest rank holding it)."""
    cfg = ModelConfig(vocab_size=16, hidden_size=4, num_layers=1, num_heads=8, num_kv_heads=kv, head_dim=2,
                      intermediate_size=P, moe_intermediate_size=P, num_experts=P, top_k=1, norm_topk_prob=True,
                      rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=64)
    tp = [Layout(cfg, "tp", q, P) for q in range(P)]
    reqs = [LiveKV(o, 2, [o], [0]) for o in range(P)]
    senders = [q for q in range(P) if any(len(s) for s in kv_tp_to_ep(reqs, q, tp, 2).send_slots)]
    rep = P // kv
    assert senders == list(range(0, P, rep))
    assert sorted({h for q in senders for h in tp[q].kv_heads}) == list(range(kv))
