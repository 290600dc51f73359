"""Live EP <-> TP switches on CPU (gloo), P in {1, 2, 4}: outputs are unchanged by any number of switches at any
step, a round trip moves expert weights and KV back bit for bit without moving a buffer, a switch the target layout
cannot hold is refused while serving goes on, and no KV page leaks.

Checkpoints come from conftest.py (tiny random Qwen3-MoE written by transformers, std 0.3 weights):
  P=1  "dense_layer"       4 heads / 2 KV heads, layer 1 a dense MLP (its slot carries only KV)
  P=2  "tied_mha_nonorm"   4 KV heads (2 per TP rank), tied lm_head, raw top-k weights, 2 layers
  P=4  "base"              2 KV heads: TP replicates each KV head on 2 ranks, so TP holds half the KV of EP
plus a P=2 engine started in TP (its EP experts exist only through a switch).

Two tests pin engine bugs found while writing these tests (requests too long for an EP rank after a TP start;
more running requests than TP batch slots after EP->TP).
"""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
from conftest import VOCAB, hf_greedy

from moebius import LLM, SamplingParams
from moebius.link.messages import SwitchOutcome

pytestmark = pytest.mark.slow

BLOCK = 4
# per (P, start mode): checkpoint, max_running_requests, max_total_tokens (KV tokens per rank in the start layout)
SETUPS: dict[tuple[int, str], tuple[str, int, int]] = {
    (1, "ep"): ("dense_layer", 2, 1024),
    (2, "ep"): ("tied_mha_nonorm", 16, 1024),
    (2, "tp"): ("tied_mha_nonorm", 16, 512),  # experts loaded into the TP slots; EP pages are half as many
    (4, "ep"): ("base", 16, 160),
}


def make(path: str, P: int, max_running: int, max_total_tokens: int, mode: str = "ep", overlap: bool = False,
         transport: str = "collective") -> LLM:
    return LLM(model=path, dtype="float32", device="cpu", block_size=BLOCK, num_ranks=P, mode=mode,
               max_total_tokens=max_total_tokens, max_running_requests=max_running, max_num_batched_tokens=16,
               seed=0, switch_overlap=overlap, switch_transport=transport)


@pytest.fixture(scope="module")
def engines(ckpt: Any) -> Iterator[Callable[..., LLM]]:
    """engines(P, mode="ep", overlap=False, transport="collective") -> a shared LLM on P ranks started in `mode`
    (overlap: with --switch-overlap, the double-buffered pass; transport: --switch-transport), back in that mode and
    idle (started on first use, re-started if a failed test left requests in flight, closed at the end of the
    module)."""
    made: dict[tuple[int, str, bool, str], LLM] = {}

    def get(P: int, mode: str = "ep", overlap: bool = False, transport: str = "collective") -> LLM:
        key = (P, mode, overlap, transport)
        name, max_running, tokens = SETUPS[(P, mode)]
        if key in made and made[key].has_unfinished():
            made.pop(key).close()
        if key not in made:
            made[key] = make(ckpt(name), P, max_running, tokens, mode, overlap, transport)
        llm = made[key]
        if llm.mode != mode:
            assert llm.switch_mode(mode).done
        return llm

    yield get
    for llm in made.values():
        llm.close()


def path_of(ckpt: Any, P: int, mode: str = "ep") -> str:
    return ckpt(SETUPS[(P, mode)][0])


# ---------------------------------------------------------------------------------------------------------------
# Driving a scripted workload
# ---------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Job:
    name: str
    prompt: tuple[int, ...]
    params: SamplingParams
    arrive: int  # added before this step (or before the switch at this step: it is waiting at switch time)
    abort_at: int | None = None


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n)


def sampled(n: int, seed: int, samples: int = 1) -> SamplingParams:
    return SamplingParams(temperature=0.8, top_p=0.9, seed=seed, max_tokens=n, n=samples)


def prompts(seed: int) -> Callable[[int], tuple[int, ...]]:
    """A seeded source of random token-id prompts: prompt(n) -> n ids."""
    rng = random.Random(seed)
    return lambda n: tuple(rng.randrange(VOCAB) for _ in range(n))


