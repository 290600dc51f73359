"""Prefix caching: the allocator's index of computed prompt pages (reference counts, keys, eviction), the
scheduler's use of it (admission from the cache, pages indexed as steps compute them, never a prompt's last token),
and whole engines whose requests share prompt prefixes, checked against transformers and against the same work
with --disable-prefix-caching, on one rank and on two (TP, EP, and a live switch between them)."""

from __future__ import annotations

import random

import pytest
from conftest import VOCAB, assert_kv_all_free, hf_greedy, make_llm, run_to_completion

from moebius import LLM, SamplingParams
from moebius.link.request import PLACEHOLDER, Request, RequestSpec
from moebius.memory.kv_pool import BlockAllocator, KVPages, OutOfPages
from moebius.worker.scheduler import Scheduler

BS = 4


def _tokens(n: int, first: int = 0) -> tuple[int, ...]:
    return tuple(range(first, first + n))


# ---- the allocator's index ----

def test_a_registered_chain_is_matched_shared_and_kept_after_its_request_frees_it() -> None:
    alloc = BlockAllocator(num_pages=10, block_size=BS)
    pages = alloc.allocate(3)
    k1 = alloc.register(pages[0], 0, _tokens(4))
    k2 = alloc.register(pages[1], k1, _tokens(4, 4))
    assert alloc.cached_pages == 2
    # the chain is matched as far as its tokens agree, from the first page
    assert alloc.match([_tokens(4), _tokens(4, 4), _tokens(4, 8)]) == ([pages[0], pages[1]], [k1, k2])
    assert alloc.match([_tokens(4), _tokens(4, 99)]) == ([pages[0]], [k1])
    assert alloc.match([_tokens(4, 4)]) == ([], [])  # the second page's tokens, but not after the first's
    # the request frees its pages: indexed ones stay matchable and count as free
    alloc.free(pages)
    assert alloc.num_free == 9
    assert alloc.evictable(pages[:2]) == 2
    alloc.share(pages[:2])  # a new request takes them: no longer free
    assert alloc.num_free == 7 and alloc.evictable(pages[:2]) == 0
    alloc.share(pages[:1])  # and a second one the first page
    alloc.free(pages[:2])
    assert alloc.num_free == 8  # page 1 is still held once
    alloc.free(pages[:1])
    assert alloc.num_free == 9 and alloc.cached_pages == 2


def test_free_pages_are_used_before_cached_ones_which_go_last_page_first() -> None:
    alloc = BlockAllocator(num_pages=7, block_size=BS)  # 6 usable
    a = alloc.allocate(3)
    key = 0
    for i, p in enumerate(a):
        key = alloc.register(p, key, _tokens(4, 4 * i))
    alloc.free(a)
    assert alloc.allocate(3) == [4, 5, 6]  # never-used pages first: the cached chain stays whole
    assert alloc.match([_tokens(4), _tokens(4, 4), _tokens(4, 8)])[0] == a
    # then cached pages are evicted, a chain's last page first, so what is left of it still matches from its start
    assert alloc.allocate(1) == [a[2]]
    assert alloc.match([_tokens(4), _tokens(4, 4), _tokens(4, 8)])[0] == a[:2]
    assert alloc.cached_pages == 2
    with pytest.raises(OutOfPages, match="asked for 3 KV pages, 2 free"):
        alloc.allocate(3)


def test_an_evicted_pages_key_never_matches_other_tokens() -> None:
    alloc = BlockAllocator(num_pages=3, block_size=BS)  # 2 usable
    p1, p2 = alloc.allocate(2)
    k1 = alloc.register(p1, 0, _tokens(4))
    alloc.register(p2, k1, _tokens(4, 4))
    alloc.free([p1, p2])
    # evict both; p1 then holds other tokens, indexed under a new key
    q1, q2 = alloc.allocate(2)
    assert {q1, q2} == {p1, p2} and alloc.cached_pages == 0
    k1b = alloc.register(q1, 0, _tokens(4, 50))
    assert k1b != k1
    assert alloc.match([_tokens(4, 50), _tokens(4, 4)]) == ([q1], [k1b])  # the old second page is not its child


def test_tokens_indexed_twice_keep_the_first_page() -> None:
    alloc = BlockAllocator(num_pages=5, block_size=BS)
    a, b = alloc.allocate(2)
    k = alloc.register(a, 0, _tokens(4))
    assert alloc.register(b, 0, _tokens(4)) == k  # computed by two requests at once: one page is indexed
    assert alloc.cached_pages == 1
    alloc.free([b])
    assert alloc.num_free == 3  # b went back to the free pages, not to the cache
    with pytest.raises(RuntimeError, match="not a held page"):
        alloc.register(b, 0, _tokens(4, 8))  # a page no request holds


