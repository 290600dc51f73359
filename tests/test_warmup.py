"""Start-up warm-up (worker/warmup.py): the shapes it runs cover every token-count bucket and kernel path, stay inside
the engine's limits and touch only the reserved KV page 0; an engine warmed up serves the same tokens as one that
was not, in both layouts and on two ranks."""

from __future__ import annotations

import pytest

from moebius.config import EngineConfig
from moebius.frontend.core import EngineCore
from moebius.kernels import FRESH_CHUNK_MIN_TOKENS
from moebius.sampling_params import SamplingParams
from moebius.worker.runner import ModelRunner
from moebius.worker.warmup import APART_DECODES, _chunks, fresh_chunk_lengths, token_ladder, warmup_steps


def test_token_ladder_has_a_count_in_every_bucket() -> None:
    assert token_ladder(64) == [1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 64]
    ladder = token_ladder(2000)
    assert ladder[-1] == 2000 and 1025 in ladder and 2048 not in ladder
    # the last bucket, cut short by the budget, holds a multiple of 16 and a count that is none
    assert token_ladder(2001)[-3:] == [1025, 2000, 2001] and token_ladder(2000)[-3:] == [1024, 1025, 2000]
    assert token_ladder(511)[-3:] == [257, 496, 511] and token_ladder(7)[-1] == 7
    for p in (2 ** k for k in range(11)):  # every power-of-two bucket, and a count past each multiple of 16
        assert any(p <= t < 2 * p for t in ladder)
    assert any(t % 16 for t in ladder if t > 16) and any(t % 16 == 0 for t in ladder)


def test_warmup_steps_stay_in_the_engine_limits() -> None:
    budget, running, max_len, page = 64, 8, 48, 16
    graphed = {1, 2, 3, 4}
    steps = warmup_steps(budget, running, max_len, page, graphed)
    for s in steps:
        assert s.tokens <= budget and len(s.chunks) <= running
        assert all(start + n < max_len for start, n in s.chunks)  # room for the sampled token
    decodes = {s.tokens for s in steps if s.decode_only and not s.follows}
    assert decodes == {5, 8}  # decode batches the graphs do not hold, up to the running limit
    # last, decodes fed by the step before (overlap), alone and beside a prompt chunk
    assert [s.chunks for s in steps if s.follows] == [((page, 1),), ((page, 1), (0, 2))] and steps[-1].follows
    assert {s.tokens for s in steps if len(s.chunks) == 1 and not s.sampled} == set(token_ladder(47))
    mixed = [s for s in steps if not s.decode_only and len(s.chunks) > 1]
    assert mixed and all(s.chunks[-1][1] > 1 and s.chunks[0] == (page, 1) for s in mixed if not s.sampled)
    assert sorted(s.sampling for s in steps if s.sampled) == ["temperature", "top-k/p"]  # each path but greedy
    for s in steps:  # every page of every request is the reserved page 0
        assert all(set(c.req.pages) == {0} and len(c.req.pages) * page >= c.start + c.num_tokens
                   for c in _chunks(s, page, 100))
    # one request running at a time (`bench sweep --batches 1`): no step holds two, the sampled one neither
    assert all(len(s.chunks) == 1 for s in warmup_steps(budget, 1, max_len, page, {1}))


def test_decodes_attending_apart_are_warmed_up_in_each_count_class() -> None:
    """With --mixed-attention apart a mixed step's decodes launch with KV splits chosen by their count, in the step's
    release order: each of APART_DECODES beside a chunk once per release order (the first power-of-two step of
    that order with room for it), and no more steps than that; none when they attend shared."""
    budget, running, max_len, page = 256, 40, 400, 16
    shared = warmup_steps(budget, running, max_len, page, set())
    order = {T: 2 if T <= 32 else 1 for T in range(1, budget + 1)}  # LATE to 32 tokens, then EARLY (the 30B's)
    apart = warmup_steps(budget, running, max_len, page, set(), apart_release=order.__getitem__)

    def mixed(steps: list) -> list[tuple[int, int]]:  # (step tokens, decodes beside its chunk)
        return [(s.tokens, len(s.chunks) - 1) for s in steps if len(s.chunks) > 1 and not s.sampled]

    extra = [m for m in mixed(apart) if m not in mixed(shared)]
    assert set(shared) <= set(apart) and len(apart) == len(shared) + len(extra)
    # LATE: 1, 2, 4 beside 16 tokens (8 and 16: the T/2 steps of 16 and 32); EARLY: 1-16 beside 64 (32: its own)
    assert sorted(extra) == [(16, 1), (16, 2), (16, 4), (64, 1), (64, 2), (64, 4), (64, 8), (64, 16)]
    assert {n for _, n in mixed(apart)} >= set(APART_DECODES)
    for s in apart:
        assert s.tokens <= budget and len(s.chunks) <= running and all(start + n < max_len for start, n in s.chunks)


