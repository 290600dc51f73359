"""--logprobs-mode (vLLM's names) and the trainer-engine mismatch: a sampled token's log-probability from the engine
against transformers' forward over the same sequence (the trainer's computation), fp32 on CPU: raw_logprobs is
log_softmax(logits), processed_logprobs log_softmax(logits / T) with the top-k / top-p cut (-inf outside),
raw_logits / processed_logits the logits themselves; the mismatch stays below a stated bound in TP, EP and across
live switches."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from conftest import VOCAB, hf_logits, make_llm, shared_llm

from moebius import LLM, SamplingParams
from moebius.config import ConfigError

# fp32 engine vs fp32 transformers: the same math summed in another order (measured: ~1e-6 mean, ~5e-6 max)
FP32_BOUND = 1e-4


def _prompts(seed: int, lens: tuple[int, ...]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(n)] for n in lens]


def expected(path: str, prompt: list[int], tokens: list[int], mode: str, temperature: float, top_k: int
             ) -> torch.Tensor:
    """transformers' value of each output token under `mode` ([n] float32)."""
    logits = hf_logits(path, prompt + tokens[:-1])[len(prompt) - 1:]  # the rows that predicted each output token
    if mode.startswith("processed"):
        logits = logits / temperature
        if top_k > 0:
            kth = logits.topk(top_k, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
    values = logits if mode.endswith("_logits") else torch.log_softmax(logits, dim=-1)
    return values.gather(1, torch.tensor(tokens)[:, None]).squeeze(1)


def engine_values(out: Any) -> torch.Tensor:
    c = out.outputs[0]
    return torch.tensor([lp[t] for lp, t in zip(c.logprobs, c.token_ids, strict=True)])


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits"])
@pytest.mark.parametrize("top_k", [-1, 5])
def test_logprobs_mode_matches_transformers(ckpt: Any, mode: str, top_k: int) -> None:
    """temperature 0.5 (and top_k 5): each mode's value of the sampled token equals transformers' at that
    position; raw values do not depend on the temperature, processed ones do (and differ from raw)."""
    path = ckpt("base")
    llm = shared_llm(path, logprobs_mode=mode)
    prompts = _prompts(5, (4, 19))
    params = SamplingParams(temperature=0.5, top_k=top_k, seed=11, max_tokens=10, logprobs=2)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, o in zip(prompts, outs, strict=True):
        got = engine_values(o)
        want = expected(path, prompt, o.outputs[0].token_ids, mode, 0.5, top_k)
        torch.testing.assert_close(got, want, atol=FP32_BOUND, rtol=0)
        if mode.startswith("processed"):
            raw = expected(path, prompt, o.outputs[0].token_ids, mode.replace("processed", "raw"), 0.5, top_k)
            assert (got - raw).abs().max() > 1e-2, "processed values equal the raw ones"
        if mode.endswith("_logprobs"):  # the top ones too are log-probabilities of the same distribution
            assert all(v <= 1e-6 for lp in o.outputs[0].logprobs for v in lp.values())


def test_logprobs_mode_refuses_unknown_names(ckpt: Any) -> None:
    with pytest.raises(ConfigError, match="logprobs_mode='processed'"):
        make_llm(ckpt("base"), logprobs_mode="processed")


def mismatch(path: str, prompts: list[list[int]], outs: list[Any]) -> tuple[float, float]:
    """Mean and max |engine - transformers| over every sampled token's raw log-probability."""
    diffs = torch.cat([(engine_values(o) - expected(path, p, o.outputs[0].token_ids, "raw_logprobs", 1.0, -1)).abs()
                       for p, o in zip(prompts, outs, strict=True)])
    return float(diffs.mean()), float(diffs.max())


def test_mismatch_one_rank(ckpt: Any) -> None:
    path = ckpt("base")
    llm = shared_llm(path)
    prompts = _prompts(9, (3, 12, 30, 41))
    outs = llm.generate(prompts, SamplingParams(temperature=1.0, seed=2, max_tokens=12, logprobs=0), use_tqdm=False)
    mean, worst = mismatch(path, prompts, outs)
    print(f"trainer-engine mismatch, P=1 fp32: mean {mean:.2e}, max {worst:.2e}")
    assert worst < FP32_BOUND


@pytest.fixture(scope="module")
def p2(ckpt: Any) -> Iterator[LLM]:
    llm = make_llm(ckpt("tied_mha_nonorm"), num_ranks=2, mode="ep", block_size=4, max_total_tokens=1024,
                   max_running_requests=8, max_num_batched_tokens=16)
    yield llm
    llm.close()


@pytest.mark.slow
@pytest.mark.parametrize("switches", [(), (1, 3, 5, 8)], ids=["no_switch", "switches"])
@pytest.mark.parametrize("mode", ["tp", "ep"])
def test_mismatch_two_ranks(ckpt: Any, p2: LLM, mode: str, switches: tuple[int, ...]) -> None:
    """P = 2 in TP, in EP, and with live switches between steps while the requests run: the sampled tokens'
    log-probabilities stay within the fp32 bound of transformers'."""
    path = ckpt("tied_mha_nonorm")
    if p2.engine.mode != mode:
        assert p2.switch_mode(mode).done
    prompts = _prompts(13, (2, 9, 27, 35))
    params = SamplingParams(temperature=1.0, seed=4, max_tokens=12, logprobs=0)
    rids = [p2.add_request(p, params) for p in prompts]
    last: dict[str, Any] = {}
    step = 0
    while p2.has_unfinished():
        if step in switches:
            assert p2.switch_mode("tp" if p2.engine.mode == "ep" else "ep").done
        for o in p2.step():
            last[o.request_id] = o
        step += 1
    mean, worst = mismatch(path, prompts, [last[r] for r in rids])
    print(f"trainer-engine mismatch, P=2 {mode} switches={switches}: mean {mean:.2e}, max {worst:.2e}")
    assert worst < FP32_BOUND
