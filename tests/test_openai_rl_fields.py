"""The RL fields of the OpenAI endpoints (`/v1/completions`, `/v1/chat/completions`), served from this process with
the built-in demo model: `return_token_ids` as vLLM returns it (completions: `prompt_token_ids` and `token_ids` per
choice, a stream's prompt ids on each choice's first chunk; chat: `prompt_token_ids` at the top, on each choice's
role chunk when streamed), equal to the offline engine's tokens and the tokenizer's prompt ids, streamed equal to
whole, n > 1; `return_routed_experts` / `return_prompt_routed_experts`: each choice's `routed_experts` in /generate's
encoding, equal to what /generate returns for the same request (a stream: whole, on each choice's last chunk),
refused naming --enable-return-routed-experts by an engine without it; bad types are 400s naming the field."""

from __future__ import annotations

import base64
import json
from array import array
from collections.abc import Iterator
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from test_serve import served_here  # noqa: E402

from moebius import LLM, SamplingParams  # noqa: E402

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
ON: dict[str, Any] = dict(enable_return_routed_experts=True)
IDS = [[72, 101, 108, 108, 111], [5, 6, 7, 8, 9, 10, 11, 12]]
GREEDY: dict[str, Any] = dict(temperature=0, max_tokens=8, ignore_eos=True)
SEEDED: dict[str, Any] = dict(temperature=0.8, seed=99, max_tokens=8, ignore_eos=True)
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
ROUTED = {"return_routed_experts": True, "return_prompt_routed_experts": True}


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[str, Any]]:
    """The URL of an engine with --enable-return-routed-experts behind the app, and the engine."""
    with served_here(rank_process="off", **ON) as here:
        yield here


@pytest.fixture(scope="module")
def url(served: tuple[str, Any]) -> str:
    return served[0]


@pytest.fixture(scope="module")
def ref() -> Iterator[LLM]:
    llm = LLM(device="cpu", **ON)
    yield llm
    llm.close()