# ---- the scheduler ----

def _req(rid: str, prompt: list[int], n_out: int = 4, **params) -> Request:
    return Request(RequestSpec(rid, prompt, SamplingParams(max_tokens=n_out, **params), 0, 10_000))


def _step(s: Scheduler) -> dict[str, tuple[int, int]]:
    """Schedule one step and mark its chunks computed; {request: (start, tokens)}."""
    batch = s.schedule()
    for c in batch:
        c.req.num_computed = c.start + c.num_tokens
    return {c.req.request_id: (c.start, c.num_tokens) for c in batch}


def test_a_later_request_starts_after_the_full_pages_it_shares() -> None:
    s = Scheduler(KVPages(64, BS), max_running=8, max_batched_tokens=64)
    a = _req("a", list(range(14)))  # 3 full pages + 2 tokens
    s.add(a)
    assert _step(s) == {"a": (0, 14)}
    assert len(a.prefix_keys) == 3
    b = _req("b", list(range(10)) + [99, 98])  # shares 2 full pages (8 tokens) and 2 more tokens
    s.add(b)
    assert _step(s)["b"] == (8, 4)
    assert b.pages[:2] == a.pages[:2] and b.pages[2] not in a.pages
    assert b.num_cached_tokens == 8
    c = _req("c", list(range(12)))  # a's first 3 pages exactly: its last token is computed, not matched
    s.add(c)
    assert _step(s)["c"] == (8, 4)
    d = _req("d", list(range(14)), prompt_logits=True)  # wants every position's logits: no match
    s.add(d)
    assert _step(s)["d"] == (0, 14)


def test_requests_admitted_in_one_step_share_the_pages_it_computes() -> None:
    s = Scheduler(KVPages(64, BS), max_running=8, max_batched_tokens=64)
    prompt = list(range(10))
    reqs = [_req(str(i), prompt) for i in range(3)]
    for r in reqs:
        s.add(r)
    assert _step(s) == {"0": (0, 10), "1": (8, 2), "2": (8, 2)}
    assert reqs[1].pages[:2] == reqs[2].pages[:2] == reqs[0].pages[:2]
    free = s.alloc.num_free
    for r in reqs:
        s.finish(r)
    assert s.alloc.num_free == free + 3 + 1 + 1  # every page back (2 of them shared three ways)


def test_a_page_a_one_token_chunk_completes_is_indexed_at_the_next_schedule() -> None:
    s = Scheduler(KVPages(64, BS), max_running=8, max_batched_tokens=7)
    a = _req("a", list(range(8)))
    s.add(a)
    assert _step(s) == {"a": (0, 7)}  # the budget cuts the prompt one token short of its second page
    assert len(a.prefix_keys) == 1
    b = _req("b", list(range(4)) + [50 + i for i in range(6)])
    s.add(b)
    # a's last prompt token completes its second page in this step, alone: the fused decode path may run such a
    # step, where one launch writes and reads, so that page waits for the next schedule
    assert _step(s) == {"a": (7, 1), "b": (4, 6)}
    assert b.pages[0] == a.pages[0] and len(a.prefix_keys) == 1
    c = _req("c", list(range(8)) + [60, 61])
    s.add(c)
    a.output_token_ids.append(1)  # a sampled: it decodes now
    assert _step(s)["c"] == (8, 2)
    assert len(a.prefix_keys) == 2 and c.pages[:2] == a.pages[:2]


def test_output_pages_are_indexed_once_their_tokens_are_known() -> None:
    s = Scheduler(KVPages(64, BS), max_running=8, max_batched_tokens=64)
    a = _req("a", list(range(6)), n_out=20)
    s.add(a)
    _step(s)
    for t in range(6):  # decodes: its token in flight is a placeholder until the step after has been launched
        a.output_token_ids.append(100 + t)
        _step(s)
    a.output_token_ids.append(PLACEHOLDER)  # sampled by the step just launched, not yet read back
    _step(s)
    # 13 tokens computed: pages 0-2 full (the prompt's 4, then 2 + 2 outputs, then 4 outputs)
    assert len(a.prefix_keys) == 3
    b = _req("b", list(range(6)) + [100 + t for t in range(6)] + [7])  # a chat's next turn: prompt, answer, more
    s.add(b)
    assert _step(s)["b"] == (12, 1) and b.pages[:3] == a.pages[:3] and b.num_cached_tokens == 12


