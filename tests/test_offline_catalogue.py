"""The offline API held to the server's standard (issue 42): every bad input to `SamplingParams`, `LLM.generate`,
`add_request`, `chat`, the engine options and a closed `LLM` is answered with a clear error naming the bad field or
value, and the same engine then serves the same good request with the same tokens; a request that fails inside a
step ends with finish_reason "error" while the engine serves on; prompt + max_tokens beyond the context is refused
with the numbers (offline and over HTTP); a closed LLM says so on one rank as on two; an operator's switch is the
engine's last_switch."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from conftest import PROMPTS, assert_kv_all_free, hf_greedy, make_llm, run_to_completion, shared_llm

from moebius import LLM, RequestOutputKind, SamplingParams
from moebius.config import ConfigError
from moebius.frontend.core import EngineClosedError
from moebius.frontend.output_processor import Sample
from moebius.worker import runner

MAX_MODEL_LEN = 64
GOOD = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
SEEDED = [SamplingParams(temperature=0.9, seed=s, max_tokens=8, ignore_eos=True) for s in (11, 12)]
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def llm(ckpt: Any) -> LLM:
    """The text checkpoint (a tokenizer, no chat template) with a short context, shared with test_bad_inputs."""
    return shared_llm(ckpt("text"), block_size=4, max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def before(ckpt: Any, llm: LLM) -> list[list[int]]:
    """The good requests' tokens before any bad input reached the engine (greedy: transformers' too)."""
    outs = llm.generate([PROMPTS[1], PROMPTS[2]], GOOD)
    want = [hf_greedy(ckpt("text"), p, 8) for p in (PROMPTS[1], PROMPTS[2])]
    assert [o.token_ids for o in outs] == want
    return want


def serves_as_before(llm: LLM, before: list[list[int]]) -> None:
    assert not llm.has_unfinished()
    assert_kv_all_free(llm)
    assert [o.token_ids for o in llm.generate([PROMPTS[1], PROMPTS[2]], GOOD)] == before
    assert_kv_all_free(llm)


@pytest.fixture(scope="module")
def demo() -> Iterator[LLM]:
    """The built-in demo model on one rank in this process (it has a chat template); closed at the end."""
    with LLM(device="cpu", max_model_len=256) as engine:
        yield engine


@pytest.fixture(scope="module")
def closed(demo: LLM) -> LLM:
    demo.close()
    return demo


# ---- the catalogue: (what is called, the exception, a pattern naming the bad field or value) ----
Call = Callable[[LLM], object]


def _sp(**kw: Any) -> Call:
    return lambda _: SamplingParams(**kw)


def _assign(field: str, value: Any) -> Call:
    def call(_: LLM) -> None:
        sp = SamplingParams(max_tokens=8)
        was = repr(sp)
        try:
            setattr(sp, field, value)
        finally:
            assert repr(sp) == was, "a refused assignment changed the object"
    return call


def _gen(prompts: Any, params: Any = GOOD, **kw: Any) -> Call:
    return lambda llm: llm.generate(prompts, params, **kw)


def _add(prompt: Any, params: Any = GOOD, **kw: Any) -> Call:
    return lambda llm: llm.add_request(prompt, params, **kw)


def _chat(messages: Any) -> Call:
    return lambda llm: llm.chat(messages, GOOD)


def _twice(first: str, params: SamplingParams, second: str) -> Call:
    """add_request with id `first`, then with id `second`, which must fail; the first is aborted either way."""
    def call(llm: LLM) -> None:
        rid = llm.add_request(PROMPTS[1], params, first)
        try:
            llm.add_request(PROMPTS[1], GOOD, second)
        finally:
            llm.abort(rid)
            run_to_completion(llm)
    return call


def _mutated_in_place(llm: LLM) -> None:
    sp = SamplingParams(max_tokens=8, stop_token_ids=[5])
    sp.stop_token_ids.append(-3)  # bypasses __setattr__: the copy the engine admits is checked again
    llm.generate(PROMPTS[1], sp)


def _engine(**kw: Any) -> Callable[[Any], Call]:
    return lambda path: (lambda _: make_llm(path, **kw))


LONG = [i % 256 for i in range(MAX_MODEL_LEN + 1)]
FORTY = [i % 256 for i in range(40)]
V = 300  # the checkpoints' vocabulary (conftest.VOCAB)

CATALOGUE: list[Any] = [
    # SamplingParams(...)
    pytest.param(_sp(n=0), ValueError, r"n must be an integer >= 1, got 0", id="sp-n-0"),
    pytest.param(_sp(n=True), ValueError, r"n must .* got True", id="sp-n-bool"),
    pytest.param(_sp(n=2.0), ValueError, r"n must .* got 2\.0", id="sp-n-float"),
    pytest.param(_sp(temperature=-1), ValueError, r"temperature .*>= 0, got -1", id="sp-temperature-negative"),
    pytest.param(_sp(temperature=float("nan")), ValueError, r"temperature .* got nan", id="sp-temperature-nan"),
    pytest.param(_sp(temperature=float("inf")), ValueError, r"temperature .* got inf", id="sp-temperature-inf"),
    pytest.param(_sp(temperature="1"), ValueError, r"temperature .* got '1'", id="sp-temperature-str"),
    pytest.param(_sp(top_p=0), ValueError, r"top_p .*\(0, 1\], got 0", id="sp-top_p-0"),
    pytest.param(_sp(top_p=1.01), ValueError, r"top_p .* got 1\.01", id="sp-top_p-above-1"),
    pytest.param(_sp(top_p=None), ValueError, r"top_p .* got None", id="sp-top_p-none"),
    pytest.param(_sp(top_k=-2), ValueError, r"top_k must be -1 .* got -2", id="sp-top_k-negative"),
    pytest.param(_sp(top_k=2.5), ValueError, r"top_k .* got 2\.5", id="sp-top_k-float"),
    pytest.param(_sp(min_p=-0.1), ValueError, r"min_p .*\[0, 1\], got -0\.1", id="sp-min_p-negative"),
    pytest.param(_sp(min_p=1.5), ValueError, r"min_p .* got 1\.5", id="sp-min_p-above-1"),
    pytest.param(_sp(seed=2**70), ValueError, r"seed must be an integer in \[-2\*\*63, 2\*\*63 - 1\].* got "
                 + str(2**70), id="sp-seed-beyond-int64"),
    pytest.param(_sp(seed=-(2**63) - 1), ValueError, r"seed .*int64.* got -9223372036854775809",
                 id="sp-seed-below-int64"),
    pytest.param(_sp(seed="42"), ValueError, r"seed .* got '42'", id="sp-seed-str"),
    pytest.param(_sp(seed=1.5), ValueError, r"seed .* got 1\.5", id="sp-seed-float"),
    pytest.param(_sp(max_tokens=0), ValueError, r"max_tokens must be an integer >= 1, got 0", id="sp-max_tokens-0"),
    pytest.param(_sp(max_tokens=-1), ValueError, r"max_tokens .* got -1", id="sp-max_tokens-negative"),
    pytest.param(_sp(max_tokens=8.0), ValueError, r"max_tokens .* got 8\.0", id="sp-max_tokens-float"),
    pytest.param(_sp(max_tokens="8"), ValueError, r"max_tokens .* got '8'", id="sp-max_tokens-str"),
    pytest.param(_sp(min_tokens=-1), ValueError, r"min_tokens .* got -1", id="sp-min_tokens-negative"),
    pytest.param(_sp(min_tokens=9, max_tokens=8), ValueError, r"min_tokens 9 is larger than max_tokens 8",
                 id="sp-min_tokens-above-max"),
    pytest.param(_sp(stop=123), ValueError, r"stop must be a string or a list of strings, got 123", id="sp-stop-int"),
    pytest.param(_sp(stop=[""]), ValueError, r"stop strings must be non-empty strings, got \[''\]",
                 id="sp-stop-empty-string"),
    pytest.param(_sp(stop=["a", None]), ValueError, r"stop strings .* got \['a', None\]", id="sp-stop-none-inside"),
    pytest.param(_sp(stop={"a"}), ValueError, r"stop must be .* got \{'a'\}", id="sp-stop-set"),
    pytest.param(_sp(stop_token_ids=5), ValueError, r"stop_token_ids must be a list of token ids, got 5",
                 id="sp-stop_token_ids-int"),
    pytest.param(_sp(stop_token_ids=[-1]), ValueError, r"stop_token_ids must be non-negative integers, got -1",
                 id="sp-stop_token_ids-negative"),
    pytest.param(_sp(stop_token_ids=[1.0]), ValueError, r"stop_token_ids .* got 1\.0", id="sp-stop_token_ids-float"),
    pytest.param(_sp(ignore_eos="yes"), ValueError, r"ignore_eos must be true or false, got 'yes'",
                 id="sp-ignore_eos-str"),
    pytest.param(_sp(include_stop_str_in_output=1), ValueError, r"include_stop_str_in_output .* got 1",
                 id="sp-include_stop_str-int"),
    pytest.param(_sp(skip_special_tokens=None), ValueError, r"skip_special_tokens .* got None",
                 id="sp-skip_special_tokens-none"),
    pytest.param(_sp(prompt_logits="no"), ValueError, r"prompt_logits .* got 'no'", id="sp-prompt_logits-str"),
    pytest.param(_sp(logprobs=21), ValueError, r"logprobs must be at most 20, got 21", id="sp-logprobs-21"),
    pytest.param(_sp(logprobs=-1), ValueError, r"logprobs .* got -1", id="sp-logprobs-negative"),
    pytest.param(_sp(logprobs=True), ValueError, r"logprobs .* got True", id="sp-logprobs-bool"),
    pytest.param(_sp(output_kind="delta"), ValueError, r"output_kind must be a RequestOutputKind, got 'delta'",
                 id="sp-output_kind-str"),
    pytest.param(_sp(max_token=5), TypeError, r"max_token", id="sp-unknown-field"),
    # assignments after construction (the object stays as it was)
    pytest.param(_assign("temperature", -1), ValueError, r"temperature .* got -1", id="set-temperature-negative"),
    pytest.param(_assign("max_tokens", 0), ValueError, r"max_tokens .* got 0", id="set-max_tokens-0"),
    pytest.param(_assign("stop", 123), ValueError, r"stop must be .* got 123", id="set-stop-int"),
    pytest.param(_assign("seed", 2**64), ValueError, r"seed .*int64.* got " + str(2**64), id="set-seed-beyond-int64"),
    pytest.param(_assign("min_tokens", 9), ValueError, r"min_tokens 9 is larger than max_tokens 8",
                 id="set-min_tokens-above-max"),
    pytest.param(_assign("top_p", 0.0), ValueError, r"top_p .* got 0\.0", id="set-top_p-0"),
    pytest.param(_assign("n", 0), ValueError, r"n must .* got 0", id="set-n-0"),
    pytest.param(_assign("stop_token_ids", ["a"]), ValueError, r"stop_token_ids .* got 'a'", id="set-stop_token_ids"),
    pytest.param(_assign("logprobs", 50), ValueError, r"logprobs must be at most 20, got 50", id="set-logprobs-50"),
    pytest.param(_assign("stop_strings", ("x",)), AttributeError, r"stop_strings is derived from stop",
                 id="set-stop_strings"),
    pytest.param(_assign("max_token", 5), AttributeError, r"no field 'max_token'", id="set-unknown-field"),
    # generate(prompts, ...)
    pytest.param(_gen([True, False]), TypeError, r"prompt 0: .*got bool", id="gen-bools"),
    pytest.param(_gen([[1, True]]), TypeError, r"prompt 0: prompt token id True \(position 1\) .* got bool",
                 id="gen-bool-token"),
    pytest.param(_gen([[1, 2.0]]), TypeError, r"prompt token id 2\.0 \(position 1\) .* got float",
                 id="gen-float-token"),
    pytest.param(_gen([[1, [2]]]), TypeError, r"prompt token id \[2\] \(position 1\) .* got list",
                 id="gen-nested-list"),
    pytest.param(_gen([[1, "2"]]), TypeError, r"prompt token id '2' .* got str", id="gen-str-token"),
    pytest.param(_gen([[np.int64(5), np.bool_(True)]]), TypeError, r"prompt token id .*True.* got bool",
                 id="gen-numpy-bool-token"),
    pytest.param(_gen(42), TypeError, r"prompts must be .* got int", id="gen-int"),
    pytest.param(_gen(None), TypeError, r"prompts must be .* got NoneType", id="gen-none"),
    pytest.param(_gen({"prompt": "hi"}), TypeError, r"prompts must be .* got dict", id="gen-dict"),
    pytest.param(_gen([None]), TypeError, r"prompt 0: a prompt must be .* got NoneType", id="gen-none-prompt"),
    pytest.param(_gen(["ok", 3.5]), TypeError, r"prompt 1: a prompt must be .* got float", id="gen-float-prompt"),
    pytest.param(_gen([""]), ValueError, r"prompt 0: prompt is empty", id="gen-empty-text"),
    pytest.param(_gen([[]]), ValueError, r"prompt 0: prompt is empty \(no token ids\)", id="gen-empty-ids"),
    pytest.param(_gen([[5, V]]), ValueError, rf"prompt token id {V} is outside the vocabulary \[0, {V}\)",
                 id="gen-id-equal-vocab"),
    pytest.param(_gen([[-1]]), ValueError, r"prompt token id -1 is outside the vocabulary", id="gen-id-negative"),
    pytest.param(_gen([[2**70]]), ValueError, rf"prompt token id {2**70} is outside", id="gen-id-huge"),
    pytest.param(_gen(["ok", "a\udcffb"]), ValueError, r"prompt 1: prompt is not valid text: character 1",
                 id="gen-surrogate"),
    pytest.param(_gen([LONG]), ValueError, r"prompt has 65 tokens; the max_model_len \(--max-model-len\) is 64 "
                 r"tokens, which leaves no room", id="gen-prompt-too-long"),
    pytest.param(_gen([FORTY], SamplingParams(max_tokens=40)), ValueError, r"prompt has 40 tokens and max_tokens is "
                 r"40: 80 tokens in all, but the max_model_len \(--max-model-len\) is 64 tokens; ask for at most 24",
                 id="gen-prompt-plus-max_tokens"),
    pytest.param(_gen([FORTY], SamplingParams(max_tokens=10**9)), ValueError, r"max_tokens is 1000000000",
                 id="gen-max_tokens-huge"),
    pytest.param(_gen([PROMPTS[1]], SamplingParams(stop_token_ids=[V])), ValueError,
                 rf"stop_token_ids {V} is outside the vocabulary", id="gen-stop_token_id-vocab"),
    pytest.param(_gen([PROMPTS[1]], SamplingParams(stop_token_ids=[2**70])), ValueError,
                 rf"stop_token_ids {2**70} is outside", id="gen-stop_token_id-huge"),
    pytest.param(_gen([PROMPTS[1]], use_tqdm="yes"), TypeError, r"use_tqdm must be True or False, got 'yes'",
                 id="gen-use_tqdm-str"),
    pytest.param(_mutated_in_place, ValueError, r"stop_token_ids must be non-negative integers, got -3",
                 id="gen-params-mutated-in-place"),
    # generate(..., sampling_params)
    pytest.param(_gen("a", "notparams"), TypeError, r"sampling_params must be SamplingParams .* got str",
                 id="gen-params-str"),
    pytest.param(_gen("a", 5), TypeError, r"sampling_params must be .* got int", id="gen-params-int"),
    pytest.param(_gen("a", {"max_tokens": 3}), TypeError, r"sampling_params must be .* got dict",
                 id="gen-params-dict"),
    pytest.param(_gen(["a"], [{"temperature": 0}]), TypeError, r"sampling_params\[0\] must be SamplingParams, got "
                 r"dict", id="gen-params-list-of-dict"),
    pytest.param(_gen(["a", "b"], [GOOD]), ValueError, r"got 1 sampling params for 2 prompts",
                 id="gen-params-too-few"),
    pytest.param(_gen(["a"], [GOOD, GOOD, GOOD]), ValueError, r"got 3 sampling params for 1 prompts",
                 id="gen-params-too-many"),
    # add_request
    pytest.param(_add([True]), TypeError, r"prompt token id True .* got bool", id="add-bool-token"),
    pytest.param(_add("x", "params"), TypeError, r"sampling params must be SamplingParams, got str",
                 id="add-params-str"),
    pytest.param(_add(PROMPTS[1], request_id=5), TypeError, r"request_id must be a string, got int 5",
                 id="add-request_id-int"),
    pytest.param(_add(LONG), ValueError, r"prompt has 65 tokens", id="add-prompt-too-long"),
    pytest.param(_add(PROMPTS[1][:10], SamplingParams(max_tokens=60)), ValueError,
                 r"prompt has \d+ tokens and max_tokens is 60: \d+ tokens in all, but the max_model_len",
                 id="add-prompt-plus-max_tokens"),
    pytest.param(_add(3.5), TypeError, r"a prompt must be a string or a list of token ids, got float",
                 id="add-float-prompt"),
    pytest.param(_twice("dup", GOOD, "dup"), ValueError, r"request id 'dup' is already in use", id="add-duplicate-id"),
    pytest.param(_twice("pair", SamplingParams(n=2, max_tokens=8), "pair#1"), ValueError,
                 r"request id 'pair#1' is already in use: its sample id 'pair#1' is one of request 'pair'",
                 id="add-id-of-a-sample"),
    pytest.param(lambda llm: llm.abort(7), TypeError, r"request_id must be a string, got int 7", id="abort-int-id"),
    # chat
    pytest.param(_chat([{"role": "user", "content": None}]), ValueError, r"message 0 \(user\): content is null",
                 id="chat-content-null"),
    pytest.param(_chat([{"role": "user"}]), ValueError, r"message 0 \(user\): content is missing",
                 id="chat-content-missing"),
    pytest.param(_chat([{"role": "user", "content": 5}]), TypeError, r"content must be a string .* got int 5",
                 id="chat-content-int"),
    pytest.param(_chat([{"role": "user", "content": [{"type": "image_url"}]}]), ValueError,
                 r"only text parts .* got \{'type': 'image_url'\}", id="chat-content-image-part"),
    pytest.param(_chat([{"content": "hi"}]), ValueError, r"message 0 has no 'role'", id="chat-role-missing"),
    pytest.param(_chat([{"role": "", "content": "hi"}]), ValueError, r"role must be a non-empty string, got ''",
                 id="chat-role-empty"),
    pytest.param(_chat([{"role": 5, "content": "hi"}]), ValueError, r"role must be .* got 5", id="chat-role-int"),
    pytest.param(_chat("hello"), TypeError, r"messages must be a list .* got str", id="chat-str"),
    pytest.param(_chat([]), ValueError, r"messages is empty", id="chat-empty"),
    pytest.param(_chat([[]]), ValueError, r"conversation 0: a conversation needs at least one message",
                 id="chat-empty-conversation"),
    pytest.param(_chat(["hi"]), TypeError, r"conversation 0: a conversation must be a list .* got str",
                 id="chat-list-of-str"),
    pytest.param(_chat([HI, [{"role": "user", "content": None}]]), ValueError,
                 r"conversation 1: message 0 \(user\): content is null", id="chat-second-conversation"),
    pytest.param(_chat([{"role": "user", "content": "hi"}, "bye"]), TypeError, r"message 1 must be a dict .* got str",
                 id="chat-message-str"),
    pytest.param(_chat(HI), ValueError, r"no chat template", id="chat-without-template"),
    # switches
    pytest.param(lambda llm: llm.switch_mode("dp"), ValueError, r"mode must be 'tp' or 'ep', got 'dp'",
                 id="switch-dp"),
    pytest.param(lambda llm: llm.switch_mode(5), ValueError, r"mode must be .* got 5", id="switch-int"),
    pytest.param(lambda llm: llm.engine.request_switch("TP"), ValueError, r"got 'TP'", id="request_switch-upper"),
]

ENGINE_OPTIONS: list[Any] = [  # LLM(model=..., **options): refused before anything is loaded
    pytest.param(dict(block_size=3), ConfigError, r"block_size", id="llm-block_size-3"),
    pytest.param(dict(no_such_option=1), TypeError, r"no_such_option", id="llm-unknown-option"),
    pytest.param(dict(dtype="float64"), ConfigError, r"dtype.*float64|float64.*dtype", id="llm-dtype"),
    pytest.param(dict(max_model_len=100_000), ConfigError, r"max_model_len 100000 exceeds",
                 id="llm-max_model_len-too-big"),
    pytest.param(dict(num_ranks="2"), ConfigError, r"num_ranks", id="llm-num_ranks-str"),
    pytest.param(dict(mode="dp"), ConfigError, r"mode", id="llm-mode-dp"),
    pytest.param(dict(max_num_batched_tokens=0), ConfigError, r"max_num_batched_tokens", id="llm-budget-0"),
    pytest.param(dict(max_total_tokens=2), ConfigError, r"max_total_tokens 2", id="llm-kv-below-a-block"),
]

CLOSED: list[Any] = [  # a closed LLM (built-in model, one rank in this process)
    pytest.param(lambda c: c.generate("hi"), id="closed-generate"),
    pytest.param(lambda c: c.chat(HI), id="closed-chat"),
    pytest.param(lambda c: c.add_request([1, 2]), id="closed-add_request"),
    pytest.param(lambda c: c.step(), id="closed-step"),
    pytest.param(lambda c: c.abort("0"), id="closed-abort"),
    pytest.param(lambda c: c.switch_mode("ep"), id="closed-switch_mode"),
    pytest.param(lambda c: c.kv_stats(), id="closed-kv_stats"),
    pytest.param(lambda c: c.reset_prefix_cache(), id="closed-reset_prefix_cache"),
]


def test_catalogue_size() -> None:
    """The offline surface's count of distinct bad inputs (issue 42 asks for at least 60)."""
    assert len(CATALOGUE) + len(ENGINE_OPTIONS) + len(CLOSED) >= 60


