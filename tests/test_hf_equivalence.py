"""The engine computes what transformers computes: prompt logits and greedy continuations, for every architecture
variant, several KV block sizes (prompts crossing block boundaries), batches of mixed lengths, chunked prefill and
sharded checkpoints."""

from __future__ import annotations

import glob
import json
import os

import pytest
import torch
from conftest import (
    MIN_MARGIN,
    PROMPTS,
    VARIANTS,
    VOCAB,
    hf_greedy,
    hf_greedy_min_margin,
    hf_logits,
    hf_model,
    rel_err,
    shared_llm,
)

from moebius.sampling_params import SamplingParams

N_OUT = 32
LOGITS_RTOL = 1e-4
GREEDY = SamplingParams(temperature=0, max_tokens=N_OUT, ignore_eos=True)
PROMPT_LOGITS = SamplingParams(max_tokens=1, prompt_logits=True, temperature=0)

# (variant, block_size): every variant with a small and the default block size, plus one-token blocks.
CASES = [(v, bs) for v in VARIANTS for bs in (4, 16)] + [("base", 1)]
CASE_IDS = [f"{v}-bs{bs}" for v, bs in CASES]
# (variant, block_size) run with max_num_batched_tokens=8: prompts are prefilled in chunks of at most 8 tokens.
CHUNKED_CASES = [(v, 4) for v in VARIANTS] + [("base", 16)]
CHUNKED_IDS = [f"{v}-bs{bs}" for v, bs in CHUNKED_CASES]


def _check_prompt_logits(outs, path: str, prompts: list[list[int]]) -> None:
    assert len(outs) == len(prompts)
    for out, prompt in zip(outs, prompts, strict=True):
        assert out.prompt_token_ids == prompt
        got = out.prompt_logits
        assert isinstance(got, torch.Tensor), "prompt_logits=True must return a tensor"
        assert got.dtype == torch.float32
        assert tuple(got.shape) == (len(prompt), VOCAB)
        ref = hf_logits(path, prompt)
        err = rel_err(got.cpu(), ref)
        assert err <= LOGITS_RTOL, f"prompt of {len(prompt)} tokens: relative logits error {err:.2e}"
        # The one sampled token is the greedy continuation.
        assert out.token_ids == hf_greedy(path, prompt, 1)


def _check_greedy(outs, path: str, prompts: list[list[int]], n: int = N_OUT) -> None:
    assert len(outs) == len(prompts)
    for i, (out, prompt) in enumerate(zip(outs, prompts, strict=True)):
        assert out.prompt_token_ids == prompt, f"output {i} is not in input order"
        assert out.num_prompt_tokens == len(prompt)
        ref = hf_greedy(path, prompt, n)
        assert out.token_ids == ref, f"prompt {i} ({len(prompt)} tokens): greedy tokens differ from transformers"
        assert out.finish_reason == "length"
        assert out.num_output_tokens == n
        assert out.finished


def test_oracle_is_well_conditioned(ckpt):
    """The transformers reference itself is deterministic and its greedy choices are far from ties."""
    for name in VARIANTS:
        path = ckpt(name)
        for prompt in PROMPTS:
            first = hf_greedy(path, prompt, N_OUT + 1)
            assert hf_greedy_min_margin(path, prompt, N_OUT + 1) > MIN_MARGIN
            assert len(set(first)) > 4, "degenerate model: greedy output repeats one token"
        # Recomputed from scratch (not from the oracle's cache): the same tokens.
        prompt, seq = PROMPTS[-1], list(PROMPTS[-1])
        with torch.no_grad():
            model = hf_model(path)
            for _ in range(N_OUT):
                seq.append(int(model(input_ids=torch.tensor([seq]), use_cache=False).logits[0, -1].argmax()))
        assert seq[len(prompt):] == hf_greedy(path, prompt, N_OUT)


