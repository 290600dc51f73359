"""Reasoning parsers (`moebius serve --reasoning-parser`): a chat answer split into `reasoning_content` and
`content`, whole and streamed, as vLLM's deepseek_r1, qwen3 and GPT-OSS (harmony) parsers split it."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import random
from collections.abc import Iterator
from typing import Any

import pytest

from moebius.entrypoints.openai.reasoning import PARSERS, make_parser
from moebius.sampling_params import SamplingParams

HARMONY = ("<|channel|>analysis<|message|>The user greets; answer <politely>.<|end|>"
           "<|start|>assistant<|channel|>commentary<|message|>Thinking done. <|end|>"
           "<|start|>assistant<|channel|>final<|message|>Hello! A <b>tag</b>, a < sign and <| too.<|return|>")

# (parser, rendered prompt, answer text) -> (reasoning, content)
CASES = [
    ("qwen3", "<|im_start|>assistant\n", "<think>\nLet me see: 2 < 3.\n</think>\n\nYes.", ("\nLet me see: 2 < 3.\n",
                                                                                         "\n\nYes.")),
    ("qwen3", "<|im_start|>assistant\n", "  \n<think>a</think>b", ("a", "b")),
    ("qwen3", "<|im_start|>assistant\n", "No thinking <think>here</think>.", ("", "No thinking <think>here</think>.")),
    ("qwen3", "<|im_start|>assistant\n<think>\n", "cut short </thi", ("cut short </thi", "")),
    ("qwen3", "<|im_start|>assistant\n", "<thin", ("", "<thin")),
    ("deepseek_r1", "<｜Assistant｜><think>\n", "Reason.</think>Answer </think>.", ("Reason.", "Answer </think>.")),
    ("deepseek_r1", "<｜Assistant｜>", "<think>R</think>A", ("R", "A")),
    ("deepseek_r1", "<｜Assistant｜>", "no tags at all", ("no tags at all", "")),
    ("deepseek_r1", "<｜Assistant｜></think>", "off: </think> is text", ("", "off: </think> is text")),
    ("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n", "<think>x</think>", ("", "<think>x</think>")),
    ("openai_gptoss", "<|start|>assistant", HARMONY,
     ("The user greets; answer <politely>.", "Thinking done. Hello! A <b>tag</b>, a < sign and <| too.")),
    ("openai_gptoss", "<|start|>assistant", "<|channel|>analysis<|message|>still thinking <|e",
     ("still thinking <|e", "")),
    ("openai_gptoss", "<|start|>assistant", "<|channel|>analysis<|message|>r<|end|><|start|>assistant<|chan",
     ("r", "")),
    ("openai_gptoss", "<|start|>assistant", "plain text, not harmony", ("", "plain text, not harmony")),
    ("openai_gptoss", "<|start|>assistant",
     "<|channel|>final <|constrain|>json<|message|>{\"a\": 1}<|call|>", ("", "{\"a\": 1}")),
]


def _split(name: str, prompt: str, pieces: list[str]) -> tuple[str, str, list[tuple[str, str]]]:
    parser = make_parser(name, prompt)
    steps = [parser.feed(p) for p in pieces] + [parser.finish()]
    return "".join(r for r, _ in steps), "".join(c for _, c in steps), steps


@pytest.mark.parametrize(("name", "prompt", "text", "want"), CASES)
def test_a_parser_splits_the_whole_answer_and_any_stream_of_it_alike(name: str, prompt: str, text: str,
                                                                      want: tuple[str, str]) -> None:
    """Whole, one character at a time, and at random cuts: the same reasoning and content (a marker cut between
    two pieces held back until it is whole or cannot be one)."""
    assert _split(name, prompt, [text])[:2] == want
    assert _split(name, prompt, list(text))[:2] == want
    rng = random.Random(len(text))
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 6))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert _split(name, prompt, pieces)[:2] == want, pieces


def test_a_stream_places_reasoning_as_soon_as_no_marker_can_begin_it() -> None:
    """Text goes out once it cannot be the start of a marker: a stream's reasoning is not held to the end."""
    *_, steps = _split("deepseek_r1", "<think>", ["Step one", " and two <", "/think", ">Done"])
    assert steps == [("Step one", ""), (" and two ", ""), ("", ""), ("", "Done"), ("", "")]
    *_, steps = _split("openai_gptoss", "", ["<|channel|>analysis<|message|>abc", "def<|", "end|>"])
    assert steps == [("abc", ""), ("def", ""), ("", ""), ("", "")]


