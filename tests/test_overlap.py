"""Overlap scheduling: the next step is launched before the current one's tokens are read back (its input tokens
come from the device), and the outputs are exactly those of resolving every step before the next: EOS and stop
tokens that end a request a step late, stop strings, min_tokens, n > 1 with seeds, prompt logits, chunked prefill
and preemption under a tiny KV pool."""

from __future__ import annotations

import pytest
import torch
from conftest import PROMPTS, assert_kv_all_free, make_llm, run_to_completion

from moebius import SamplingParams
from moebius.link.request import PLACEHOLDER

TEXT = ["Once upon a time", "Hello, world! ", "x", "The quick brown fox jumps over the lazy dog, again and again"]


def _workload(llm) -> list[tuple[list[int] | str, SamplingParams]]:
    """Requests whose stop tokens and strings are taken from what this model generates (so they do fire)."""
    probe = llm.generate(TEXT[:2], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    stop_tok = probe[0].token_ids[4]
    stop_str = probe[1].text[3:5]
    return [
        (TEXT[0], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_tok], ignore_eos=True)),
        (TEXT[1], SamplingParams(temperature=0, max_tokens=12, stop=[stop_str], ignore_eos=True)),
        (TEXT[2], SamplingParams(temperature=0, max_tokens=20)),  # may end on EOS
        (TEXT[3], SamplingParams(temperature=0.9, top_k=20, seed=7, max_tokens=15, n=2)),
        (TEXT[0], SamplingParams(temperature=0, max_tokens=6, min_tokens=5, stop_token_ids=[stop_tok])),
        (PROMPTS[3], SamplingParams(temperature=0, max_tokens=3, prompt_logits=True)),
        (PROMPTS[4], SamplingParams(temperature=1.0, seed=3, max_tokens=9, ignore_eos=True)),
        (TEXT[3], SamplingParams(temperature=0, max_tokens=1)),
    ]


def _run(path: str, overlap: bool, **kw) -> tuple[list, int]:
    llm = make_llm(path, disable_overlap_schedule=not overlap, max_num_batched_tokens=16, block_size=4, **kw)
    jobs = _workload(llm)
    outs = llm.generate([p for p, _ in jobs], [sp for _, sp in jobs])
    assert_kv_all_free(llm)
    preemptions = llm.kv_stats()["preemptions"]
    llm.close()
    return outs, preemptions


@pytest.mark.parametrize("kv_tokens", [4096, 96], ids=["roomy", "preempting"])
def test_overlap_gives_the_outputs_of_resolving_each_step(ckpt, kv_tokens: int) -> None:
    path = ckpt("text")
    want, _ = _run(path, overlap=False, max_total_tokens=kv_tokens)
    got, preemptions = _run(path, overlap=True, max_total_tokens=kv_tokens)
    assert (preemptions > 0) == (kv_tokens < 1000)
    assert any(c.finish_reason == "stop" for o in want for c in o.outputs), "no request stopped early"
    for g, w in zip(got, want, strict=True):
        assert [c.token_ids for c in g.outputs] == [c.token_ids for c in w.outputs]
        assert [(c.finish_reason, c.stop_reason, c.text) for c in g.outputs] == \
               [(c.finish_reason, c.stop_reason, c.text) for c in w.outputs]
        assert (g.prompt_logits is None) == (w.prompt_logits is None)
        if w.prompt_logits is not None:  # batches differ by the rows overlap runs a step late: rounding only
            torch.testing.assert_close(g.prompt_logits, w.prompt_logits, rtol=1e-4, atol=1e-5)


def test_overlap_keeps_one_step_in_flight(ckpt) -> None:
    """With overlap a step returns the tokens of the step before it, and the requests' newest token is still a
    placeholder on the host; without it every step is resolved before step() returns."""
    path = ckpt("base")
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for overlap in (True, False):
        llm = make_llm(path, disable_overlap_schedule=not overlap)
        rank = llm.engine.ranks.rank
        llm.add_request(PROMPTS[1], sp)
        first = llm.step()  # prefill, which samples the first token
        assert (first == []) is overlap
        assert (rank.inflight is not None) is overlap
        running = rank.scheduler.running[0]
        assert (running.output_token_ids[-1] == PLACEHOLDER) is overlap
        outs = run_to_completion(llm)
        assert len(next(iter(outs.values())).outputs[0].token_ids) == 4
        assert rank.inflight is None
        assert_kv_all_free(llm)
        llm.close()


def test_a_placeholder_never_reaches_the_model(ckpt) -> None:
    """A token the host does not have must come from the step that produces it: a step without it is refused."""
    llm = make_llm(ckpt("base"))
    rank = llm.engine.ranks.rank
    llm.add_request(PROMPTS[1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    llm.step()
    rank.inflight = None  # forget the step in flight: the next step has nowhere to take its token from
    with pytest.raises(RuntimeError, match="placeholder"):
        rank._forward_step()
    llm.close()