def post(url: str, path: str, body: dict[str, Any]) -> Any:
    r = httpx.post(url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def stream(url: str, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """A stream's chunks (the [DONE] checked and dropped; none an error)."""
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=60) as s:
        events = [ln.removeprefix("data: ") for ln in s.iter_lines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]", events
    chunks = [json.loads(e) for e in events[:-1]]
    assert all("error" not in c for c in chunks), chunks
    return chunks


def by_choice(chunks: list[dict[str, Any]]) -> dict[int, list[tuple[dict[str, Any], dict[str, Any]]]]:
    """Each choice's (chunk, choice) pairs in order (the usage chunk has none)."""
    out: dict[int, list[tuple[dict[str, Any], dict[str, Any]]]] = {}
    for ch in chunks:
        for c in ch["choices"]:
            out.setdefault(c["index"], []).append((ch, c))
    return out


def rows(b64: str, layers: int, k: int) -> list[list[list[int]]]:
    """/generate's encoding back to [tokens][decoder layers][k]."""
    ids = array("i", base64.b64decode(b64)).tolist()
    assert len(ids) % (layers * k) == 0, (len(ids), layers, k)
    return [[ids[t + j * k: t + (j + 1) * k] for j in range(layers)] for t in range(0, len(ids), layers * k)]


def test_completions_token_ids_equal_offline_whole_and_streamed(url: str, ref: LLM) -> None:
    """Two text prompts, n = 2 seeded: each choice's token_ids are the offline engine's, its prompt_token_ids the
    tokenizer's; streamed: the prompt ids once, on each choice's first chunk, and the chunks' token_ids joined equal
    the whole answer's; token-id prompts come back as given."""
    tok = ref.tokenizer
    assert tok is not None
    prompts = ["Hello", "The quick brown fox"]
    prompt_ids = [tok.encode(p) for p in prompts]
    want = ref.generate(prompts, SamplingParams(n=2, **SEEDED), use_tqdm=False)
    assert [w.prompt_token_ids for w in want] == prompt_ids
    body = {"prompt": prompts, "n": 2, "return_token_ids": True, **SEEDED}
    whole = post(url, CMPL, body)
    choices = whole["choices"]
    assert [c["token_ids"] for c in choices] == [o.token_ids for w in want for o in w.outputs]
    assert [c["text"] for c in choices] == [o.text for w in want for o in w.outputs]
    assert [c["prompt_token_ids"] for c in choices] == [p for p in prompt_ids for _ in range(2)]
    assert "prompt_token_ids" not in whole and all("routed_experts" not in c for c in choices)
    streamed = by_choice(stream(url, CMPL, body))
    assert sorted(streamed) == [0, 1, 2, 3]
    for i, pairs in streamed.items():
        assert [t for _, c in pairs for t in c["token_ids"]] == choices[i]["token_ids"]
        assert pairs[0][1]["prompt_token_ids"] == choices[i]["prompt_token_ids"]
        assert all("prompt_token_ids" not in c for _, c in pairs[1:])
        assert all("prompt_token_ids" not in ch for ch, _ in pairs)
    ids = post(url, CMPL, {"prompt": IDS, "return_token_ids": True, **GREEDY})["choices"]
    want = ref.generate(IDS, SamplingParams(**GREEDY), use_tqdm=False)
    assert [(c["prompt_token_ids"], c["token_ids"]) for c in ids] == [(p, w.outputs[0].token_ids)
                                                                      for p, w in zip(IDS, want, strict=True)]
    plain = post(url, CMPL, {"prompt": IDS[1], **GREEDY})["choices"][0]
    assert "token_ids" not in plain and "prompt_token_ids" not in plain
    assert all("token_ids" not in c for ch in stream(url, CMPL, {"prompt": IDS[1], **GREEDY}) for c in ch["choices"])


def test_chat_token_ids_at_vllms_places(url: str, ref: LLM) -> None:
    """Chat, n = 2 seeded: prompt_token_ids at the top of the answer (the chat template's text, tokenized), never in
    a choice; each choice's token_ids the offline engine's; streamed, each choice's role chunk carries the prompt ids
    at the top and its other chunks the token_ids they add, joined equal to the whole answer's."""
    tok = ref.tokenizer
    assert tok is not None
    want = ref.chat(MESSAGES, SamplingParams(n=2, **SEEDED), use_tqdm=False)[0]
    assert want.prompt_token_ids == tok.encode(tok.apply_chat_template(MESSAGES, add_generation_prompt=True))
    body = {"messages": MESSAGES, "n": 2, "return_token_ids": True, **SEEDED}
    whole = post(url, CHAT, body)
    assert whole["prompt_token_ids"] == want.prompt_token_ids
    assert [c["token_ids"] for c in whole["choices"]] == [o.token_ids for o in want.outputs]
    assert [c["message"]["content"] for c in whole["choices"]] == [o.text for o in want.outputs]
    assert all("prompt_token_ids" not in c for c in whole["choices"])
    streamed = by_choice(stream(url, CHAT, body))
    assert sorted(streamed) == [0, 1]
    for i, pairs in streamed.items():
        (role_chunk, role), *rest = pairs
        assert role["delta"]["role"] == "assistant" and role_chunk["prompt_token_ids"] == want.prompt_token_ids
        assert [t for _, c in rest for t in c["token_ids"]] == want.outputs[i].token_ids
        assert all("prompt_token_ids" not in ch and "prompt_token_ids" not in c for ch, c in rest)
    plain = post(url, CHAT, {"messages": MESSAGES, **GREEDY})
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]


def _generate(url: str, ids: list[int], n: int = 1, **sampling: Any) -> list[dict[str, Any]]:
    out = post(url, "/generate", {"input_ids": ids, "return_routed_experts": True,
                                  "sampling_params": {"max_new_tokens": 8, "ignore_eos": True, "n": n, **sampling}})
    return out if isinstance(out, list) else [out]