def test_an_unknown_parser_is_named() -> None:
    with pytest.raises(ValueError, match=r"unknown reasoning parser 'r1'; known: deepseek_r1, qwen3, openai_gptoss"):
        make_parser("r1", "")


def test_gpt_oss_answers_are_parsed_by_default(tmp_path: Any) -> None:
    """The server's `auto` parser is the family's, as the engine loop reports it: harmony for a GPT-OSS checkpoint,
    none for the demo model (Qwen3-MoE) or any other family."""
    from test_gpt_oss_family import write_gpt_oss_checkpoint

    from moebius.config import EngineConfig
    from moebius.entrypoints.openai.engine_loop import EngineLoop
    from moebius.frontend.core import EngineCore
    from moebius.models.registry import FAMILIES

    assert FAMILIES["gpt_oss"].reasoning_parser in PARSERS
    assert all(f.reasoning_parser is None for name, f in FAMILIES.items() if name != "gpt_oss")
    path = write_gpt_oss_checkpoint(str(tmp_path / "gpt_oss"))
    for model, want in ((path, "openai_gptoss"), (None, None)):
        engine = EngineCore(EngineConfig(model=model, device="cpu", load_format="dummy", max_total_tokens=256))
        try:
            assert EngineLoop(engine).info.reasoning_parser == want, model
        finally:
            engine.close()


def _answer(parser: str | None, texts: list[str], stream: bool, n: int = 1, finish: str = "stop",
            tools: Any = None) -> Any:
    """A chat Answer with this reasoning parser (and tool-call parser) over deltas carrying these texts (each sample
    the same; the last ends with `finish`), whole or as its events."""
    from moebius.entrypoints.openai.engine_loop import Accepted, EngineInfo, SampleDelta, Sink, Update
    from moebius.entrypoints.openai.serving import Answer, Generation

    class Loop:  # what a Generation asks of the engine loop
        def submit(self, items: Any, param: str) -> Sink:
            return Sink(["r-0"])

        def abort(self, request_ids: list[str]) -> None:
            pass

    async def run() -> Any:
        gen = Generation(Loop(), [([1, 2], SamplingParams(max_tokens=9, n=n))], "messages")  # type: ignore[arg-type]
        gen.sink.receive(Accepted(["r-0"], [[1, 2]]))
        await gen.start()
        parse = None if parser is None else (lambda: make_parser(parser, "<|im_start|>assistant\n"))
        answer = Answer(gen, chat=True, model="m", return_token_ids=False, info=EngineInfo(None, 64, 256, 1),
                        reasoning=parse, tools=tools)
        for k, text in enumerate(texts):
            last = k == len(texts) - 1
            gen.sink.receive(Update(0, [SampleDelta(i, [k], text, finish if last else None, None) for i in range(n)],
                                    last))
        if not stream:
            return await answer.whole()
        return [json.loads(e[6:]) for w in [w async for w in answer.stream(include_usage=False)]
                for e in w.split("\n\n") if e and e[6:] != "[DONE]"]

    return asyncio.run(run())