_prompt = prompts(0)  # seeds here and below: every greedy reference path has top-2 logit gaps > 4e-3


# Mixed prompt lengths (1 token .. two prefill chunks of 16) and output lengths; arrivals spread over the run.
JOBS = [
    Job("g-long", _prompt(23), greedy(9), 0),
    Job("g-1", _prompt(1), greedy(12), 0),
    Job("s-a", _prompt(6), sampled(10, seed=11), 0),
    Job("g-mid", _prompt(11), greedy(4), 0),
    Job("g-abort", _prompt(9), greedy(12), 0, abort_at=5),
    Job("g-late", _prompt(17), greedy(6), 4),
    Job("s-n2", _prompt(5), sampled(7, seed=23, samples=2), 4),
    Job("g-short", _prompt(3), greedy(2), 8),
    Job("g-abort2", _prompt(14), greedy(10), 8, abort_at=11),
    Job("g-tail", _prompt(30), greedy(7), 11),
    Job("s-b", _prompt(2), sampled(8, seed=5), 15),
    Job("g-end", _prompt(7), greedy(5), 19),
]
# Steps before which the engine switches (alternating EP->TP, TP->EP); a step listed twice switches there and back
# without a step in between. Arrivals at 4, 8, 11, 15 and 19 are in the same plan as a switch.
SWITCHES = [1, 2, 4, 5, 8, 8, 11, 15, 19, 22]


def drive(llm: LLM, jobs: list[Job], switch_steps: Sequence[int] = (), max_steps: int = 400, deferred: bool = False
          ) -> tuple[dict[str, Any], list[SwitchOutcome]]:
    """Run the script; returns the last RequestOutput of each job (by name) and the outcome of every switch.
    deferred: each switch rides on the next step's plan (engine.request_switch) instead of its own call."""
    switches = Counter(switch_steps)
    last_event = max([j.arrive for j in jobs] + [j.abort_at or 0 for j in jobs] + list(switches) + [0])
    rid: dict[str, str] = {}
    outs: dict[str, Any] = {}
    outcomes: list[SwitchOutcome] = []
    for i in range(max_steps):
        for j in jobs:
            if j.arrive == i:
                rid[j.name] = llm.add_request(list(j.prompt), j.params)
            if j.abort_at == i:
                llm.abort(rid[j.name])
        targets = []
        for _ in range(switches[i]):
            targets.append("tp" if llm.mode == "ep" else "ep")
            if deferred:
                assert switches[i] == 1, "one deferred switch per step"
                llm.engine.request_switch(targets[-1])
            else:
                outcomes.append(_checked(llm.switch_mode(targets[-1]), llm, targets[-1]))
        if i > last_event and not llm.has_unfinished():
            break
        for o in llm.step():
            outs[o.request_id] = o
        if deferred and targets:
            assert llm.engine.last_switch is not None and llm.engine.last_switch.device is None
            outcomes.append(llm.engine.last_switch)  # its device times join it with the next step
    else:
        raise AssertionError(f"script did not finish in {max_steps} steps")
    if deferred:
        llm.step()  # an idle step brings the last switch's times
        for o in outcomes:
            _checked(o, llm, o.target, mode=False)
    names = {r: n for n, r in rid.items()}
    return {names[r]: o for r, o in outs.items()}, outcomes


def _checked(outcome: SwitchOutcome | None, llm: LLM, target: str, mode: bool = True) -> SwitchOutcome:
    assert outcome is not None and outcome.done is True, f"switch to {target} refused: {outcome}"
    assert not mode or llm.mode == target
    assert outcome.device is not None, outcome  # the pass's device times, with the switch or the step after it
    out = outcome.to_json()
    # the pass's span holds every layer's weight and KV phases; the total is the requests, the index vectors and
    # the span; the host's own part (planning, launching the pass) lies inside the switch call
    assert out["span_ms"] >= out["weights_ms"] + out["kv_ms"] - 1e-3, out
    assert abs(out["total_ms"] - out["requests_ms"] - out["prep_ms"] - out["span_ms"]) < 1e-6, out
    # the requests part: the global request list, the plan, the staging and the ranks' agreement on it
    assert abs(out["requests_ms"] - out["list_ms"] - out["plan_ms"] - out["staging_ms"]) < 1e-6, out
    assert out["requests_ms"] + out["prep_ms"] + out["enqueue_ms"] <= out["host_ms"] + 1e-3, out
    return outcome