def test_routed_experts_equal_generates(served: tuple[str, Any], ref: LLM) -> None:
    """Both flags: each choice's routed_experts is the very string /generate returns for the same prompt ids and
    sampling (greedy; seeded with n = 2; chat's rendered prompt), whole and streamed (only on each choice's last
    chunk), and its rows the offline engine's routing; return_routed_experts alone gives the output's rows (the last
    of /generate's), return_prompt_routed_experts alone the prompt's (the first)."""
    url, engine = served
    mc = engine.model_config
    assert all(mc.is_moe_layer(i) for i in range(mc.num_layers))  # (no dense layer's -1 rows to map here)
    gen = _generate(url, IDS[1], temperature=0)
    whole = post(url, CMPL, {"prompt": IDS[1], **GREEDY, **ROUTED})["choices"][0]
    assert whole["routed_experts"] == gen[0]["meta_info"]["routed_experts"]
    full = rows(whole["routed_experts"], mc.num_layers, mc.top_k)
    want = ref.generate([IDS[1]], SamplingParams(**GREEDY, **ROUTED), use_tqdm=False)[0].outputs[0]
    assert full == want.prompt_routed_experts + want.routed_experts and len(full) == len(IDS[1]) + 8 - 1
    out_only = post(url, CMPL, {"prompt": IDS[1], **GREEDY, "return_routed_experts": True})["choices"][0]
    assert rows(out_only["routed_experts"], mc.num_layers, mc.top_k) == full[len(IDS[1]) - 1:]
    prompt_only = post(url, CMPL, {"prompt": IDS[1], **GREEDY, "return_prompt_routed_experts": True})["choices"][0]
    assert rows(prompt_only["routed_experts"], mc.num_layers, mc.top_k) == full[:len(IDS[1]) - 1]
    # seeded, n = 2: the same samples as /generate's, each its own routing
    gen2 = _generate(url, IDS[0], n=2, temperature=0.8, sampling_seed=5)
    body = {"prompt": IDS[0], "n": 2, "temperature": 0.8, "seed": 5, "max_tokens": 8, "ignore_eos": True,
            "return_token_ids": True, **ROUTED}
    two = post(url, CMPL, body)["choices"]
    assert [c["token_ids"] for c in two] == [g["output_ids"] for g in gen2]
    assert [c["routed_experts"] for c in two] == [g["meta_info"]["routed_experts"] for g in gen2]
    _assert_on_last_chunks(stream(url, CMPL, body), two)
    # chat: /generate on the rendered prompt's ids gives the same string
    chat = post(url, CHAT, {"messages": MESSAGES, "return_token_ids": True, **GREEDY, **ROUTED})
    gen_chat = _generate(url, chat["prompt_token_ids"], temperature=0)
    assert chat["choices"][0]["routed_experts"] == gen_chat[0]["meta_info"]["routed_experts"]
    _assert_on_last_chunks(stream(url, CHAT, {"messages": MESSAGES, **GREEDY, **ROUTED}), chat["choices"])


def _assert_on_last_chunks(chunks: list[dict[str, Any]], whole: list[dict[str, Any]]) -> None:
    """A stream's routed_experts: only on each choice's last chunk (its finish_reason's), equal to the whole's."""
    streamed = by_choice(chunks)
    assert sorted(streamed) == list(range(len(whole)))
    for i, pairs in streamed.items():
        *head, (_, last) = pairs
        assert last["finish_reason"] == "length" and last["routed_experts"] == whole[i]["routed_experts"]
        assert all("routed_experts" not in c for _, c in head)


def test_routed_experts_refused_without_the_flag() -> None:
    """An engine started without --enable-return-routed-experts refuses either flag on either endpoint with a 400
    naming the flag (as /generate does), streamed or not; it serves the same request without them."""
    with served_here(rank_process="off") as (url, _):
        for path, body in ((CMPL, {"prompt": IDS[0]}), (CHAT, {"messages": MESSAGES})):
            for flag in ROUTED:
                for streamed in (False, True):
                    r = httpx.post(url + path, json={**body, **GREEDY, flag: True, "stream": streamed}, timeout=60)
                    assert r.status_code == 400 and "--enable-return-routed-experts" in r.json()["error"]["message"], \
                        r.text
            assert httpx.post(url + path, json={**body, **GREEDY}, timeout=60).status_code == 200


@pytest.mark.parametrize("field", ["return_token_ids", *ROUTED])
@pytest.mark.parametrize("value", ["true", 1, None, [True], {"on": True}])
def test_bad_types_are_400s_naming_the_field(served: tuple[str, Any], field: str, value: Any) -> None:
    url, _ = served
    for path, body in ((CMPL, {"prompt": IDS[0]}), (CHAT, {"messages": MESSAGES})):
        r = httpx.post(url + path, json={**body, **GREEDY, field: value}, timeout=60)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == field and field in err["message"], err
