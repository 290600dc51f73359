"""The one token stream: every output kind is built from the same per-step deltas. Deltas concatenate to the
cumulative output (tokens, text, log-probabilities), a final-only request returns one output, no output comes back
empty, tokens a sample gets after a stop string ended it are dropped, and a step-level
request's outputs that arrive while `generate` runs are kept for the next `step()`."""

from __future__ import annotations

from typing import Any

from conftest import make_llm

from moebius import RequestOutputKind, SamplingParams

TEXT = ["Once upon a time", "Hello, world! "]


def _params(kind: RequestOutputKind, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.8, top_k=20, seed=3, max_tokens=12, ignore_eos=True, logprobs=2, n=2,
                          output_kind=kind, **kw)


def _drive(llm: Any, kind: RequestOutputKind, **kw: Any) -> list[Any]:
    rid = llm.add_request(TEXT[1], _params(kind, **kw))
    outs = []
    while llm.has_unfinished():
        outs += [o for o in llm.step() if o.request_id == rid]
    return outs


def _joined(outs: list[Any], n: int) -> list[tuple[list[int], str, list[Any], str | None]]:
    """Each sample's deltas joined: tokens, text, log-probabilities, its last finish reason."""
    got: list[tuple[list[int], str, list[Any], str | None]] = [([], "", [], None) for _ in range(n)]
    for o in outs:
        assert o.outputs, "an output without a sample in it"
        for c in o.outputs:
            toks, text, lps, _ = got[c.index]
            got[c.index] = (toks + c.token_ids, text + c.text, lps + (c.logprobs or []), c.finish_reason)
    return got


def _whole(out: Any) -> list[tuple[list[int], str, list[Any], str | None]]:
    return [(c.token_ids, c.text, c.logprobs or [], c.finish_reason) for c in out.outputs]


def test_output_kinds_are_views_of_one_stream(ckpt: Any) -> None:
    with make_llm(ckpt("text")) as llm:
        cumulative = _drive(llm, RequestOutputKind.CUMULATIVE)
        deltas = _drive(llm, RequestOutputKind.DELTA)
        final = _drive(llm, RequestOutputKind.FINAL_ONLY)
    assert len(final) == 1 and final[0].finished and len(cumulative) > 2
    assert _joined(deltas, 2) == _whole(cumulative[-1]) == _whole(final[0])
    assert sum(len(c.token_ids) for o in deltas for c in o.outputs) == 24  # each token once


def test_deltas_of_a_sample_ended_by_a_stop_string_with_plans_ahead(ckpt: Any) -> None:
    """With rank processes and two plans ahead, the steps sent before the front end saw the stop string still
    report the sample's tokens: they are dropped (the deltas join to the final output, cut at the stop string), and
    the release frees the pages."""
    path = ckpt("text")
    with make_llm(path) as ref:
        whole = _drive(ref, RequestOutputKind.FINAL_ONLY)[0]
    stop = whole.outputs[0].text[4:6]
    with make_llm(path, rank_process="on", plans_ahead=2) as llm:
        deltas = _drive(llm, RequestOutputKind.DELTA, stop=[stop])
        final = _drive(llm, RequestOutputKind.FINAL_ONLY, stop=[stop])[0]
        assert llm.kv_stats()["free_tokens"] == llm.kv_stats()["total_tokens"]
    joined = _joined(deltas, 2)
    assert joined == _whole(final)
    first = whole.outputs[0].text
    assert final.outputs[0].finish_reason == "stop" and final.outputs[0].text == first[: first.index(stop)]


def test_generate_keeps_the_outputs_of_step_level_requests(ckpt: Any) -> None:
    with make_llm(ckpt("text")) as llm:
        rid = llm.add_request(TEXT[0], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        [gen] = llm.generate(TEXT[1], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        assert gen.finished and len(gen.token_ids) == 8
        assert llm.has_unfinished()  # the other request's outputs wait for step()
        outs = [o for o in llm.step() if o.request_id == rid]
        assert outs and outs[-1].finished and len(outs[-1].token_ids) == 3
        assert not llm.has_unfinished()