@pytest.mark.parametrize("call,error,pattern", CATALOGUE)
def test_bad_input_is_named_and_the_engine_serves_on(llm: LLM, before: list[list[int]], call: Call,
                                                     error: type[Exception], pattern: str) -> None:
    with pytest.raises(error) as e:
        call(llm)
    assert re.search(pattern, str(e.value)), str(e.value)
    serves_as_before(llm, before)


@pytest.mark.parametrize("options,error,pattern", ENGINE_OPTIONS)
def test_bad_engine_option_is_named(ckpt: Any, llm: LLM, before: list[list[int]], options: dict[str, Any],
                                    error: type[Exception], pattern: str) -> None:
    with pytest.raises(error) as e:
        make_llm(ckpt("text"), **options)
    assert re.search(pattern, str(e.value)), str(e.value)
    serves_as_before(llm, before)


def test_chat_takes_text_parts_as_the_server_does(demo: LLM) -> None:
    """A message's content as text parts is the same prompt as the string (before the closed LLM's tests)."""
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]}]
    whole = [{"role": "user", "content": "Hello\nthere"}]
    assert demo.chat(parts, sp)[0].prompt_token_ids == demo.chat(whole, sp)[0].prompt_token_ids


@pytest.mark.parametrize("call", CLOSED)
def test_a_closed_llm_says_so(closed: LLM, llm: LLM, before: list[list[int]], call: Call) -> None:
    with pytest.raises(EngineClosedError, match=r"this LLM was closed \(LLM\.close\(\)\)"):
        call(closed)
    assert isinstance(EngineClosedError("x"), RuntimeError)
    closed.close()  # a second close is harmless
    assert not closed.has_unfinished()
    serves_as_before(llm, before)