def test_a_chat_answer_carries_reasoning_content_whole_and_streamed() -> None:
    texts = ["<think>I should", " greet.</th", "ink>\n\nHel", "lo!"]
    whole = _answer("qwen3", texts, stream=False, n=2)
    for choice in whole["choices"]:
        assert choice["message"] == {"role": "assistant", "content": "\n\nHello!",
                                     "reasoning_content": "I should greet."}
    events = _answer("qwen3", texts, stream=True)
    deltas = [e["choices"][0]["delta"] for e in events]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "I should greet."
    assert "".join(d.get("content", "") for d in deltas) == "\n\nHello!"
    assert {"reasoning_content": "I should"} in deltas and events[-1]["choices"][0]["finish_reason"] == "stop"
    # no parser: as before (no reasoning_content key); a parser and no reasoning: null
    assert _answer(None, texts, stream=False)["choices"][0]["message"] == {"role": "assistant",
                                                                           "content": "".join(texts)}
    assert _answer("qwen3", ["Hi"], stream=False)["choices"][0]["message"] == {
        "role": "assistant", "content": "Hi", "reasoning_content": None}


@contextlib.contextmanager
def _served(reasoning_parser: str, family_parser: str | None, **settings: Any
            ) -> Iterator[tuple[str, list[SamplingParams]]]:
    """The demo engine behind the app (its family's parser set to `family_parser`; `settings`: the app's others),
    and the SamplingParams of every request the app submits."""
    from conftest import free_port
    from test_serve import uvicorn_thread

    from moebius.config import EngineConfig
    from moebius.entrypoints.openai.app import ServeSettings, create_app
    from moebius.entrypoints.openai.engine_loop import EngineLoop
    from moebius.entrypoints.openai.server import uvicorn_config
    from moebius.frontend.core import EngineCore

    loop = EngineLoop(EngineCore(EngineConfig(device="cpu")))
    loop.info = dataclasses.replace(loop.info, reasoning_parser=family_parser)
    submitted: list[SamplingParams] = []
    submit = loop.submit

    def recording(items: Any, param: str = "prompt") -> Any:
        submitted.extend(p for _, p in items)
        return submit(items, param)

    loop.submit = recording  # type: ignore[method-assign]
    loop.start()
    port = free_port()
    try:
        app = create_app(loop, ServeSettings("moebius-demo", reasoning_parser=reasoning_parser, **settings))
        with uvicorn_thread(uvicorn_config(app, "127.0.0.1", port, access_log=False)):
            yield f"http://127.0.0.1:{port}", submitted
    finally:
        loop.stop()


def test_the_server_parses_chat_answers_by_the_flag_or_the_family() -> None:
    """`--reasoning-parser deepseek_r1`: the demo model's answer (no </think> in it) is all reasoning, the text the
    same greedy chat gives unparsed; `auto` takes the family's parser (harmony: the answer decoded with its special
    tokens), `none` turns it off; completions are never parsed."""
    httpx = pytest.importorskip("httpx")
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "temperature": 0}

    def chat(url: str, **extra: Any) -> dict[str, Any]:
        r = httpx.post(f"{url}/v1/chat/completions", json={**body, **extra}, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]

    with _served("none", "openai_gptoss") as (url, submitted):
        plain = chat(url)
        assert plain["content"] and "reasoning_content" not in plain and submitted[-1].skip_special_tokens
    with _served("deepseek_r1", None) as (url, submitted):
        assert chat(url) == {"role": "assistant", "content": "", "reasoning_content": plain["content"]}
        r = httpx.post(f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=60)
        deltas = [json.loads(e[6:])["choices"][0]["delta"] for e in r.text.split("\n\n") if e and e[6:] != "[DONE]"]
        assert "".join(d.get("reasoning_content", "") for d in deltas) == plain["content"]
        text = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 4}, timeout=60).json()
        assert "reasoning_content" not in text["choices"][0] and submitted[-1].skip_special_tokens
    with _served("auto", "openai_gptoss") as (url, submitted):
        message = chat(url)
        assert submitted[-1].skip_special_tokens is False
        assert message["reasoning_content"] is None and isinstance(message["content"], str)
