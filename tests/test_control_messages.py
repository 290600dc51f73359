"""Control messages between ranks (JSON over the CPU group): short ones travel inline in one collective, long ones
in two; every rank gets what was sent, whatever mix of lengths the ranks send."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from conftest import run_gloo_ranks

from moebius.parallel import groups as g


def _message(rank: int, size: int) -> dict:
    return {"rank": rank, "text": "é" * size + str(rank)}  # multi-byte characters: lengths are bytes, not chars


def _rank(rank: int, world: int, sizes: list[int]) -> None:
    groups = g.Groups(rank, world, dist.group.WORLD, dist.group.WORLD)
    for src in range(world):  # every rank broadcasts a short and a long message
        for size in sizes:
            assert g.broadcast_json(_message(src, size), groups, src=src) == _message(src, size)
    for size in sizes:  # ranks send messages of different lengths: some inline, some not
        mine = _message(rank, size * (rank + 1))
        got = g.gather_json(mine, groups, dst=1)
        want = [_message(r, size * (r + 1)) for r in range(world)]
        assert got == (want if rank == 1 else None)
        assert g.all_gather_json(mine, groups) == want
        assert g.all_gather_json(mine, groups, inline=65536) == want  # a longer first round: all inline here


@pytest.mark.parametrize("world", [2, 3])
def test_control_messages_short_and_long_reach_every_rank(world: int) -> None:
    # 2-byte characters: 10 (inline), 5000 (10 KB, inline for rank 0 only), 20000 (40 KB: never inline)
    sizes = [10, 5000, 20000]
    assert 2 * 20000 > g._INLINE > 2 * 10
    run_gloo_ranks(_rank, world, sizes)


def test_token_ids_round_trip_through_json() -> None:
    """Token ids travel as base64 int32: any id of a real vocabulary, the overlap placeholder (-1), none at all."""
    import json

    for ids in ([], [0], [-1, 5, 151935, 2**31 - 1], list(range(1000))):
        assert g.ids_from_json(json.loads(json.dumps(g.ids_to_json(ids)))) == ids


def test_request_lists_round_trip_with_their_output_ids_in_one_string() -> None:
    """A switch's request list: every request's output ids travel as one string, its state per request, its spec
    not at all (the receiver holds it); each comes back whole (empty outputs, prompt logits, status), and a
    request whose spec is unknown or counts that do not match the ids are an error, never a request with the wrong
    tokens."""
    import json

    import pytest
    import torch

    from moebius.link.codec import decode, encode
    from moebius.link.request import Request, RequestSpec, Status
    from moebius.sampling_params import SamplingParams
    from moebius.switch.handover import RequestList

    def requests_to_json(reqs: list[Request]) -> dict:
        return encode(RequestList.of(reqs))

    def requests_from_json(msg: dict, specs: dict) -> list[Request]:
        return decode(RequestList, msg).requests_with(specs)

    reqs = [Request(RequestSpec("a", [1, 2, 3], SamplingParams(max_tokens=5, stop=["x"]), 7, 100, 0), [4, 5], 4,
                    status=Status.RUNNING, num_cached_tokens=2, prefix_keys=[3]),
            Request(RequestSpec("b", [151935] * 40, SamplingParams(prompt_logits=True), 8, 100, 1),
                    prompt_logits=[torch.ones(2, 3)]),
            Request(RequestSpec("c", [9], SamplingParams(), 9, 100, 2), [-1, 151935, 0])]
    specs = {r.request_id: r.spec for r in reqs}
    msg = json.loads(json.dumps(requests_to_json(reqs)))
    assert "prompt_token_ids" not in json.dumps(msg) and "params" not in json.dumps(msg)
    back = requests_from_json(msg, specs)
    for r, b in zip(reqs, back, strict=True):
        assert (b.spec, b.output_token_ids, b.num_computed, b.status, b.num_cached_tokens, b.prefix_keys) == (
            r.spec, r.output_token_ids, r.num_computed, r.status, r.num_cached_tokens, r.prefix_keys)
        assert len(b.prompt_logits) == len(r.prompt_logits)
        assert all(torch.equal(x, y) for x, y in zip(b.prompt_logits, r.prompt_logits, strict=True))
    assert requests_from_json(requests_to_json([]), {}) == []
    with pytest.raises(ValueError, match="without its spec"):
        requests_from_json(msg, {"a": reqs[0].spec})
    msg["requests"][0]["num_output"] += 2
    with pytest.raises(ValueError, match="do not match"):
        requests_from_json(msg, specs)
    msg["requests"][0]["num_output"] -= 3
    with pytest.raises(ValueError, match="belong to no request"):
        requests_from_json(msg, specs)


def test_token_deltas_pickle_with_every_field() -> None:
    """A rank process's reply crosses its pipe pickled; TokenDelta pickles as its constructor's arguments."""
    import dataclasses
    import pickle

    import torch

    from moebius.link.messages import TokenDelta

    d = TokenDelta("r7-1", [5, 6], "stop", 6, torch.arange(6.0).view(2, 3), [-0.1, -1.5], [5, 9], 3)
    back = pickle.loads(pickle.dumps(d))
    for f in dataclasses.fields(TokenDelta):
        a, b = getattr(d, f.name), getattr(back, f.name)
        assert (torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b), f.name


def test_plans_and_reports_cross_between_ranks_whole_and_typed() -> None:
    """What rank 0 broadcasts and gathers goes as JSON: a plan's typed parts (admissions with their owner, releases,
    a switch order with owners, a query) and a report's (token deltas, a switch's outcome with its device times,
    query answers) come back equal, of their own types; a merged report sums the counts and keeps rank 0's
    switch."""
    import json

    from moebius.link.codec import decode, encode
    from moebius.link.messages import (
        Admit,
        KVStats,
        Query,
        StepPlan,
        StepReport,
        StepWork,
        SwitchOrder,
        SwitchOutcome,
        SwitchTimes,
        TokenDelta,
    )
    from moebius.link.request import RequestSpec
    from moebius.sampling_params import RequestOutputKind, SamplingParams

    params = SamplingParams(max_tokens=5, stop=["x"], output_kind=RequestOutputKind.DELTA)
    plan = StepPlan([Admit(RequestSpec("a", [1, 2, 3], params, 7, 100, 0), owner=1)], ["b"],
                    SwitchOrder("ep", {"a": 1, "c": 0}), run=False, query=Query.REQUESTS)
    back = decode(StepPlan, json.loads(json.dumps(encode(plan))))
    assert back == plan and isinstance(back.admit[0], Admit) and back.query is Query.REQUESTS
    assert back.admit[0].spec.params.stop_strings == ("x",)  # derived again on arrival
    outcome = SwitchOutcome("tp", "ep", True, list_ms=1.5, transport="collective", running=2,
                            device=SwitchTimes(3.0, 1.0, 4.5, 9.0))
    reports = [StepReport([TokenDelta("a", [9], None, cached_tokens=2)], [KVStats(10, 20)], 1, 0,
                          StepWork(tokens=3, sequences=1), outcome, None, answers=[{"running": ["a"]}]),
               StepReport([TokenDelta("c", [4], "stop", 4)], [KVStats(5, 20)], 1, 1, StepWork(tokens=1),
                          SwitchOutcome("tp", "ep", True), None, answers=[{"running": ["c"]}])]
    wired = [decode(StepReport, json.loads(json.dumps(encode(r)))) for r in reports]
    assert wired == reports and isinstance(wired[0].switch, SwitchOutcome)
    merged = StepReport.merge(wired)
    assert [d.request_id for d in merged.deltas] == ["a", "c"] and merged.kv == [KVStats(10, 20), KVStats(5, 20)]
    assert (merged.running, merged.waiting, merged.work.tokens) == (2, 1, 4) and merged.switch == outcome
    assert merged.answers == [{"running": ["a"]}, {"running": ["c"]}] and outcome.total_ms == 9.0
    assert outcome.to_json()["to"] == "ep" and outcome.to_json()["weights_ms"] == 3.0