# ---- one bad request never breaks the engine ----
def fail_sampling_for_seed(monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
    """Make the rank's sampling conversion fail for requests with this seed, as a seed outside int64 once did."""
    columns = runner.sampling_columns

    def failing(rows: list[tuple[SamplingParams, int, int]], vocab: int) -> Any:
        if any(s == seed for _, s, _ in rows):
            raise OverflowError("Overflow when unpacking long long")
        return columns(rows, vocab)

    monkeypatch.setattr(runner, "sampling_columns", failing)


def test_a_request_a_rank_cannot_run_ends_with_an_error(monkeypatch: pytest.MonkeyPatch, llm: LLM,
                                                        before: list[list[int]]) -> None:
    """A value that would fail inside a step (here: the sampling conversion, made to fail for seed 666) fails its
    request at admission on the rank, with finish_reason "error" and why; its batch-mates and later requests get the
    tokens they get without it."""
    prompts = [PROMPTS[1], PROMPTS[2], PROMPTS[3]]
    want = [o.token_ids for o in llm.generate([prompts[0], prompts[2]], SEEDED)]
    fail_sampling_for_seed(monkeypatch, 666)
    bad = SamplingParams(temperature=0.9, seed=666, max_tokens=8, ignore_eos=True)
    outs = llm.generate(prompts, [SEEDED[0], bad, SEEDED[1]])
    assert [outs[0].token_ids, outs[2].token_ids] == want
    assert outs[1].finish_reason == "error" and outs[1].token_ids == [] and outs[1].finished
    assert outs[1].outputs[0].error == "OverflowError: Overflow when unpacking long long"
    assert [o.token_ids for o in llm.generate([prompts[0], prompts[2]], SEEDED)] == want
    monkeypatch.undo()
    serves_as_before(llm, before)


def test_a_request_whose_output_fails_ends_with_an_error(monkeypatch: pytest.MonkeyPatch, llm: LLM,
                                                         before: list[list[int]]) -> None:
    """An exception while one request's tokens become its output (front end) ends that request with an error after
    the tokens it had; it is released on the ranks (its KV freed), the others run to the end as before."""
    take = Sample.take

    def failing(self: Sample, d: Any, now: float) -> bool:
        if d.request_id == "boom" and len(self.out.token_ids) == 3:
            raise RuntimeError("injected")
        return take(self, d, now)

    monkeypatch.setattr(Sample, "take", failing)
    a = llm.add_request(PROMPTS[1], GOOD)
    boom = llm.add_request(PROMPTS[3], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), "boom")
    b = llm.add_request(PROMPTS[2], GOOD)
    last = run_to_completion(llm)
    assert [last[a].token_ids, last[b].token_ids] == before
    out = last[boom]
    assert out.finished and out.finish_reason == "error" and out.outputs[0].error == "RuntimeError: injected"
    assert len(out.token_ids) == 3
    monkeypatch.undo()
    serves_as_before(llm, before)