@pytest.mark.parametrize("variant,block_size", CASES, ids=CASE_IDS)
def test_prefill_logits(ckpt, variant, block_size):
    path = ckpt(variant)
    llm = shared_llm(path, block_size=block_size)
    outs = llm.generate(PROMPTS, PROMPT_LOGITS)
    _check_prompt_logits(outs, path, PROMPTS)


@pytest.mark.parametrize("variant,block_size", CASES, ids=CASE_IDS)
def test_greedy_single_request(ckpt, variant, block_size):
    path = ckpt(variant)
    llm = shared_llm(path, block_size=block_size)
    prompt = PROMPTS[2]  # 17 tokens: crosses a 16-token block boundary during prefill
    outs = llm.generate(prompt, GREEDY)  # one token-id prompt (list[int])
    assert len(outs) == 1
    _check_greedy(outs, path, [prompt])


@pytest.mark.parametrize("variant,block_size", CASES, ids=CASE_IDS)
def test_greedy_batch(ckpt, variant, block_size):
    path = ckpt(variant)
    llm = shared_llm(path, block_size=block_size)
    outs = llm.generate(PROMPTS, GREEDY)  # lengths 1, 5, 17, 33, 40 in one call
    _check_greedy(outs, path, PROMPTS)
    assert not llm.has_unfinished()


@pytest.mark.parametrize("variant,block_size", CHUNKED_CASES, ids=CHUNKED_IDS)
def test_chunked_prefill(ckpt, variant, block_size):
    path = ckpt(variant)
    llm = shared_llm(path, block_size=block_size, max_num_batched_tokens=8)
    _check_greedy(llm.generate(PROMPTS, GREEDY), path, PROMPTS)
    # Prompt logits assembled from several chunks (the 33- and 40-token prompts take 5 steps).
    _check_prompt_logits(llm.generate(PROMPTS[3:], PROMPT_LOGITS), path, PROMPTS[3:])


def test_mixed_sampling_params_in_one_batch(ckpt):
    """A list of SamplingParams, one per prompt: requests finish at different steps of one batch."""
    path = ckpt("base")
    llm = shared_llm(path, block_size=4)
    max_tokens = [32, 7, 20, 1, 33]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    params[3] = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, prompt_logits=True)
    outs = llm.generate(PROMPTS, params)
    for out, prompt, m in zip(outs, PROMPTS, max_tokens, strict=True):
        assert out.prompt_token_ids == prompt
        assert out.token_ids == hf_greedy(path, prompt, N_OUT + 1)[:m]
        assert out.finish_reason == "length"
    assert rel_err(outs[3].prompt_logits, hf_logits(path, PROMPTS[3])) <= LOGITS_RTOL
    assert outs[0].prompt_logits is None  # only where asked for


def test_batching_does_not_change_greedy_tokens(ckpt):
    """Same request alone and in a batch: identical tokens (batching does not change greedy results)."""
    path = ckpt("base")
    llm = shared_llm(path, block_size=4)
    alone = [llm.generate([p], GREEDY)[0].token_ids for p in PROMPTS[:3]]
    together = [o.token_ids for o in llm.generate(PROMPTS[:3], GREEDY)]
    assert alone == together


def test_sharded_checkpoint(ckpt):
    path = ckpt("base_sharded")
    index = os.path.join(path, "model.safetensors.index.json")
    assert os.path.isfile(index)
    shards = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    assert len(shards) > 2
    with open(index) as f:
        assert len(set(json.load(f)["weight_map"].values())) == len(shards)
    llm = shared_llm(path, block_size=4)
    _check_prompt_logits(llm.generate(PROMPTS, PROMPT_LOGITS), path, PROMPTS)
    _check_greedy(llm.generate(PROMPTS, GREEDY), path, PROMPTS)
    # Same weights as the single-file "base" checkpoint.
    base = ckpt("base")
    assert hf_greedy(base, PROMPTS[4], N_OUT) == hf_greedy(path, PROMPTS[4], N_OUT)
