"""Each layout's KV capacity engine-wide, as a running engine knows it from its ranks' pools: TP holds every
request's cache on every rank, so where the cache is replicated (DeepSeek's MLA latent; Qwen3 with fewer KV heads
than ranks) TP holds 1/P of EP's tokens. `kv_stats` reports that, and auto mode's policy declines a switch into a
layout that cannot hold the live KV (the rule `bench simulate` uses, `AutoMode.observe`) instead of asking the ranks
for a switch they refuse.

Engines: P = 2 on the CPU, 4-token pages, 64 tokens of KV a rank (15 usable pages: page 0 is reserved)."""

from __future__ import annotations

from typing import Any

import pytest
from conftest import PROMPTS, make_llm, run_to_completion

from moebius.sampling_params import SamplingParams

BLOCK = 4
ENGINE: dict[str, Any] = dict(num_ranks=2, block_size=BLOCK, max_total_tokens=64, max_num_batched_tokens=16,
                              max_running_requests=8)
# rollout profile: EP first; T_h = T_l = 100, one step's count: in EP the policy wants TP after every step
AUTO: dict[str, Any] = dict(mode="auto", switch_profile="rollout", switch_high=100, switch_window=1,
                            switch_cooldown=0)
# four requests of 17-23 prompt tokens (about 22 pages together, over the 15 TP has a rank); three end after 6
# tokens, the last (14 pages at most) after 30: TP holds it alone
PROMPT_SET = [PROMPTS[2], PROMPTS[2][::-1], PROMPTS[3][:20], PROMPTS[3][10:]]
OUT = [6, 6, 6, 30]
FAMILIES = ["deepseek_v3", "sparse_step2"]  # DeepSeek-V3 (MLA), Qwen3-MoE with one KV head


def _params(n: int = 8) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _tokens(last: dict[str, Any], ids: list[str]) -> list[list[int]]:
    return [list(last[i].outputs[0].token_ids) for i in ids]


@pytest.mark.parametrize("name", ["deepseek_v3", "sparse_step2", "base"])
def test_kv_stats_count_tp_once_and_ep_over_the_ranks(ckpt: Any, name: str) -> None:
    """kv_stats' totals are what the active layout holds engine-wide, equal to its pools as the ranks report them
    (MEMORY query): TP one rank's, EP the sum; the per-rank figures stay. A replicated cache (MLA, one KV head):
    TP's 60 tokens against EP's 120. Two KV heads on two ranks (base) split in TP: TP's pages are twice EP's a rank,
    so both hold about the same engine-wide."""
    with make_llm(ckpt(name), mode="ep", **ENGINE) as llm:
        cap = llm.engine.kv_capacity_by_layout
        want = {"tp": 60, "ep": 120} if name != "base" else {"tp": (2 * 16 - 1) * BLOCK, "ep": 120}
        assert cap == want
        for mode in ("ep", "tp"):
            if llm.mode != mode:
                assert llm.switch_mode(mode).done
            stats = llm.kv_stats()
            pools = [a["kv_tokens"] for a in llm.engine.query("memory")]
            assert stats["capacity"] == want
            assert stats["total_tokens"] == stats["free_tokens"] == want[mode]
            assert stats["per_rank"] == [{"free_tokens": n, "total_tokens": n} for n in pools]
            assert (sum(pools) if mode == "ep" else pools[0]) == want[mode]
        # in use: TP's used tokens are one rank's (every rank holds the same pages)
        llm.add_request(list(PROMPTS[2]), _params())
        llm.step()
        stats = llm.kv_stats()
        used = [r["total_tokens"] - r["free_tokens"] for r in stats["per_rank"]]
        assert used[0] == used[1] > 0
        assert stats["total_tokens"] - stats["free_tokens"] == used[0]
        run_to_completion(llm)


def _held_tp_would_not(llm: Any, prompts: list[list[int]]) -> list[str]:
    """Admit the requests with the policy off, step until their KV is more than TP holds, then turn it on."""
    auto = llm.engine.auto
    llm.engine.set_auto(None)
    ids = [llm.add_request(list(p), _params(n)) for p, n in zip(prompts, OUT, strict=True)]
    while llm.engine._kv_held() <= llm.engine.kv_capacity_by_layout["tp"]:
        llm.step()
    assert llm.mode == "ep" and llm.has_unfinished()
    llm.engine.set_auto(auto)
    return ids


@pytest.mark.parametrize("name", FAMILIES)
def test_auto_declines_a_switch_to_tp_that_cannot_hold_the_live_kv(ckpt: Any, name: str) -> None:
    """EP with four requests holding more KV than TP's 60 tokens: the policy wants TP after every step but does not
    ask for it while the KV would not fit (its refusals count), so the ranks never refuse a switch; once requests end
    and the KV fits, it switches (done). Tokens equal a static EP run's."""
    path = ckpt(name)
    with make_llm(path, mode="ep", **ENGINE) as static:
        ids = [static.add_request(list(p), _params(n)) for p, n in zip(PROMPT_SET, OUT, strict=True)]
        want = _tokens(run_to_completion(static), ids)
    with make_llm(path, **AUTO, **ENGINE) as llm:
        core = llm.engine
        assert core.auto is not None and core.auto.capacity == {"tp": 60, "ep": 120}
        ids = _held_tp_would_not(llm, PROMPT_SET)
        assert _tokens(run_to_completion(llm), ids) == want
        events = list(core.timeline.switches)
        assert core.auto.refusals > 0
        assert events and all(e.done for e in events), events  # no switch the ranks refused
        assert (events[0].source, events[0].target) == ("ep", "tp")
        assert core.last_switch is not None and core.last_switch.done
        assert llm.kv_stats()["free_tokens"] == llm.kv_stats()["total_tokens"]


def test_without_the_capacity_the_ranks_refuse_that_switch(ckpt: Any) -> None:
    """The same engine with the policy's capacities taken away asks for the switch, and the ranks refuse it (their
    capacity check): what the policy's check spares."""
    with make_llm(ckpt("deepseek_v3"), **AUTO, **ENGINE) as llm:
        core = llm.engine
        _held_tp_would_not(llm, PROMPT_SET)
        assert core.auto is not None
        core.auto.capacity = {}
        llm.step()
        llm.step()  # the switch rides on the step after the one the policy saw
        assert core.last_switch is not None and not core.last_switch.done
        assert "cannot hold the live KV" in str(core.last_switch.reason)
        run_to_completion(llm)
