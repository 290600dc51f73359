"""Scheduling and request life cycle: preemption under a tiny KV pool, aborts, stop conditions, seeded sampling,
n > 1, the running-request cap and online (add_request/step) batching, checked against transformers."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import (
    ENDOFTEXT_ID,
    PRINTABLE,
    PROMPTS,
    TEXT_PROMPTS,
    VOCAB,
    assert_kv_all_free,
    decode_bytes,
    hf_greedy,
    hf_logits,
    make_llm,
    run_to_completion,
    set_eos,
    shared_llm,
)

from moebius.memory.kv_pool import BlockAllocator, OutOfPages
from moebius.outputs import RequestOutput
from moebius.sampling_params import SamplingParams

_rng = random.Random(7)
# Six requests of 33..44 tokens each (prompt + 32 outputs), i.e. 9..11 blocks of 4 tokens.
SCHED_PROMPTS: list[list[int]] = [[_rng.randrange(VOCAB) for _ in range(n)] for n in (8, 3, 12, 1, 6, 9)]
N_OUT = 32


def greedy(max_tokens: int = N_OUT, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def _first_new_token_at_or_after(tokens: list[int], start: int) -> int:
    """Index of the first token at position >= start that does not occur earlier in the sequence."""
    return next(i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i])


def _expected_with_stop_ids(path: str, prompt: list[int], stop_ids: list[int], min_tokens: int,
                            max_tokens: int) -> tuple[list[int], str]:
    """vLLM semantics: stop ids (EOS and stop_token_ids) are masked out before min_tokens outputs, the output ends
    with (and includes) the first stop id after that, else after max_tokens."""
    toks = hf_greedy(path, prompt, max_tokens, banned=stop_ids, banned_until=min_tokens)
    assert not set(toks[:min_tokens]) & set(stop_ids)
    for i in range(min_tokens, max_tokens):
        if toks[i] in stop_ids:
            return toks[:i + 1], "stop"
    return toks, "length"


def _collect(result, last: dict) -> None:
    """Record RequestOutputs returned by abort()/step() (a single one, a list, or None)."""
    if result is None:
        return
    for out in [result] if isinstance(result, RequestOutput) else result:
        last[out.request_id] = out


def _drain(llm, last: dict) -> dict:
    """Run to completion, then one more step so that late abort reports are seen too."""
    for rid, out in run_to_completion(llm).items():
        last[rid] = out
    _collect(llm.step(), last)
    assert not llm.has_unfinished()
    return last


# ---------------------------------------------------------------------------------------------------------------
# Preemption, running-request cap, online batching
# ---------------------------------------------------------------------------------------------------------------

def test_preemption_with_tiny_kv_pool(ckpt):
    """64 KV tokens (16 blocks of 4) for 6 requests of ~40 tokens: all complete, identical to an unconstrained
    run and to transformers."""
    path = ckpt("base")
    llm = make_llm(path, block_size=4, max_total_tokens=64)
    stats = llm.kv_stats()
    assert 44 <= stats["total_tokens"] <= 64
    assert stats["free_tokens"] == stats["total_tokens"]
    outs = llm.generate(SCHED_PROMPTS, greedy())
    free = shared_llm(path, block_size=4).generate(SCHED_PROMPTS, greedy())
    for out, ref, prompt in zip(outs, free, SCHED_PROMPTS, strict=True):
        assert out.token_ids == ref.token_ids == hf_greedy(path, prompt, N_OUT)
        assert out.finish_reason == "length"
    assert_kv_all_free(llm)
    assert llm.kv_stats()["preemptions"] > 0  # the engine reports them (metrics: moebius:num_preemptions)


def test_preemption_step_by_step_keeps_kv_accounting(ckpt):
    path = ckpt("base")
    llm = make_llm(path, block_size=4, max_total_tokens=64)
    total = llm.kv_stats()["total_tokens"]
    rids = [llm.add_request(p, greedy()) for p in SCHED_PROMPTS]
    assert len(set(rids)) == len(rids)
    last: dict = {}
    for _ in range(2000):
        if not llm.has_unfinished():
            break
        _collect(llm.step(), last)
        stats = llm.kv_stats()
        assert stats["total_tokens"] == total
        assert 0 <= stats["free_tokens"] <= total
    assert not llm.has_unfinished()
    for rid, prompt in zip(rids, SCHED_PROMPTS, strict=True):
        assert last[rid].finished
        assert last[rid].token_ids == hf_greedy(path, prompt, N_OUT)
    assert_kv_all_free(llm)


def test_seeded_sampling_survives_preemption(ckpt):
    path = ckpt("base")
    params = [SamplingParams(temperature=1.0, seed=100 + i, max_tokens=N_OUT, ignore_eos=True)
              for i in range(len(SCHED_PROMPTS))]
    tight = make_llm(path, block_size=4, max_total_tokens=64).generate(SCHED_PROMPTS, params)
    roomy = shared_llm(path, block_size=4).generate(SCHED_PROMPTS, params)
    assert [o.token_ids for o in tight] == [o.token_ids for o in roomy]
    assert all(len(o.token_ids) == N_OUT for o in tight)


def test_max_running_requests(ckpt):
    path = ckpt("base")
    llm = shared_llm(path, block_size=4, max_running_requests=2)
    outs = llm.generate(SCHED_PROMPTS, greedy())
    for out, prompt in zip(outs, SCHED_PROMPTS, strict=True):
        assert out.token_ids == hf_greedy(path, prompt, N_OUT)
        assert out.finish_reason == "length"
    assert_kv_all_free(llm)


def test_online_batching_with_add_request_and_step(ckpt):
    """Requests joining a running batch at different steps; streamed outputs grow by prefixes."""
    path = ckpt("base")
    llm = make_llm(path, block_size=4, max_num_batched_tokens=16)
    seen: dict[str, list[list[int]]] = {}
    last: dict = {}
    prompts = {}

    def step():
        for out in llm.step():
            assert not (last.get(out.request_id) and last[out.request_id].finished), "output after finishing"
            seen.setdefault(out.request_id, []).append(list(out.token_ids))
            last[out.request_id] = out

    for i, prompt in enumerate(PROMPTS):
        rid = llm.add_request(prompt, greedy(), request_id=f"req-{i}")
        assert rid == f"req-{i}"
        prompts[rid] = prompt
        for _ in range(i + 2):
            step()
    while llm.has_unfinished():
        step()
    for rid, prompt in prompts.items():
        ref = hf_greedy(path, prompt, N_OUT)
        assert last[rid].finished and last[rid].finish_reason == "length"
        assert last[rid].token_ids == ref
        for partial in seen[rid]:  # "token ids so far": always a prefix of the final output
            assert partial == ref[:len(partial)]
        lens = [len(p) for p in seen[rid]]
        assert lens == sorted(lens)
    assert_kv_all_free(llm)


# ---------------------------------------------------------------------------------------------------------------
# Abort
# ---------------------------------------------------------------------------------------------------------------

def test_abort_at_various_times(ckpt):
    path = ckpt("base")
    llm = make_llm(path, block_size=4, max_num_batched_tokens=8)
    last: dict = {}
    long_prompt, short, mid, late = PROMPTS[4], PROMPTS[1], PROMPTS[2], PROMPTS[3]
    r_prefill = llm.add_request(long_prompt, greedy())  # 40 tokens: 5+ chunked-prefill steps
    r_decode = llm.add_request(short, greedy())
    r_waiting = llm.add_request(mid, greedy())
    _collect(llm.abort(r_waiting), last)  # aborted before it was ever scheduled
    _collect(llm.step(), last)
    _collect(llm.abort(r_prefill), last)  # aborted in the middle of its chunked prefill
    for _ in range(200):
        _collect(llm.step(), last)
        if r_decode in last and len(last[r_decode].token_ids) >= 5:
            break
    r_late = llm.add_request(late, greedy())
    _collect(llm.step(), last)
    _collect(llm.step(), last)
    _collect(llm.abort(r_decode), last)  # aborted while decoding
    _drain(llm, last)

    for rid in (r_prefill, r_decode, r_waiting):
        assert rid in last, f"aborted request {rid} was never reported"
        assert last[rid].finished
        assert last[rid].finish_reason == "abort"
    assert len(last[r_decode].token_ids) >= 5
    assert last[r_decode].token_ids == hf_greedy(path, short, N_OUT)[:len(last[r_decode].token_ids)]
    assert last[r_late].finish_reason == "length"
    assert last[r_late].token_ids == hf_greedy(path, late, N_OUT)
    assert_kv_all_free(llm)
    # The engine still works normally afterwards.
    assert llm.generate(mid, greedy())[0].token_ids == hf_greedy(path, mid, N_OUT)
    assert_kv_all_free(llm)


def test_abort_everything_under_preemption(ckpt):
    path = ckpt("base")
    llm = make_llm(path, block_size=4, max_total_tokens=64)
    last: dict = {}
    rids = [llm.add_request(p, greedy()) for p in SCHED_PROMPTS]
    for _ in range(12):
        _collect(llm.step(), last)
    for rid in rids:
        _collect(llm.abort(rid), last)
    _drain(llm, last)
    # 12 steps are too few to produce 32 tokens: every request was still running when aborted.
    assert [last[rid].finish_reason for rid in rids] == ["abort"] * len(rids)
    assert_kv_all_free(llm)
    outs = llm.generate(SCHED_PROMPTS[:2], greedy())
    assert [o.token_ids for o in outs] == [hf_greedy(path, p, N_OUT) for p in SCHED_PROMPTS[:2]]
    assert_kv_all_free(llm)


# ---------------------------------------------------------------------------------------------------------------
# Stop conditions
# ---------------------------------------------------------------------------------------------------------------

def _text_reference(path: str, llm, prompt: str) -> tuple[list[int], list[int], str]:
    """(prompt ids, greedy ids, greedy text) of a text prompt, checked against transformers."""
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=N_OUT))[0]
    ids = out.prompt_token_ids
    assert ids == list(prompt.encode()), "byte tokenizer: one id per byte"
    ref = hf_greedy(path, ids, N_OUT)
    # Preconditions of the stop-string tests: no EOS and one printable character per token.
    assert ENDOFTEXT_ID not in ref and all(t in PRINTABLE for t in ref)
    assert out.token_ids == ref
    assert out.finish_reason == "length"
    assert out.text == decode_bytes(ref)
    return ids, ref, decode_bytes(ref)


def _pick_stop(text: str, start: int = 5) -> tuple[str, int]:
    """A 2-character stop string (spanning two tokens) whose first occurrence is at index k >= start."""
    k = next(k for k in range(start, len(text) - 2) if text.find(text[k:k + 2]) == k)
    return text[k:k + 2], k


def test_stop_strings(ckpt):
    path = ckpt("text")
    llm = shared_llm(path, block_size=4)
    refs = [_text_reference(path, llm, p) for p in TEXT_PROMPTS]
    stops = [_pick_stop(text, start=3 + 2 * i) for i, (_, _, text) in enumerate(refs)]
    params = [SamplingParams(temperature=0, max_tokens=N_OUT, stop=s) for s, _ in stops]
    params[1] = SamplingParams(temperature=0, max_tokens=N_OUT, stop=[stops[1][0]], include_stop_str_in_output=True)
    params[2] = SamplingParams(temperature=0, max_tokens=N_OUT, stop=["\u2603 never", stops[2][0]])
    outs = llm.generate(TEXT_PROMPTS, params)  # all in one batch, each with its own stop string
    for i, (out, (_, ref, text), (stop, k)) in enumerate(zip(outs, refs, stops, strict=True)):
        assert out.finish_reason == "stop", f"prompt {i}: stop string {stop!r} did not fire"
        assert out.outputs[0].stop_reason == stop
        expected = text[:k + len(stop)] if i == 1 else text[:k]
        assert out.text == expected
        n = len(out.token_ids)
        assert k <= n <= k + len(stop) and out.token_ids == ref[:n]
    assert_kv_all_free(llm)


def test_stop_string_not_matched_in_prompt_or_absent(ckpt):
    path = ckpt("text")
    llm = shared_llm(path, block_size=4)
    prompt = TEXT_PROMPTS[0]
    _, ref, text = _text_reference(path, llm, prompt)
    assert "quick" not in text
    for stop in ["quick", "\u2603\u2603"]:  # occurs only in the prompt / nowhere
        out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=N_OUT, stop=stop))[0]
        assert out.finish_reason == "length"
        assert out.token_ids == ref and out.text == text


def test_stop_token_ids(ckpt):
    path = ckpt("base")
    llm = shared_llm(path, block_size=4)
    prompt = PROMPTS[3]
    ref = hf_greedy(path, prompt, N_OUT)
    p = _first_new_token_at_or_after(ref, 6)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=N_OUT, stop_token_ids=[ref[p]]))[0]
    assert out.token_ids == ref[:p + 1]  # the stop token is part of the output ids
    assert out.finish_reason == "stop"
    assert out.outputs[0].stop_reason == ref[p]
    # ignore_eos does not disable stop_token_ids.
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=N_OUT, stop_token_ids=[ref[p]],
                                              ignore_eos=True))[0]
    assert out.token_ids == ref[:p + 1] and out.finish_reason == "stop"


def test_min_tokens_masks_stop_token_ids(ckpt):
    path = ckpt("base")
    llm = shared_llm(path, block_size=4)
    prompt = PROMPTS[3]
    ref = hf_greedy(path, prompt, N_OUT)
    p = _first_new_token_at_or_after(ref, 6)
    stop = [ref[p]]
    min_tokens = p + 3
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=N_OUT, stop_token_ids=stop,
                                              min_tokens=min_tokens))[0]
    expected, reason = _expected_with_stop_ids(path, prompt, stop, min_tokens, N_OUT)
    assert len(out.token_ids) >= min_tokens
    assert ref[p] not in out.token_ids[:min_tokens]
    assert out.token_ids == expected
    assert out.finish_reason == reason


@pytest.fixture(scope="module")
def eos_ckpt(ckpt):
    """The base weights with config/generation_config eos_token_id set to a token greedy decoding emits at
    output position p of PROMPTS[2] (and not before)."""
    base = ckpt("base")
    ref = hf_greedy(base, PROMPTS[2], N_OUT)
    p = _first_new_token_at_or_after(ref, 4)
    path = ckpt.copy("base", "base_eos")
    set_eos(path, ref[p])
    return path, ref, p


def test_eos_stops_and_ignore_eos(ckpt, eos_ckpt):
    path, ref, p = eos_ckpt
    llm = make_llm(path, block_size=4)
    prompt = PROMPTS[2]
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=N_OUT))[0]
    assert out.token_ids == ref[:p + 1]  # EOS is the last output id
    assert out.finish_reason == "stop"
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=N_OUT, ignore_eos=True))[0]
    assert out.token_ids == ref
    assert out.finish_reason == "length"
    # min_tokens: EOS cannot be generated before min_tokens outputs.
    min_tokens = p + 3
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=N_OUT, min_tokens=min_tokens))[0]
    expected, reason = _expected_with_stop_ids(ckpt("base"), prompt, [ref[p]], min_tokens, N_OUT)
    assert out.token_ids == expected and out.finish_reason == reason
    assert_kv_all_free(llm)


def test_max_tokens_gives_length_and_timings(ckpt):
    path = ckpt("base")
    llm = shared_llm(path, block_size=4)
    for m in (1, 5):
        out = llm.generate(PROMPTS[1], greedy(m))[0]
        assert out.finish_reason == "length"
        assert len(out.token_ids) == m and out.num_output_tokens == m
        assert out.token_ids == hf_greedy(path, PROMPTS[1], m)
        assert out.ttft is not None and out.ttft >= 0
        assert len(out.token_latencies) == m - 1 and all(t >= 0 for t in out.token_latencies)


def test_max_tokens_none_runs_to_max_model_len(ckpt):
    path = ckpt("base")
    llm = shared_llm(path, block_size=4, max_model_len=48)
    prompt = SCHED_PROMPTS[0]  # 8 tokens
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))[0]
    assert out.finish_reason == "length"
    assert out.token_ids == hf_greedy(path, prompt, 48 - len(prompt))


# ---------------------------------------------------------------------------------------------------------------
# Sampling
# ---------------------------------------------------------------------------------------------------------------

SAMPLING_VARIANTS = [
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=5),
    dict(temperature=1.3, top_p=0.8),
    dict(temperature=1.0, top_k=20, top_p=0.9),
]


@pytest.mark.parametrize("kw", SAMPLING_VARIANTS, ids=lambda kw: "-".join(f"{k}{v}" for k, v in kw.items()))
def test_seeded_sampling_is_reproducible_and_batch_independent(ckpt, kw):
    path = ckpt("base")
    llm = shared_llm(path, block_size=4)
    prompt = PROMPTS[2]
    sp = SamplingParams(seed=1234, max_tokens=24, ignore_eos=True, **kw)
    a = llm.generate(prompt, sp)[0].token_ids
    b = llm.generate(prompt, sp)[0].token_ids
    assert a == b and len(a) == 24
    others = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=99, max_tokens=10, ignore_eos=True)]
    batched = llm.generate([PROMPTS[4], prompt, PROMPTS[0]], [others[0], sp, others[1]])
    assert batched[1].token_ids == a
    batched = llm.generate([prompt, PROMPTS[3]], [sp, others[1]])
    assert batched[0].token_ids == a
    # Every sampled token is allowed by top-k / top-p of the reference distribution.
    logits = hf_logits(path, prompt + a)[len(prompt) - 1:-1] / kw["temperature"]
    for j, tok in enumerate(a):
        row = logits[j]
        if "top_k" in kw:
            assert int((row > row[tok] + 1e-4).sum()) < kw["top_k"], f"token {j} outside the top-{kw['top_k']}"
        if "top_p" in kw:
            probs = torch.softmax(row, dim=-1)
            assert float(probs[probs > probs[tok] + 1e-6].sum()) < kw["top_p"] + 1e-4, f"token {j} outside top-p"


def test_different_seeds_give_different_samples(ckpt):
    path = ckpt("base")
    llm = shared_llm(path, block_size=4)
    prompt = PROMPTS[2]
    outs = llm.generate([prompt] * 4, [SamplingParams(temperature=1.0, seed=s, max_tokens=24, ignore_eos=True)
                                       for s in (1, 2, 3, 4)])
    samples = [tuple(o.token_ids) for o in outs]
    assert len(set(samples)) >= 3
    assert samples[0] != samples[1]
    assert tuple(hf_greedy(path, prompt, 24)) not in samples[:2]


def test_degenerate_top_k_and_top_p_are_greedy(ckpt):
    path = ckpt("base")
    llm = shared_llm(path, block_size=4)
    ref = hf_greedy(path, PROMPTS[2], 24)
    for kw in (dict(top_k=1), dict(top_p=1e-6)):
        out = llm.generate(PROMPTS[2], SamplingParams(temperature=1.5, seed=5, max_tokens=24, ignore_eos=True,
                                                      **kw))[0]
        assert out.token_ids == ref, kw


def test_n_samples(ckpt):
    path = ckpt("base")
    llm = shared_llm(path, block_size=4)
    sp = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=16, ignore_eos=True)
    outs = llm.generate([PROMPTS[2], PROMPTS[1]], sp)
    assert len(outs) == 2
    for out in outs:
        assert len(out.outputs) == 3
        assert sorted(c.index for c in out.outputs) == [0, 1, 2]
        assert all(len(c.token_ids) == 16 and c.finish_reason == "length" for c in out.outputs)
        assert len({tuple(c.token_ids) for c in out.outputs}) >= 2, "n samples should differ"
        assert out.num_output_tokens == 48
        assert out.finished
    again = llm.generate(PROMPTS[2], sp)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in outs[0].outputs]
    assert_kv_all_free(llm)


def test_block_allocator_hands_out_lowest_ids_first_and_reuses_given_back_pages_last_in_first_out() -> None:
    alloc = BlockAllocator(num_pages=10, block_size=16)
    assert alloc.num_free == alloc.usable_pages == 9  # page 0 is the scratch page, never handed out
    assert alloc.allocate(3) == [1, 2, 3]
    b = alloc.allocate(2)
    assert b == [4, 5] and alloc.num_free == 4
    alloc.free([1, 2])
    assert alloc.num_free == 6
    # pages given back come first (the last given back first), then the never-used ids from the lowest
    assert alloc.allocate(4) == [1, 2, 6, 7]
    with pytest.raises(OutOfPages, match="asked for 3 KV pages, 2 free"):
        alloc.allocate(3)
    with pytest.raises(RuntimeError, match="KV page 6 freed twice"):
        alloc.free([6, 6])
    assert alloc.num_free == 2  # the bad call changed nothing
    alloc.free([3, 4, 5, 6, 7, 1, 2])
    assert sorted(alloc.allocate(alloc.num_free)) == list(range(1, 10))
    assert alloc.num_free == 0