def assert_kv_free(llm: LLM, P: int) -> None:
    """Idle: every page free, and no rank still holds a request or the spec of another rank's request."""
    per_rank = llm.kv_stats()["per_rank"]
    assert len(per_rank) == P
    for r, s in enumerate(per_rank):
        assert s["free_tokens"] == s["total_tokens"] > 0, f"rank {r} leaks KV in {llm.mode}: {per_rank}"
    held = llm.engine.query("requests")
    assert held == [{"running": [], "waiting": [], "others": []}] * P, f"ranks still hold requests: {held}"


def assert_idle_round_trip(llm: LLM, P: int) -> None:
    """A switch with nothing in flight, and back (EP -> TP -> EP): the pools are still whole in both layouts."""
    for target in ("tp", "ep"):
        assert llm.switch_mode(target).done
        assert_kv_free(llm, P)


def check_against_reference(path: str, jobs: list[Job], got: dict[str, Any], ref: dict[str, Any]) -> None:
    """Finished jobs: identical to the no-switch run, greedy ones to transformers too; aborted ones: a prefix."""
    for j in jobs:
        out = got.get(j.name)
        toks = [list(c.token_ids) for c in out.outputs] if out is not None else [[]]
        if j.abort_at is not None:
            full = hf_greedy(path, j.prompt, j.params.max_tokens)
            assert all(t == full[: len(t)] for t in toks), f"{j.name}: aborted output is not a prefix of greedy"
            continue
        assert out is not None and out.finished, f"{j.name} did not finish"
        want = [list(c.token_ids) for c in ref[j.name].outputs]
        assert toks == want, f"{j.name}: output differs from the run without switches"
        assert all(len(t) == j.params.max_tokens for t in toks)
        assert all(c.finish_reason == "length" for c in out.outputs)
        if j.params.temperature == 0:
            assert toks[0] == hf_greedy(path, j.prompt, j.params.max_tokens), f"{j.name}: differs from transformers"


# ---------------------------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------------------------

def _transport_used(outcomes: list[dict[str, Any]], transport: str, P: int, path: str) -> None:
    """Each switch moved its experts through `transport` (peer: every exchange of experts, two a layer, as peer
    copies; one rank has no peers and no peer transport). The P > 1 checkpoints have MoE layers only."""
    peer = transport == "peer" and P > 1
    with open(f"{path}/config.json") as f:
        layers = json.load(f)["num_hidden_layers"]
    assert all(o.transport == ("peer" if peer else "collective") for o in outcomes), outcomes
    assert all(o.peer_exchanges == (2 * layers if peer else 0) for o in outcomes), outcomes


# overlap: the double-buffered pass (--switch-overlap), run on the CPU in the order it queues work on the GPU;
# transport: --switch-transport (peer: the ranks copy into / out of each other's staging, here shared-memory files)
@pytest.mark.parametrize("P,overlap,transport", [(1, False, "collective"), (2, False, "collective"),
                                                 (4, False, "collective"), (1, True, "collective"),
                                                 (2, True, "collective"), (4, True, "collective"),
                                                 (2, False, "peer"), (4, True, "peer")])
