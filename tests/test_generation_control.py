"""Generation control around a weight update (LLM.pause_generation / resume_generation / is_paused / abort_all), one
rank in process, two spawned ranks in TP and EP and four in EP (3 requests on 4 ranks: one rank has none): "abort"
ends every request with the tokens it had, "retract" frees every request's KV and, after resume, finishes with the
tokens of a run without the pause (or, with an update to B in between, B's tokens for what follows the retract),
"keep" continues with the same tokens (with an update in between: those of a run that updated at that step without a
pause); retracted requests move with a switch; while paused no step runs and new requests wait.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import PROMPTS, Checkpoints, make_llm, shared_llm

from moebius import SamplingParams

N = 8  # greedy tokens a prompt
GREEDY = SamplingParams(max_tokens=N, temperature=0.0)
TEST_PROMPTS = PROMPTS[1:4]  # 5, 17 and 33 tokens
STEPS_BEFORE = 4  # steps run before the pause: every request has some tokens, none all of them


@pytest.fixture(scope="module", params=[(1, "tp"), (2, "tp"), (2, "ep"), (4, "ep")],
                ids=["P1", "P2-tp", "P2-ep", "P4-ep"])
def llm(request: pytest.FixtureRequest, ckpt: Checkpoints) -> Iterator[Any]:
    ranks, mode = request.param
    engine = make_llm(ckpt("base"), num_ranks=ranks, mode=mode)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def want(llm: Any) -> list[list[int]]:
    """The tokens of a run without a pause."""
    return [o.token_ids for o in llm.generate(TEST_PROMPTS, GREEDY)]


def _start(llm: Any) -> tuple[list[str], dict[str, Any]]:
    """The test prompts admitted and STEPS_BEFORE steps run: their ids and the last output of each."""
    ids = [llm.add_request(p, GREEDY) for p in TEST_PROMPTS]
    last: dict[str, Any] = {}
    for _ in range(STEPS_BEFORE):
        for out in llm.step():
            last[out.request_id] = out
    return ids, last


def _run(llm: Any, last: dict[str, Any], max_steps: int = 1000) -> dict[str, Any]:
    for _ in range(max_steps):
        if not llm.has_unfinished():
            return last
        for out in llm.step():
            last[out.request_id] = out
    raise AssertionError("the engine did not finish")


def _no_step_while_paused(llm: Any, last: dict[str, Any]) -> None:
    """A few step() calls while paused: no token comes (outputs from before the pause only)."""
    for out in llm.step():  # what the pause itself produced (the steps in flight)
        last[out.request_id] = out
    held = {rid: list(o.outputs[0].token_ids) for rid, o in last.items()}
    for _ in range(3):
        assert llm.step() == []
    assert {rid: list(o.outputs[0].token_ids) for rid, o in last.items()} == held


def test_abort_returns_partial_tokens(llm: Any, want: list[list[int]]) -> None:
    ids, last = _start(llm)
    llm.pause_generation("abort")
    assert llm.is_paused
    last = _run(llm, last)  # the aborted outputs come with the next step(); nothing is left to run
    for rid, full in zip(ids, want, strict=True):
        o = last[rid].outputs[0]
        assert last[rid].finished and o.finish_reason == "abort"
        assert 0 < len(o.token_ids) < N and o.token_ids == full[:len(o.token_ids)]
    stats = llm.kv_stats()
    assert stats["free_tokens"] == stats["total_tokens"]
    llm.resume_generation()
    assert not llm.is_paused
    assert [o.token_ids for o in llm.generate(TEST_PROMPTS, GREEDY)] == want


def test_retract_frees_kv_and_recomputes_the_same_tokens(llm: Any, want: list[list[int]]) -> None:
    ids, last = _start(llm)
    assert llm.kv_stats()["free_tokens"] < llm.kv_stats()["total_tokens"]
    llm.pause_generation("retract")
    stats = llm.kv_stats()
    assert stats["free_tokens"] == stats["total_tokens"]  # every running request's pages given back
    _no_step_while_paused(llm, last)
    assert all(0 < len(last[r].outputs[0].token_ids) < N for r in ids)
    llm.resume_generation()
    last = _run(llm, last)
    assert [last[r].outputs[0].token_ids for r in ids] == want
    assert all(last[r].outputs[0].finish_reason == "length" for r in ids)


def test_retract_then_update_recomputes_on_the_new_weights(llm: Any, ckpt: Checkpoints) -> None:
    ids, last = _start(llm)
    llm.pause_generation("retract")
    _no_step_while_paused(llm, last)
    before = {r: list(last[r].outputs[0].token_ids) for r in ids}
    try:
        llm.update_weights_from_disk(ckpt("base_b"), "B")
        llm.resume_generation()
        last = _run(llm, last)
    finally:
        llm.resume_generation()
        llm.update_weights_from_disk(ckpt("base"), None)
    fresh_b = shared_llm(ckpt("base_b"))
    for r, prompt in zip(ids, TEST_PROMPTS, strict=True):
        got, so_far = last[r].outputs[0].token_ids, before[r]
        assert got[:len(so_far)] == so_far
        rest = fresh_b.generate([prompt + so_far], SamplingParams(max_tokens=N - len(so_far), temperature=0.0))
        assert got[len(so_far):] == rest[0].token_ids
        assert last[r].weight_version == "B"


def test_keep_continues_with_the_same_tokens(llm: Any, want: list[list[int]]) -> None:
    ids, last = _start(llm)
    llm.pause_generation("in_place")  # SGLang's name for "keep"
    used = llm.kv_stats()["free_tokens"]
    _no_step_while_paused(llm, last)
    assert llm.kv_stats()["free_tokens"] == used < llm.kv_stats()["total_tokens"]  # the KV stays
    llm.resume_generation()
    last = _run(llm, last)
    assert [last[r].outputs[0].token_ids for r in ids] == want


@pytest.mark.same_at_p4("the front end holds new requests")
def test_new_requests_wait_while_paused(llm: Any, want: list[list[int]]) -> None:
    llm.pause_generation("keep")
    with pytest.raises(RuntimeError, match="paused"):
        llm.generate(TEST_PROMPTS, GREEDY)
    ids = [llm.add_request(p, GREEDY) for p in TEST_PROMPTS]
    last: dict[str, Any] = {}
    _no_step_while_paused(llm, last)
    assert last == {}
    llm.resume_generation()
    last = _run(llm, last)
    assert [last[r].outputs[0].token_ids for r in ids] == want


@pytest.mark.parametrize("paused_before", [False, True], ids=["running", "paused"])
@pytest.mark.same_at_p4("the front end steps until nothing runs")
def test_wait_finishes_every_request_then_pauses(llm: Any, want: list[list[int]], paused_before: bool) -> None:
    ids, last = _start(llm)
    if paused_before:  # a pause in place: wait runs its requests to their end too
        llm.pause_generation("keep")
    llm.pause_generation("wait")
    assert llm.is_paused
    _no_step_while_paused(llm, last)  # (the outputs of the steps the pause ran)
    assert [last[r].outputs[0].token_ids for r in ids] == want and all(last[r].finished for r in ids)
    assert not llm.has_unfinished()
    llm.resume_generation()


@pytest.mark.same_at_p4("the ranks abort as in test_abort_returns_partial_tokens")
def test_abort_all_and_bad_mode(llm: Any, want: list[list[int]]) -> None:
    with pytest.raises(ValueError, match="mode must be one of .*'in_place'.*got 'sleep'"):
        llm.pause_generation("sleep")
    assert not llm.is_paused
    ids, last = _start(llm)
    assert sorted(llm.abort_all()) == sorted(ids)
    last = _run(llm, last)
    assert all(last[r].outputs[0].finish_reason == "abort" for r in ids)
    assert [o.token_ids for o in llm.generate(TEST_PROMPTS, GREEDY)] == want


def test_keep_then_update_equals_an_update_at_that_step(llm: Any, ckpt: Checkpoints, want: list[list[int]]) -> None:
    got = {}
    try:
        for pause in (True, False):
            ids, last = _start(llm)
            if pause:
                llm.pause_generation("keep")
            llm.update_weights_from_disk(ckpt("base_b"), "B")
            llm.resume_generation()
            last = _run(llm, last)
            got[pause] = [last[r].outputs[0].token_ids for r in ids]
            llm.update_weights_from_disk(ckpt("base"), None)
    finally:
        llm.resume_generation()
    assert got[True] == got[False] != want


def test_retracted_requests_move_with_a_switch(llm: Any, want: list[list[int]]) -> None:
    if llm.engine.world_size == 1:
        pytest.skip("one rank: both layouts are the same")
    start = llm.mode
    ids, last = _start(llm)
    llm.pause_generation("retract")
    assert llm.switch_mode("ep" if start == "tp" else "tp").done
    llm.resume_generation()
    last = _run(llm, last)
    assert [last[r].outputs[0].token_ids for r in ids] == want
    assert llm.switch_mode(start).done


def test_offline_admin_status_says_paused_and_the_version(ckpt: Checkpoints) -> None:
    with make_llm(ckpt("base"), admin_port=0) as llm:
        llm.update_weights_from_disk(ckpt("base"), "v1")
        llm.pause_generation("keep")
        llm.step()  # (the admin endpoints' snapshot is taken after a step() call)
        with urllib.request.urlopen(f"http://127.0.0.1:{llm.admin.port}/admin/status", timeout=10) as r:
            status = json.loads(r.read())
        assert status["paused"] is True and status["weight_version"] == "v1"