def test_a_page_holding_a_token_still_on_the_device_waits_for_it() -> None:
    """A preempted request recomputes its prompt and outputs in one chunk, the last output still a placeholder (its
    step was in flight): the page holding it is indexed only once the token is read back."""
    s = Scheduler(KVPages(64, BS), max_running=8, max_batched_tokens=64)
    r = _req("r", list(range(6)), n_out=20)
    r.output_token_ids += [100, PLACEHOLDER]  # 8 tokens: page 1 is 4, 5, 100 and the placeholder
    s.add(r)
    assert _step(s) == {"r": (0, 8)}
    assert len(r.prefix_keys) == 1
    r.output_token_ids[-1] = 101
    r.output_token_ids.append(PLACEHOLDER)
    _step(s)  # a decode: its page is indexed now
    assert len(r.prefix_keys) == 2
    assert s.alloc.match([(0, 1, 2, 3), (4, 5, 100, 101)])[0] == r.pages[:2]


def test_a_preempted_request_comes_back_through_the_cache() -> None:
    s = Scheduler(KVPages(9, BS), max_running=8, max_batched_tokens=64)  # 8 usable pages
    a = _req("a", list(range(16)), n_out=40)
    b = _req("b", [200 + i for i in range(12)], n_out=40)
    s.add(a)
    s.add(b)
    assert _step(s) == {"a": (0, 16), "b": (0, 12)}  # 4 + 3 pages
    for _ in range(5):  # both decode; a's fifth page takes the last free one, b's fourth preempts b
        a.output_token_ids.append(1)
        if b in s.running:
            b.output_token_ids.append(1)
        _step(s)
    assert s.num_preemptions == 1 and b in s.waiting and len(a.pages) == 6
    # b's pages stayed in the cache until a's sixth page evicted one, b's last: its first two still match
    s.finish(a)
    assert _step(s) == {"b": (8, 5)}  # b's prompt after 2 cached pages, and its output token
    assert b.num_cached_tokens == 0  # what its first admission took (its first token was out before)


# ---- whole engines ----

_rng = random.Random(3)
SYSTEM = [_rng.randrange(VOCAB) for _ in range(21)]  # a shared prefix of 5 full pages and a token
SHARED = [SYSTEM + [_rng.randrange(VOCAB) for _ in range(n)] for n in (3, 9, 1, 14)]
N_OUT = 12


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=N_OUT, ignore_eos=True, **kw)


def test_shared_prefixes_give_transformers_tokens_and_report_their_cached_tokens(ckpt):
    path = ckpt("base")
    llm = make_llm(path, block_size=BS)
    first = llm.generate(SHARED[:1], greedy())[0]
    assert first.num_cached_tokens == 0
    outs = llm.generate(SHARED[1:], greedy())
    for out, prompt in zip([first, *outs], SHARED, strict=True):
        assert out.token_ids == hf_greedy(path, prompt, N_OUT)
    assert [o.num_cached_tokens for o in outs] == [20, 20, 20]
    again = llm.generate(SHARED[1:2], greedy())[0]  # its own pages too, up to the last full one before its end
    assert again.num_cached_tokens == 28 and again.token_ids == outs[0].token_ids
    off = make_llm(path, block_size=BS, disable_prefix_caching=True).generate(SHARED[1:2], greedy())[0]
    assert off.num_cached_tokens == 0 and off.token_ids == again.token_ids
    # the next turn: the last one's prompt and answer, then more; the answer's pages were cached too
    turn = SHARED[1] + again.token_ids + [7, 8, 9]
    nxt = llm.generate([turn], greedy())[0]
    assert nxt.num_cached_tokens == (len(turn) - 1) // BS * BS - BS  # but its page holding the answer's last token
    assert nxt.token_ids == hf_greedy(path, turn, N_OUT)
    assert_kv_all_free(llm)


def test_the_samples_of_one_request_compute_its_prompt_once(ckpt):
    path = ckpt("base")
    llm = make_llm(path, block_size=BS)
    sp = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=N_OUT, ignore_eos=True)
    out = llm.generate([SHARED[3]], sp)[0]
    assert [o.num_cached_tokens for o in out.outputs] == [0, 32, 32, 32]
    off = make_llm(path, block_size=BS, disable_prefix_caching=True).generate([SHARED[3]], sp)[0]
    assert [o.token_ids for o in out.outputs] == [o.token_ids for o in off.outputs]


def test_a_tiny_pool_evicts_cached_pages_and_stays_correct(ckpt):
    """64 KV tokens for 8 requests of ~35 tokens that share prefixes: preemptions, evictions and re-matches."""
    path = ckpt("base")
    llm = make_llm(path, block_size=BS, max_total_tokens=64)
    prompts = [SHARED[i % 4] for i in range(8)]
    outs = llm.generate(prompts, greedy())
    for out, prompt in zip(outs, prompts, strict=True):
        assert out.token_ids == hf_greedy(path, prompt, N_OUT)
    assert llm.kv_stats()["preemptions"] > 0
    assert_kv_all_free(llm)