def test_outputs_unchanged_by_many_switches(engines: Any, ckpt: Any, P: int, overlap: bool, transport: str) -> None:
    llm = engines(P, overlap=overlap, transport=transport)
    path = path_of(ckpt, P)
    ref, none = drive(llm, JOBS)
    assert none == [] and llm.mode == "ep"
    assert_kv_free(llm, P)
    got, outcomes = drive(llm, JOBS, SWITCHES)
    assert len(outcomes) == len(SWITCHES) >= 6
    assert all(o.pipelined is overlap for o in outcomes)
    _transport_used(outcomes, transport, P, path)
    assert [o.target for o in outcomes] == ["tp", "ep"] * (len(SWITCHES) // 2)
    check_against_reference(path, JOBS, got, ref)
    # aborted before they could finish (an abort sent with a switch's plan reports no output of its own)
    assert all(got[n].finish_reason in (None, "abort") for n in ("g-abort", "g-abort2") if n in got)
    assert_kv_free(llm, P)
    assert_idle_round_trip(llm, P)


def test_switch_riding_on_the_next_step_changes_nothing(engines: Any, ckpt: Any) -> None:
    """engine.request_switch: the switch travels in the same plan as the next step (one round trip from decision
    to the first step in the new layout), with arrivals in that plan too; outputs are those of no switch."""
    llm = engines(2)
    ref, _ = drive(llm, JOBS)
    got, outcomes = drive(llm, JOBS, sorted(set(SWITCHES)), deferred=True)
    assert [o.target for o in outcomes] == ["tp", "ep"] * (len(outcomes) // 2) + ["tp"] * (len(outcomes) % 2)
    check_against_reference(path_of(ckpt, 2), JOBS, got, ref)
    assert_kv_free(llm, 2)


def test_a_switch_into_ep_runs_each_request_where_the_front_end_placed_it(engines: Any, ckpt: Any) -> None:
    """One placement rule, one table: the front end places every live request for the switch (arrivals in the same
    plan too); each EP rank then runs exactly its own and keeps the specs of the others' requests."""
    P = 2
    llm = engines(P, "tp")
    _prompt = prompts(301)
    ids = [llm.add_request(list(_prompt(n)), greedy(12)) for n in (9, 30, 4, 17, 22)]
    for _ in range(3):
        llm.step()
    late = llm.add_request(list(_prompt(6)), greedy(12))  # arrives in the plan that carries the switch
    llm.engine.request_switch("ep")
    llm.step()
    assert llm.engine.last_switch and llm.engine.last_switch.done, llm.engine.last_switch
    held = llm.engine.query("requests")
    placed = {rid: llm.engine.placement.owner(rid) for rid in [*ids, late]}
    assert None not in placed.values(), placed
    for rank, h in enumerate(held):
        mine = set(h["running"]) | set(h["waiting"])
        assert mine == {rid for rid, o in placed.items() if o == rank}, (rank, held, placed)
        assert set(h["others"]) == set(placed) - mine
    while llm.has_unfinished():
        llm.step()
    assert_kv_free(llm, P)


def test_switch_to_the_current_mode_is_refused(engines: Any) -> None:
    llm = engines(1)
    out = llm.switch_mode("ep")
    assert out.done is False and "already" in out.reason
    assert llm.mode == "ep"
    with pytest.raises(ValueError):
        llm.switch_mode("dp")
    assert llm.mode == "ep"


def _union_kv(fp: list[dict[str, Any]]) -> dict[str, str]:
    kv: dict[str, str] = {}
    for rank in fp:
        assert not kv.keys() & rank["kv"].keys(), "a request is live on two EP ranks"
        kv.update(rank["kv"])
    return kv


@pytest.mark.parametrize("P,overlap,transport", [(2, False, "collective"), (4, False, "collective"),
                                                 (2, True, "collective"), (4, True, "collective"),
                                                 (2, True, "peer"), (4, False, "peer")])
def test_round_trip_restores_weights_and_kv_bit_for_bit(engines: Any, ckpt: Any, P: int, overlap: bool,
                                                        transport: str) -> None:
    llm = engines(P, overlap=overlap, transport=transport)
    path = path_of(ckpt, P)
    _prompt = prompts(100)
    jobs = [Job(f"r{i}", _prompt(n), greedy(m), 0) for i, (n, m) in enumerate([(21, 8), (3, 9), (9, 6), (14, 7),
                                                                                (1, 8), (6, 5)])]
    ids = {llm.add_request(list(j.prompt), j.params): j for j in jobs}
    outs: dict[str, Any] = {}
    for _ in range(3):  # some decoding, the long prompt still mid-prefill (16-token chunks)
        outs.update({o.request_id: o for o in llm.step()})
    late = Job("late", _prompt(5), greedy(4), 0)
    ids[llm.add_request(list(late.prompt), late.params)] = late  # admitted by the query's plan: waiting

    ep0 = llm.engine.query("fingerprint")
    assert [f["mode"] for f in ep0] == ["ep"] * P
    kv0 = _union_kv(ep0)
    assert len(kv0) >= 4 and "late" not in kv0
    ptrs = [f["ptrs"] for f in ep0]

    out = llm.switch_mode("tp")
    assert out.done
    _transport_used([out], transport, P, path)
    tp1 = llm.engine.query("fingerprint")
    assert [f["mode"] for f in tp1] == ["tp"] * P
    assert all(f["kv"].keys() == kv0.keys() for f in tp1), "TP ranks must hold every running request"
    if P == 4:  # 2 KV heads on 4 ranks: ranks 0, 1 hold head 0, ranks 2, 3 head 1
        assert tp1[0]["kv"] == tp1[1]["kv"] and tp1[2]["kv"] == tp1[3]["kv"]
        assert all(tp1[0]["kv"][r] != tp1[2]["kv"][r] for r in kv0)
    else:
        assert all(tp1[0]["kv"][r] != tp1[1]["kv"][r] for r in kv0)

    assert llm.switch_mode("ep").done
    ep2 = llm.engine.query("fingerprint")
    assert [f["experts"] for f in ep2] == [f["experts"] for f in ep0], "expert weights changed by EP->TP->EP"
    assert _union_kv(ep2) == kv0, "KV changed by EP->TP->EP"

    assert llm.switch_mode("tp").done
    tp3 = llm.engine.query("fingerprint")
    assert [f["experts"] for f in tp3] == [f["experts"] for f in tp1], "expert weights changed by TP->EP->TP"
    assert [f["kv"] for f in tp3] == [f["kv"] for f in tp1], "KV changed by TP->EP->TP"

    for target in ("ep", "tp", "ep", "tp", "ep"):
        assert llm.switch_mode(target).done
    ep4 = llm.engine.query("fingerprint")
    assert [f["experts"] for f in ep4] == [f["experts"] for f in ep0]
    assert _union_kv(ep4) == kv0
    for fp in (tp1, ep2, tp3, ep4):
        assert [f["ptrs"] for f in fp] == ptrs, "a buffer or view moved"

    while llm.has_unfinished():
        outs.update({o.request_id: o for o in llm.step()})
    for rid, j in ids.items():
        assert outs[rid].token_ids == hf_greedy(path, j.prompt, j.params.max_tokens), j.name
    assert [f["ptrs"] for f in llm.engine.query("fingerprint")] == ptrs
    assert_kv_free(llm, P)


def test_capacity_refusal_keeps_serving_in_ep(engines: Any, ckpt: Any) -> None:
    """2 KV heads on 4 ranks: a TP rank holds every request at one (replicated) head, i.e. half the tokens the four
    EP ranks hold together. Four long requests fit EP, not TP: the switch is refused and EP serves on; once two
    finish, the retry succeeds."""
    P = 4
    llm = engines(P)
    path = path_of(ckpt, P)
    _prompt = prompts(201)
    llm.step()
    ep_tokens = llm.kv_stats()["per_rank"][0]["total_tokens"]
    n_prompt = 126  # 4 requests need more than the 2 ranks' worth TP holds; 2 fit in it
    assert n_prompt + 24 <= ep_tokens < 2 * n_prompt
    jobs = [Job(f"c{i}", _prompt(n_prompt), greedy(m), 0) for i, m in enumerate([2, 24, 3, 20])]
    ids = {llm.add_request(list(j.prompt), j.params): j for j in jobs}  # one per EP rank (least loaded)

    outs: dict[str, Any] = {}
    for _ in range(4):
        outs.update({o.request_id: o for o in llm.step()})
    before = llm.engine.query("fingerprint")
    assert sorted(len(f["kv"]) for f in before) == [1] * P, "expected one long request per EP rank"
    out = llm.switch_mode("tp")
    assert out.done is False and "tp" in out.reason, out
    assert llm.mode == "ep"
    assert llm.engine.query("fingerprint") == before, "a refused switch changed state"

    retried = None
    while llm.has_unfinished():
        outs.update({o.request_id: o for o in llm.step()})
        finished = sum(1 for r in ids if r in outs and outs[r].finished)
        if retried is None and finished == 2:
            retried = llm.switch_mode("tp")
            assert retried.done is True, retried
            assert llm.mode == "tp"
    assert retried is not None
    for rid, j in ids.items():
        assert outs[rid].finished
        assert outs[rid].token_ids == hf_greedy(path, j.prompt, j.params.max_tokens), j.name
    assert_kv_free(llm, P)


def test_leak_free_after_aborts_around_switches(engines: Any) -> None:
    P = 2
    llm = engines(P)
    _prompt = prompts(300)
    rids = [llm.add_request(list(_prompt(n)), greedy(m)) for n, m in [(13, 12), (4, 12), (20, 12), (2, 3), (8, 12)]]
    llm.step()
    llm.step()
    llm.abort(rids[0])  # aborted in the switch's plan, on its EP rank
    assert llm.switch_mode("tp").done
    llm.step()
    llm.abort(rids[1])  # aborted in TP (on every rank)
    llm.step()
    late = llm.add_request(list(_prompt(6)), greedy(12))
    llm.abort(rids[2])
    assert llm.switch_mode("ep").done  # abort and a new request in the switch's plan
    llm.step()
    llm.abort(late)  # aborted in EP right after admission
    llm.abort(rids[4])
    llm.step()
    while llm.has_unfinished():
        llm.step()
    assert_kv_free(llm, P)
    assert_idle_round_trip(llm, P)


def test_tp_start_moves_the_weights_a_direct_load_gives(engines: Any, ckpt: Any) -> None:
    """Started in TP, the EP expert weights exist only through a switch: they must equal those of an engine that
    loaded EP from the checkpoint (and vice versa); then the scripted workload, starting from TP."""
    tp_start, ep_start = engines(2, "tp"), engines(2, "ep")
    a_tp, b_ep = tp_start.engine.query("fingerprint"), ep_start.engine.query("fingerprint")
    assert tp_start.switch_mode("ep").done and ep_start.switch_mode("tp").done
    a_ep, b_tp = tp_start.engine.query("fingerprint"), ep_start.engine.query("fingerprint")
    assert [f["experts"] for f in a_ep] == [f["experts"] for f in b_ep], "TP->EP weights differ from an EP load"
    assert [f["experts"] for f in b_tp] == [f["experts"] for f in a_tp], "EP->TP weights differ from a TP load"
    assert [f["experts"][0] for f in a_tp] != [f["experts"][0] for f in a_ep]
    assert tp_start.switch_mode("tp").done and ep_start.switch_mode("ep").done

    path = path_of(ckpt, 2, "tp")
    ref, _ = drive(tp_start, JOBS)
    got, outcomes = drive(tp_start, JOBS, SWITCHES)
    assert [o.target for o in outcomes] == ["ep", "tp"] * (len(SWITCHES) // 2)
    check_against_reference(path, JOBS, got, ref)
    assert_kv_free(tp_start, 2)


def test_request_larger_than_an_ep_rank_after_tp_start(engines: Any, ckpt: Any) -> None:
    """TP start, 4 KV heads on 2 ranks: an EP rank's pool holds half the tokens of a TP rank's. A prompt that fits TP
    but not one EP rank must be refused (ValueError) or served, never left waiting forever."""
    llm = engines(2, "tp")
    path = path_of(ckpt, 2, "tp")
    assert llm.switch_mode("ep").done
    llm.step()
    ep_tokens = llm.kv_stats()["per_rank"][0]["total_tokens"]
    prompt = list(prompts(500)(260))
    assert ep_tokens < len(prompt) + 4  # fits a TP rank, not an EP rank: admission must refuse it
    try:
        rid = llm.add_request(prompt, greedy(4))
    except ValueError:
        return
    out = None
    try:
        for _ in range(100):
            out = next((o for o in llm.step() if o.request_id == rid), out)
            if not llm.has_unfinished():
                break
        assert out is not None and out.finished, f"request never scheduled in EP (KV per rank: {ep_tokens} tokens)"
        assert out.token_ids == hf_greedy(path, prompt, 4)
    finally:
        llm.abort(rid)
        llm.step()


def test_ep_to_tp_with_more_running_requests_than_tp_batch_slots(ckpt: Any) -> None:
    """P=2, max_running_requests=2: each EP rank runs 2 requests; after EP->TP one TP batch would hold 4."""
    path = ckpt("tied_mha_nonorm")
    _prompt = prompts(400)
    llm = make(path, 2, 2, 1024)
    try:
        jobs = [Job(f"w{i}", _prompt(n), greedy(6), 0) for i, n in enumerate([3, 5, 7, 9, 4])]
        ids = {llm.add_request(list(j.prompt), j.params): j for j in jobs}
        outs: dict[str, Any] = {}
        for _ in range(2):
            outs.update({o.request_id: o for o in llm.step()})
        out = llm.switch_mode("tp")
        assert out.done or out.reason, out
        while llm.has_unfinished():
            outs.update({o.request_id: o for o in llm.step()})
        for rid, j in ids.items():
            assert outs[rid].token_ids == hf_greedy(path, j.prompt, j.params.max_tokens), j.name
        assert_kv_free(llm, 2)
    except BaseException:
        for p in llm.engine.ranks._procs:  # a dead rank 0 leaves rank 1 blocked in a collective: end it now
            p.kill()
        raise
    finally:
        llm.close()


def test_stop_strings_end_requests_where_their_ranks_run_them_across_switches(ckpt: Any) -> None:
    """Stop strings are found at the front end, where the text is decoded: on two EP ranks, with the layout switched
    while the requests run, each request ends on the token that completes its stop string (its text cut there, its
    tokens those of the run without stop strings up to that token), the ranks release it (every page free, no
    request or spec left on any rank), and a request without one runs to its length beside them."""
    path = ckpt("text")
    prompts = ["Once upon a time", "Hello, world! ", "The quick brown fox", "abc"]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    with LLM(model=path, dtype="float32", device="cpu", block_size=BLOCK, num_ranks=2, mode="ep",
             max_num_batched_tokens=16, seed=0) as llm:
        ref = llm.generate(prompts, greedy)
        stops = [r.text[5:7] for r in ref[:3]]  # strings this model does write, after a few tokens
        ids = [llm.add_request(p, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[s]))
               for p, s in zip(prompts, stops, strict=False)]
        ids.append(llm.add_request(prompts[3], greedy))
        last: dict[str, Any] = {}
        for step in range(200):
            if step in (2, 4):  # into TP and back, with the requests running
                llm.engine.request_switch("tp" if llm.mode == "ep" else "ep")
            if not llm.has_unfinished():
                break
            last.update({o.request_id: o for o in llm.step()})
        assert [e.done for e in llm.engine.timeline.switches] == [True, True]
        for rid, r, stop in zip(ids, ref, stops, strict=False):
            out = last[rid]
            at = r.text.index(stop)
            assert (out.finish_reason, out.outputs[0].stop_reason, out.text) == ("stop", stop, r.text[:at])
            n = len(out.token_ids)  # the token that completed the stop string (one byte a token) is the last
            assert out.token_ids == r.token_ids[:n] and n == at + len(stop)
        assert last[ids[3]].token_ids == ref[3].token_ids and last[ids[3]].finish_reason == "length"
        assert_kv_free(llm, 2)