def test_an_interrupted_generate_leaves_nothing_running(monkeypatch: pytest.MonkeyPatch, llm: LLM,
                                                        before: list[list[int]]) -> None:
    """Ctrl-C (or an engine error) inside generate(): its requests are aborted, and their outputs reach no later
    step(); the next generate gets the tokens it gets without the interruption; a step-level request's streamed
    outputs that generate() kept for the next step() are none of them lost."""
    side = llm.add_request(PROMPTS[1], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                      output_kind=RequestOutputKind.DELTA))
    step = llm.engine.step
    calls = [0]

    def interrupted() -> Any:
        calls[0] += 1
        if calls[0] == 3:
            raise KeyboardInterrupt
        return step()

    monkeypatch.setattr(llm.engine, "step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([PROMPTS[1], PROMPTS[2]], GOOD)
    monkeypatch.undo()
    assert [o.token_ids for o in llm.generate([PROMPTS[1], PROMPTS[2]], GOOD)] == before
    streamed: list[int] = []
    while llm.has_unfinished():
        outs = llm.step()
        assert {o.request_id for o in outs} <= {side}  # (nothing of the interrupted call comes back)
        streamed += [t for o in outs for t in o.token_ids]
    assert streamed == before[0]
    serves_as_before(llm, before)


def test_params_are_admitted_as_a_snapshot(llm: LLM, before: list[list[int]]) -> None:
    """Changing a SamplingParams after add_request changes nothing admitted; an accepted assignment is checked
    and keeps the derived fields (top_k 0 is -1, stop_strings follow stop)."""
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    rid = llm.add_request(PROMPTS[1], sp)
    sp.max_tokens = 2
    sp.top_k = 0
    sp.stop = "ab"
    assert (sp.max_tokens, sp.top_k, sp.stop_strings) == (2, -1, ("ab",))
    assert run_to_completion(llm)[rid].token_ids == before[0]
    serves_as_before(llm, before)


def test_a_top_k_beyond_the_vocabulary_is_all_of_it(llm: LLM, before: list[list[int]]) -> None:
    """top_k larger than the vocabulary (even beyond int64, which the step could not carry) samples as top_k off."""
    off = SamplingParams(temperature=0.9, seed=5, max_tokens=8, ignore_eos=True)
    want = llm.generate(PROMPTS[1], off)[0].token_ids
    for k in (V, 10**6, 2**70):
        got = llm.generate(PROMPTS[1], SamplingParams(temperature=0.9, seed=5, top_k=k, max_tokens=8,
                                                      ignore_eos=True))[0]
        assert got.token_ids == want and got.finish_reason == "length", k
    serves_as_before(llm, before)


def test_numpy_integers_are_token_ids(llm: LLM, before: list[list[int]]) -> None:
    """Token ids from numpy (an array's elements) are taken as the ints they are, as one prompt or several."""
    one = list(np.array(PROMPTS[1]))
    assert [o.token_ids for o in llm.generate(one, GOOD)] == before[:1]
    assert [o.token_ids for o in llm.generate([one, list(np.array(PROMPTS[2], dtype=np.int32))], GOOD)] == before
    assert run_to_completion(llm) == {}


def test_generated_ids_step_around_a_callers_own(llm: LLM) -> None:
    first = llm.add_request(PROMPTS[1], GOOD)
    mine = llm.add_request(PROMPTS[1], GOOD, str(int(first) + 1))  # the id the engine would give next
    third = llm.add_request(PROMPTS[1], GOOD)
    assert len({first, mine, third}) == 3
    last = run_to_completion(llm)
    assert all(last[r].finish_reason == "length" for r in (first, mine, third))


# ---- the context ----
def test_prompt_and_max_tokens_fill_the_context_exactly(ckpt: Any, llm: LLM) -> None:
    """prompt + max_tokens == max_model_len runs in full; max_tokens None still runs up to the context."""
    out = llm.generate([FORTY], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    assert len(out.token_ids) == 24 and out.finish_reason == "length"
    assert out.token_ids == hf_greedy(ckpt("text"), FORTY, 24)
    out = llm.generate([FORTY], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))[0]
    assert len(out.token_ids) == 24 and out.finish_reason == "length"


def test_the_kv_capacity_limit_is_named(ckpt: Any) -> None:
    small = make_llm(ckpt("text"), block_size=4, max_total_tokens=64)
    try:
        cap = small.engine.kv_capacity
        assert cap < small.engine.max_model_len
        with pytest.raises(ValueError, match=rf"prompt has 40 tokens and max_tokens is {cap}: {40 + cap} tokens in "
                           rf"all, but the KV-cache capacity of one request is {cap} tokens \(--max-total-tokens"):
            small.generate([FORTY], SamplingParams(max_tokens=cap))
        out = small.generate([FORTY], SamplingParams(temperature=0, max_tokens=cap - 40, ignore_eos=True))[0]
        assert len(out.token_ids) == cap - 40
    finally:
        small.close()


# ---- two ranks: the operator's switch is the last switch; a closed LLM says so ----
@pytest.mark.slow
def test_two_ranks_last_switch_then_closed() -> None:
    """LLM.switch_mode (the operator's path, as POST /admin/switch) is what engine.last_switch (and so
    /admin/status) reports, refused ones too; then, closed, every call on the two-rank LLM says it was closed."""
    llm = LLM(device="cpu", num_ranks=2, mode="tp", max_model_len=256)
    try:
        assert llm.engine.last_switch is None
        done = llm.switch_mode("ep")
        assert done.done and llm.engine.last_switch is done and (done.source, done.target) == ("tp", "ep")
        refused = llm.switch_mode("ep")
        assert not refused.done and llm.engine.last_switch is refused and "already in ep" in str(refused.reason)
        back = llm.switch_mode("tp")
        assert back.done and llm.engine.last_switch is back and llm.mode == "tp"
        assert llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))[0].finished
    finally:
        llm.close()
    for call in (lambda: llm.generate("hi"), lambda: llm.add_request([1, 2]), llm.step,
                 lambda: llm.switch_mode("ep"), llm.kv_stats):
        with pytest.raises(EngineClosedError, match=r"this LLM was closed"):
            call()
    with pytest.raises(EngineClosedError, match=r"this engine was closed"):
        llm.engine.step()
    llm.close()