@pytest.mark.slow
def test_two_ranks_share_prefixes_in_tp_and_ep_across_a_switch(ckpt):
    """P = 2 from EP: samples of one request are placed together and share their prompt's pages; a switch to TP
    mid-generation copies the shared pages per request, and TP then shares new requests' prefixes on every rank."""
    path = ckpt("tied_mha_nonorm")
    llm = LLM(model=path, dtype="float32", device="cpu", block_size=BS, num_ranks=2, mode="ep",
              max_total_tokens=1024, max_running_requests=16, max_num_batched_tokens=16, seed=0)
    try:
        sp = SamplingParams(n=3, temperature=1.0, seed=4, max_tokens=N_OUT, ignore_eos=True)
        group = llm.add_request(SHARED[3], sp)
        plain = [llm.add_request(p, greedy()) for p in SHARED[:3]]
        last: dict = {}
        for _ in range(4):
            for out in llm.step():
                last[out.request_id] = out
        queued = llm.add_request(SHARED[2], greedy())  # admitted with the switch's plan: waiting during the switch
        assert llm.switch_mode("tp").done
        later = llm.add_request(SHARED[1], greedy())
        last.update(run_to_completion(llm))
        cached = [o.num_cached_tokens for o in last[group].outputs]
        assert cached[0] == 0 and cached[1:] == [32, 32]  # together on one EP rank
        assert last[later].num_cached_tokens > 0
        for rid, prompt in zip([*plain, later, queued], [*SHARED[:3], SHARED[1], SHARED[2]], strict=True):
            assert last[rid].token_ids == hf_greedy(path, prompt, N_OUT)
        off = make_llm(path, block_size=BS, disable_prefix_caching=True).generate([SHARED[3]], sp)[0]
        assert [o.token_ids for o in last[group].outputs] == [o.token_ids for o in off.outputs]
        assert_kv_all_free(llm)
    finally:
        llm.close()


# ---- switches ----

def test_a_switch_shares_the_pages_a_source_rank_indexed_under_one_key() -> None:
    from moebius.switch.handover import shared_prefixes

    def req(keys: list[int], computed: int) -> Request:
        r = _req("r", list(range(40)))
        r.prefix_keys, r.num_computed = keys, computed
        return r

    reqs = [req([1, 2, 3], 14), req([1, 2, 7, 8], 16), req([1, 2, 3], 9), req([1, 2], 8), req([1, 2], 8),
            req([1, 9], 8)]
    # target rank (after) and source rank (before) of each: the fourth comes from another source rank (its keys are
    # another allocator's), the fifth goes to another target rank
    after, before = [0, 0, 0, 0, 1, 0], [0, 0, 0, 1, 0, 0]
    assert shared_prefixes(reqs, after, before, BS) == [0, 2, 2, 0, 0, 1]


@pytest.mark.slow
def test_a_switch_keeps_shared_prompt_pages_shared(ckpt):
    """P = 2 from TP: 8 requests with a 100-token system prompt. EP holds half the KV tokens of TP here, so a rank's
    4 requests fit in EP only if they keep sharing the system prompt's pages (each would need 27 pages, 63 there
    are): the switch to EP is done, and back to TP, with transformers' tokens."""
    path = ckpt("tied_mha_nonorm")
    rng = random.Random(5)
    system = [rng.randrange(VOCAB) for _ in range(100)]
    prompts = [system + [rng.randrange(VOCAB) for _ in range(4)] for _ in range(8)]
    llm = LLM(model=path, dtype="float32", device="cpu", block_size=BS, num_ranks=2, mode="tp",
              max_total_tokens=512, max_running_requests=16, max_num_batched_tokens=64, seed=0)
    try:
        ids = [llm.add_request(p, greedy()) for p in prompts]
        last: dict = {}
        for _ in range(4):
            for out in llm.step():
                last[out.request_id] = out
        assert all(rid in last for rid in ids)  # every one has its first token
        assert llm.kv_stats()["per_rank"][0]["total_tokens"] == 508
        out = llm.switch_mode("ep")
        assert out.done, out
        for out in llm.step():
            last[out.request_id] = out
        per_rank = llm.kv_stats()["per_rank"]
        assert all(r["total_tokens"] == 252 and r["total_tokens"] - r["free_tokens"] <= 45 * BS for r in per_rank)
        assert llm.switch_mode("tp").done
        last.update(run_to_completion(llm))
        for rid, prompt in zip(ids, prompts, strict=True):
            assert last[rid].token_ids == hf_greedy(path, prompt, N_OUT)
        assert_kv_all_free(llm)
    finally:
        llm.close()
