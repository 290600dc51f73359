"""Log-probabilities and min_p against the oracle: each output token's log-probability, and its top k, are
transformers' own log-softmax at that position; they are the same in TP (vocabulary split over ranks), EP and on one
rank; min_p = 1 leaves only the most likely token, min_p = 0 changes nothing."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import PROMPTS, hf_greedy, hf_logits, make_llm

from moebius.sampling_params import SamplingParams

GREEDY = dict(temperature=0.0, max_tokens=6, ignore_eos=True)


def oracle(path: str, prompt: list[int], tokens: list[int], k: int) -> list[dict[int, float]]:
    """transformers' log-probabilities of each output token and of its top k, at every output position."""
    lp = torch.log_softmax(hf_logits(path, prompt + tokens), dim=-1)
    out = []
    for j, t in enumerate(tokens):
        row = lp[len(prompt) - 1 + j]
        entry = {t: float(row[t])}
        values, ids = row.topk(k)
        for v, i in zip(values.tolist(), ids.tolist(), strict=True):
            entry.setdefault(i, v)
        out.append(entry)
    return out


def assert_close(got: list[dict[int, float]], want: list[dict[int, float]]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert list(g)[0] == list(w)[0]  # the token's own first
        assert set(g) == set(w), (g, w)
        for t in w:
            assert g[t] == pytest.approx(w[t], abs=2e-4), (t, g[t], w[t])


def test_logprobs_equal_the_oracle(ckpt: Any) -> None:
    path = ckpt("base")
    with make_llm(path) as llm:
        prompts = [list(PROMPTS[1]), list(PROMPTS[3])]
        outs = llm.generate(prompts, [SamplingParams(**GREEDY, logprobs=3), SamplingParams(**GREEDY, logprobs=0)])
        for prompt, out, k in zip(prompts, outs, (3, 0), strict=True):
            c = out.outputs[0]
            assert c.token_ids == hf_greedy(path, prompt, GREEDY["max_tokens"])
            assert_close(c.logprobs, oracle(path, prompt, c.token_ids, k))
        # a sampled request reports the model's distribution too (raw: before temperature and cuts)
        c = llm.generate(prompts[0], SamplingParams(temperature=0.9, seed=5, top_p=0.8, max_tokens=5, logprobs=2,
                                                    ignore_eos=True))[0].outputs[0]
        assert_close(c.logprobs, oracle(path, prompts[0], c.token_ids, 2))
        # a request that asks nothing gets nothing, in a batch with one that asks
        a, b = llm.generate(prompts, [SamplingParams(**GREEDY), SamplingParams(**GREEDY, logprobs=1)])
        assert a.outputs[0].logprobs is None and len(b.outputs[0].logprobs) == GREEDY["max_tokens"]


@pytest.mark.parametrize("mode", ["tp", "ep"])
def test_logprobs_and_min_p_on_two_ranks(ckpt: Any, mode: str) -> None:
    """TP holds a vocabulary slice of lm_head per rank: the log-probabilities need the whole vocabulary."""
    path = ckpt("tied_mha_nonorm")
    prompts = [list(PROMPTS[i]) for i in (0, 2, 4)]
    params = [SamplingParams(**GREEDY, logprobs=4), SamplingParams(temperature=0.7, seed=9, max_tokens=6, logprobs=1,
                                                                   ignore_eos=True),
              SamplingParams(temperature=1.5, seed=3, min_p=1.0, max_tokens=6, ignore_eos=True)]
    with make_llm(path) as one:
        want = one.generate(prompts, params)
    with make_llm(path, num_ranks=2, mode=mode) as two:
        got = two.generate(prompts, params)
    for g, w in zip(got, want, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
    for i in (0, 1):
        assert_close(got[i].outputs[0].logprobs, want[i].outputs[0].logprobs)
    # min_p = 1: only the most likely token survives the cut, so the sample is the greedy path
    assert got[2].outputs[0].token_ids == hf_greedy(path, prompts[2], 6)


def test_min_p_zero_changes_nothing(ckpt: Any) -> None:
    with make_llm(ckpt("base")) as llm:
        sp = dict(temperature=0.9, seed=11, max_tokens=8, ignore_eos=True)
        a = llm.generate(list(PROMPTS[2]), SamplingParams(**sp))[0].token_ids
        b = llm.generate(list(PROMPTS[2]), SamplingParams(**sp, min_p=0.0))[0].token_ids
        assert a == b