def test_cudnn_prefill_lengths_are_lengths_the_warmup_runs() -> None:
    """A fresh chunk takes cuDNN attention only at lengths whose cuDNN graph the warm-up built (a whole prompt of that
    length in every layout), so no request pays a graph build; the budget's own length is among them."""
    for budget, max_len in [(8192, 40960), (8192, 5000), (16384, 32768)]:
        whole = {s.tokens for s in warmup_steps(budget, 256, max_len, 16, set())
                 if len(s.chunks) == 1 and s.chunks[0][0] == 0 and not s.sampled}
        lengths = fresh_chunk_lengths(budget, max_len)
        assert lengths <= whole and min(lengths) == FRESH_CHUNK_MIN_TOKENS and max(lengths) == min(budget, max_len - 1)
    assert fresh_chunk_lengths(1024, 4096) == frozenset()  # a budget below 2048: never
    with EngineCore(EngineConfig.from_kwargs(device="cpu", max_num_batched_tokens=4096)) as e:
        rank = e.ranks.rank
        want = fresh_chunk_lengths(4096, rank.spec.max_model_len)
        assert want and all(rt.runner.kernels.fresh_chunk_lengths == want for rt in rank.modes.values())


def test_warmup_launches_every_count_in_both_layouts(monkeypatch) -> None:
    """Every ladder count in both layouts, and in each layout steps whose decodes read their input from the step
    launched before (the overlap path's input fill, a kernel the first request would otherwise be first to run)."""
    seen: dict[int, set[int]] = {}
    fed: dict[int, list[list[int]]] = {}  # runner -> the fill rows of each launch fed by the one before
    launch = ModelRunner.launch

    def spy(self, batch, stop_masks, sync, prev=None, prev_rows=None, **kwargs):
        seen.setdefault(id(self), set()).add(sync.max_tokens)
        if prev is not None:
            assert prev_rows is not None and len(prev_rows) == len(batch)
            fed.setdefault(id(self), []).append(prev_rows.tolist())
            assert prev.tokens.shape[0] >= 1 and prev_rows.max() < prev.tokens.shape[0]
        return launch(self, batch, stop_masks, sync, prev, prev_rows, **kwargs)

    monkeypatch.setattr(ModelRunner, "launch", spy)
    with EngineCore(EngineConfig.from_kwargs(device="cpu", warmup="full", max_num_batched_tokens=64)):
        pass
    assert len(seen) == 2  # both layouts' runners
    assert all(set(token_ladder(64)) <= counts for counts in seen.values())
    # the fed steps: a decode alone, then a decode beside a chunk (not fed), both reading a row of the step before
    assert list(fed.values()) == [[[0], [0, -1]]] * 2
    seen.clear()
    with EngineCore(EngineConfig.from_kwargs(device="cpu", max_num_batched_tokens=64)):  # auto: none on the CPU
        pass
    assert not seen


def _serve(P: int, mode: str, warmup: str) -> list[list[int]]:
    cfg = EngineConfig.from_kwargs(num_ranks=P, mode=mode, device="cpu", warmup=warmup, max_num_batched_tokens=64)
    with EngineCore(cfg) as e:
        sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        ids = [e.add_request([(i * 37 + j) % 200 + 1 for j in range(5 + 7 * i)], sp) for i in range(5)]
        outs: dict[str, list[int]] = {}
        while len(outs) < len(ids):
            outs.update({o.request_id: o.outputs[0].token_ids for o in e.step() if o.finished})
    return [outs[i] for i in ids]


@pytest.mark.parametrize("P,mode", [(1, "tp"), (2, "ep")])
def test_warmed_up_engine_serves_the_same_tokens(P: int, mode: str) -> None:
    assert _serve(P, mode, "full") == _serve(P, mode, "none")


def test_start_up_freezes_the_heap_and_close_releases_it() -> None:
    """After start-up every object alive is kept out of garbage collections (a full collection over ~175k objects
    took 0.1 s on a CPU core, and one falls now and then under a step); closing gives them back to the collector, so
    an engine's cycles (and the tensors they hold) are freed when it is dropped."""
    import gc
    import weakref

    engine = EngineCore(EngineConfig.from_kwargs(model=None, device="cpu", max_model_len=64))
    try:
        assert gc.get_freeze_count() > 50_000  # torch, the model and the front end's own
        assert engine.query("heap")[0]["frozen"] > 50_000  # the rank: here the same process (P = 1)
    finally:
        engine.close()
    assert gc.get_freeze_count() == 0
    alive = weakref.ref(engine)
    del engine
    gc.collect()
    assert alive() is None
