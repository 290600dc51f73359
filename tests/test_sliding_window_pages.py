"""Sliding-window layers keep only their window's KV pages: each KV group (`ModelConfig.kv_groups`) has its own
page tables and allocator, a window group's pages before a request's window are freed as the window moves on, the
prefix cache finds a window group's pages under the first group's keys, and a live switch moves (and gives the
target) only the window's pages. GPT-OSS (sliding layers alternating with full ones) is the engine-level case."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from family_cases import BLOCK, ENGINE_KW, hf_greedy
from test_gpt_oss_family import PROMPTS, WINDOW, write_gpt_oss_checkpoint

from moebius import LLM, SamplingParams
from moebius.config import first_live_page
from moebius.link.messages import DecodeProbe, PrefillProbe
from moebius.link.request import Request, RequestSpec
from moebius.memory.kv_pool import KVPages, KVPool, window_pages
from moebius.parallel.layout import slot_groups, slot_shifts
from moebius.worker.scheduler import Scheduler

BS = 4


def _req(rid: str, prompt: list[int], n_out: int) -> Request:
    return Request(RequestSpec(rid, prompt, SamplingParams(max_tokens=n_out), 0, 10_000))


def _run(s: Scheduler, steps: int, check: Any = None) -> None:
    """Schedule steps, marking each chunk computed and giving each sampled position a token."""
    for step in range(steps):
        batch = s.schedule()
        for c in batch:
            c.req.num_computed = c.start + c.num_tokens
            if c.samples:
                c.req.output_token_ids.append(1000 + step)
        if check is not None:
            check(batch)


def _used(kv: KVPages, g: int) -> int:
    return kv.groups[g].usable_pages - kv.groups[g].num_free


@pytest.mark.parametrize("windows", [(None, 6), (6,)], ids=["full+window", "window-only"])
def test_a_window_group_holds_only_the_pages_its_next_queries_read(windows: tuple[int | None, ...]) -> None:
    """A request decoding far past the window: a window group's table is page 0 before the window of the step's
    first query and live from there (its allocator holds exactly those pages), a full group's every page; with every
    layer windowed, a request five times longer than the pool runs in it. Finishing frees every group."""
    pages = 16 if windows[0] is None else 5  # window-only: 4 usable pages for a 50-token request
    kv = KVPages(pages, BS, windows)
    s = Scheduler(kv, max_running=4, max_batched_tokens=8)
    r = _req("a", list(range(10)), n_out=40)
    s.add(r)
    freed = []

    def check(batch: list[Any]) -> None:
        (c,) = batch
        for g, (table, w) in enumerate(zip(r.tables, windows, strict=True)):
            lead = first_live_page(c.start, w, BS)
            assert table[:lead] == [0] * lead and 0 not in table[lead:]
            assert len(table) == -(-(c.start + c.num_tokens) // BS)
            assert _used(kv, g) == len(table) - lead  # no page beyond the live ones held
            if w is not None:
                assert len(table) - lead <= -(-(w - 1) // BS) + 1  # a window's keys and the token written
                freed.append(lead)

    _run(s, 42, check)
    assert r.num_tokens == 51 and max(freed) >= 10  # the window moved on: most pages freed
    s.finish(r)
    assert all(_used(kv, g) == 0 for g in range(len(windows)))


def test_the_prefix_cache_takes_a_window_groups_pages_under_the_first_groups_keys() -> None:
    """Two groups (full, window 6): a prompt computed once is found again; the later request shares the full group's
    pages and, in the window group, the pages the window of its first computed token reads (page 0 before), even
    after the first request freed them as its window moved on (they stay indexed until evicted). Once those are
    evicted, the match shortens to a prefix whose window pages are still there."""
    kv = KVPages(32, BS, (None, 6))
    s = Scheduler(kv, max_running=4, max_batched_tokens=64)
    prompt = list(range(14))  # 3 full pages and 2 tokens
    a = _req("a", prompt, n_out=20)
    s.add(a)
    _run(s, 1)
    full_a, win_a = list(a.pages), list(a.group_pages[0])
    _run(s, 19)  # a decodes on: its window's early pages are freed (still indexed)
    assert a.group_pages[0][:3] == [0, 0, 0]
    b = _req("b", prompt, n_out=1)
    s.add(b)
    batch = s.schedule()
    assert [(c.req.request_id, c.start) for c in batch if c.req is b] == [("b", 12)]
    lead = first_live_page(12, 6, BS)  # keys 7.. : pages 1 and 2
    assert b.pages[:3] == full_a[:3]
    assert b.group_pages[0][:3] == [0] * lead + win_a[lead:3]
    s.finish(b)
    s.finish(a)
    kv.groups[1].allocate(kv.groups[1].num_free)  # evicts every window page the index held
    c = _req("c", prompt, n_out=1)
    tables, keys = kv.match(lambda i: c.page_tokens(i, BS), 3)
    # n = 3 or 2 needs window pages it no longer has; n = 1 needs none (its window starts at page 0, page 0 is
    # prompt page 0, evicted too): only n = 0 is left
    assert tables == [[], []] and keys == []


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_gpt_oss_checkpoint(str(tmp_path_factory.mktemp("window") / "gpt_oss"))


def test_gpt_oss_frees_the_sliding_layers_pages_and_a_switch_moves_only_the_window(gpt_oss: str) -> None:
    """A GPT-OSS request decoding far past its sliding layers' window, on one rank: the sliding layers' group holds
    the window's pages only (page 0 before them in its table), the full layers' group every page; a switch to EP
    half-way moves and gives the window group only the pages from the window of the next token on, the full group
    every page; the tokens are transformers'; nothing is left held."""
    prompt, n = PROMPTS[4], 30
    want = hf_greedy(gpt_oss, tuple(prompt), n)
    with LLM(model=gpt_oss, num_ranks=1, mode="tp", **ENGINE_KW) as llm:
        rank = llm.engine.ranks.rank
        moved: list[Any] = []
        move = rank.switcher.move

        def spy(src: str, dst: str, live: Any, *args: Any) -> Any:
            moved.append([[(x.num_tokens, x.start, list(x.dst_pages)) for x in g] for g in live])
            return move(src, dst, live, *args)

        rank.switcher.move = spy
        llm.add_request(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        out: Any = None
        most_freed, steps = 0, 0
        while llm.has_unfinished():
            for o in llm.step():
                out = o
            steps += 1
            if steps == 12:  # the live KV (the sliding layers' windows, the full layers' every token) moves intact
                before = llm.engine.query("fingerprint")[0]["kv"]
                assert llm.switch_mode("ep").done
                assert llm.engine.query("fingerprint")[0]["kv"] == before and before
            kv = rank.kv_pages
            for r in rank.scheduler.running:
                full, win = r.tables
                assert 0 not in full and kv.groups[0].usable_pages - kv.groups[0].num_free == len(full)
                live = [p for p in win if p]
                assert win[: len(win) - len(live)] == [0] * (len(win) - len(live))  # page 0, then the window's
                assert kv.groups[1].usable_pages - kv.groups[1].num_free == len(live)
                assert len(live) <= -(-(WINDOW - 1) // BLOCK) + 1 + 16 // BLOCK  # a window and a step's chunk
                most_freed = max(most_freed, len(win) - len(live))
        assert out.outputs[0].token_ids == want
        assert most_freed >= 10
        ((full_moves, win_moves),) = moved
        ((tokens, start, pages),) = full_moves
        assert start == 0 and 0 not in pages
        ((w_tokens, w_start, w_pages),) = win_moves
        lead = first_live_page(w_tokens, WINDOW, BLOCK)
        assert w_tokens == tokens and lead > 0 and w_start == lead * BLOCK
        assert w_pages[:lead] == [0] * lead and 0 not in w_pages[lead:] and len(w_pages) == len(pages)
        stats = llm.kv_stats()
        assert stats["free_tokens"] == stats["total_tokens"]



@pytest.fixture(scope="module")
def gpt_oss6(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Six layers, sliding and full alternating (transformers' default layer_types)."""
    return write_gpt_oss_checkpoint(str(tmp_path_factory.mktemp("window6") / "gpt_oss6"), {"num_hidden_layers": 6})


def test_gpt_oss_sliding_layers_slots_hold_a_windows_pages_and_the_full_layers_the_rest(gpt_oss6: str) -> None:
    """Six GPT-OSS layers: EP sits two slots past TP, so that each slot holds sliding layers or full ones in both
    layouts, and a sliding layer's slot holds only the pages the running requests' windows can take and as many
    cached windows (`window_pages`: 19 for 2 requests, 6-token windows, 4-token pages and a 16-token step) while a
    full layer's holds the whole budget: the buffer is the full layers' budget, a few windows and one more slot of
    experts, fewer bytes than one slot apart (the build takes the shift of fewer bytes). A request longer than the
    window group's pages, and probes with contexts longer than them, run on the freed pages; its tokens are
    transformers' across a switch and back."""
    prompt, n = PROMPTS[4], 60  # 83 tokens: 21 pages, against the window group's 18 usable
    want = hf_greedy(gpt_oss6, tuple(prompt), n)
    kw = {**ENGINE_KW, "max_running_requests": 2, "max_total_tokens": 2048}
    with LLM(model=gpt_oss6, num_ranks=1, mode="tp", **kw) as llm:
        rank = llm.engine.ranks.rank
        cfg = rank.cfg
        assert [g.window for g in cfg.kv_groups] == [None, WINDOW] and slot_shifts(cfg) == (1, 2)
        assert {rt.layout.slot_shift for rt in rank.modes.values()} == {2}
        win = window_pages(WINDOW, BLOCK, 2, kw["max_num_batched_tokens"])
        full = kw["max_total_tokens"] // BLOCK
        assert win == 19 < full
        for m, rt in rank.modes.items():
            assert rt.kv.group_pages == (full, win), m
            assert [c.shape[0] for c in rt.kv.layers] == [win, full] * 3
        page = KVPool.page_bytes(BLOCK, cfg.kv_spec, cfg.num_kv_heads, torch.float32)
        expert = rank.umm.plan.slots[0].nbytes - win * page
        kv_bytes = sum(nb for _, nb, tag in rank.umm.plan.tagged if tag == "kv_cache")
        assert kv_bytes == (4 * full + 4 * win) * page  # 8 slots: (1 + 5 mixed) full ones and 1 window one at shift 1
        assert 8 * expert + kv_bytes < 7 * expert + (6 * full + win) * page
        for probe in (DecodeProbe(batch=2, context=100, steps=1, warmup=0),
                      PrefillProbe(tokens=8, context=90, steps=1, warmup=0, decodes=1, decode_context=80)):
            (answer,) = llm.engine.probe(probe)
            assert "error" not in answer, answer
        assert llm.kv_stats()["free_tokens"] == llm.kv_stats()["total_tokens"]
        llm.add_request(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        out: Any = None
        steps = 0
        while llm.has_unfinished():
            for o in llm.step():
                out = o
            steps += 1
            if steps in (30, 45):  # past the window group's pages: its tables hold freed ones
                assert llm.switch_mode("ep" if steps == 30 else "tp").done
        assert out.outputs[0].token_ids == want
        assert all(a.num_free == a.usable_pages for a in rank.kv_pages.groups)


def test_three_gpt_oss_layers_keep_one_slot_apart_where_two_would_cost_more(gpt_oss: str) -> None:
    """Three layers (sliding, full, sliding): two slots apart would leave as many full slots (two) for one more slot
    of experts, so the build keeps one slot apart; the slots holding only a sliding layer (the first, TP's layer 0,
    and the last, EP's layer 2) still hold only a window group's pages."""
    kw = {**ENGINE_KW, "max_running_requests": 2}
    with LLM(model=gpt_oss, num_ranks=1, mode="tp", **kw) as llm:
        rank = llm.engine.ranks.rank
        assert {rt.layout.slot_shift for rt in rank.modes.values()} == {1}
        assert slot_groups(rank.cfg, ("tp", "ep")) == [frozenset({1}), frozenset({0, 1}), frozenset({0, 1}),
                                                        frozenset({1})]
        page = KVPool.page_bytes(BLOCK, rank.cfg.kv_spec, rank.cfg.num_kv_heads, torch.float32)
        kv_bytes = sum(nb for _, nb, tag in rank.umm.plan.tagged if tag == "kv_cache")
        full, win = kw["max_total_tokens"] // BLOCK, window_pages(WINDOW, BLOCK, 2, kw["max_num_batched_tokens"])
        assert kv_bytes == (2 * full + 2 * win) * page
