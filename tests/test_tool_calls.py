"""Tool calls (`moebius serve --enable-auto-tool-choice --tool-call-parser hermes`): the tools rendered by the chat
template, the model's calls parsed into OpenAI's `tool_calls`, whole and streamed; what cannot be honoured refused."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from moebius.entrypoints.openai.tool_calls import PARSERS, Hermes

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris <FR>"}}\n</tool_call>'

# answer text -> (content, [(name, arguments)])
CASES = [
    ("No call here, a < sign and <tool too.", ("No call here, a < sign and <tool too.", [])),
    ("Let me look." + CALL, ("Let me look.", [("get_weather", {"city": "Paris <FR>"})])),
    (CALL + "\n" + CALL.replace("Paris <FR>", "Rome"), ("\n", [("get_weather", {"city": "Paris <FR>"}),
                                                             ("get_weather", {"city": "Rome"})])),
    ('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>', ("", [("f", {"x": 1})])),
    ("<tool_call>not json</tool_call> after", ("<tool_call>not json</tool_call> after", [])),
    ('<tool_call>{"arguments": {}}</tool_call>', ('<tool_call>{"arguments": {}}</tool_call>', [])),
    ('cut short <tool_call>{"name": "f", "argu', ('cut short <tool_call>{"name": "f", "argu', [])),
    ("ends in <tool_c", ("ends in <tool_c", [])),
]


def _parse(pieces: list[str], name: str = "hermes") -> tuple[str, list[tuple[str, Any]]]:
    parser = PARSERS[name]()
    steps = [parser.feed(p) for p in pieces] + [parser.finish()]
    return "".join(c for c, _ in steps), [(call.name, json.loads(call.arguments)) for _, cs in steps for call in cs]


def _streamed_alike(text: str, want: tuple[str, list[tuple[str, Any]]], name: str = "hermes") -> None:
    """Parsed whole, a character at a time and at random cuts: `want` each time."""
    assert _parse([text], name) == want
    assert _parse(list(text), name) == want
    rng = random.Random(len(text))
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 6))))
        assert _parse([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)], name) == want


@pytest.mark.parametrize(("text", "want"), CASES)
def test_hermes_calls_whole_and_streamed_alike(text: str, want: tuple[str, list[tuple[str, Any]]]) -> None:
    """Whole, a character at a time and at random cuts: the same content and calls; a block that is not a call,
    or is cut short, stays content as it came."""
    _streamed_alike(text, want)


def test_a_call_goes_out_once_its_block_closes() -> None:
    parser = Hermes()
    assert parser.feed("Sure. <tool") == ("Sure. ", [])
    assert parser.feed('_call>{"name": "f", "arguments": {}}') == ("", [])
    content, calls = parser.feed("</tool_call>")
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("f", "{}")]
    assert calls[0].id.startswith("call_") and calls[0].json(3)["index"] == 3


def _request(**fields: Any) -> Any:
    from moebius.entrypoints.openai.protocol import ChatCompletionRequest

    return ChatCompletionRequest(**{"messages": [{"role": "user", "content": "Weather in Paris?"}], **fields})


def test_the_tools_a_request_may_use() -> None:
    """tool_choice auto (the default with tools) needs the server's parser; none leaves the tools out; required and
    a named function (guided decoding) are refused, naming the field."""
    from pydantic import ValidationError

    from moebius.entrypoints.openai.protocol import APIError
    from moebius.entrypoints.openai.serving import chat_tools

    assert chat_tools(_request(tools=[WEATHER]), "hermes") == [WEATHER]
    assert chat_tools(_request(tools=[WEATHER], tool_choice="none"), None) is None
    assert chat_tools(_request(), None) is None and chat_tools(_request(tool_choice="auto"), "hermes") is None
    with pytest.raises(APIError, match="--enable-auto-tool-choice and --tool-call-parser") as e:
        chat_tools(_request(tools=[WEATHER]), None)
    assert e.value.status == 400 and e.value.param == "tool_choice"
    for choice, what in (("required", "'required'"), ({"type": "function", "function": {"name": "get_weather"}},
                                                      "a named function")):
        with pytest.raises(APIError, match=f"{what} is not supported") as e:
            chat_tools(_request(tools=[WEATHER], tool_choice=choice), "hermes")
        assert e.value.param == "tool_choice"
    with pytest.raises(ValidationError, match="function"):
        _request(tools=[{"type": "function"}])


def test_the_template_renders_the_tools_and_the_calls_and_results_before() -> None:
    """The tools reach the chat template as `tools`, an assistant's earlier calls as its `tool_calls`, a tool's
    answer with its `tool_call_id` (what Qwen3's template reads)."""
    from moebius.entrypoints.openai.engine_loop import EngineInfo
    from moebius.entrypoints.openai.serving import chat_prompt
    from moebius.tokenizer import Tokenizer

    template = ("{% if tools %}TOOLS {{ tools | tojson }}{{ '\\n' }}{% endif %}{% for m in messages %}{{ m.role }}: "
                "{{ m.content }}{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }} "
                "{{ c.function.arguments }} {{ c.id }}</tool_call>{% endfor %}"
                "{% if m.tool_call_id %} (for {{ m.tool_call_id }}){% endif %}{{ '\\n' }}{% endfor %}")
    tok = Tokenizer(Tokenizer.builtin().tokenizer, chat_template=template)
    req = _request(tools=[WEATHER], messages=[
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}])
    got = chat_prompt(req, EngineInfo(tok, 64, 384, 1), [WEATHER])
    assert got == (f"TOOLS {json.dumps([WEATHER], ensure_ascii=False)}\nuser: Weather?\nassistant: <tool_call>"
                   'get_weather {"city": "Rome"} call_1</tool_call>\ntool: sunny (for call_1)\n')


def _answer(texts: list[str], stream: bool, finish: str = "stop", tools: Any = Hermes, reasoning: str | None = None
            ) -> Any:
    """A chat Answer with these parsers (hermes alone by default) over deltas carrying these texts."""
    from test_reasoning import _answer as answer

    return answer(reasoning, texts, stream, finish=finish, tools=tools)


def test_a_chat_answer_carries_its_calls_whole_and_streamed() -> None:
    texts = [CALL[:20], CALL[20:], "\n<tool_call>", '{"name": "get_time", "arguments": {}}</tool_call>']
    choice = _answer(texts, stream=False)["choices"][0]
    calls = choice["message"]["tool_calls"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "\n"
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("function", "get_weather", {"city": "Paris <FR>"}), ("function", "get_time", {})]
    assert len({c["id"] for c in calls}) == 2
    events = _answer(texts, stream=True)
    deltas = [e["choices"][0]["delta"] for e in events]
    streamed = [c for d in deltas for c in d.get("tool_calls", [])]
    assert [(c["index"], c["function"]["name"]) for c in streamed] == [(0, "get_weather"), (1, "get_time")]
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert "".join(d.get("content", "") for d in deltas) == "\n"
    # only calls: content null; cut short by max_tokens: the block is text and the reason stays "length"
    assert _answer([CALL], stream=False)["choices"][0]["message"]["content"] is None
    cut = _answer(["Hi ", CALL[:30]], stream=False, finish="length")["choices"][0]
    assert cut["finish_reason"] == "length" and cut["message"] == {"role": "assistant", "content": "Hi " + CALL[:30]}


def test_the_server_takes_tools_only_with_its_parser(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without --enable-auto-tool-choice a request with tools is a 400 naming the flags; with it (and hermes) each
    choice of a request with tools gets a hermes parser, one with tool_choice none or no tools none; the flag alone
    is refused before the engine starts."""
    httpx = pytest.importorskip("httpx")
    from test_reasoning import _served

    from moebius.entrypoints.cli import build_parser
    from moebius.entrypoints.openai import tool_calls
    from moebius.entrypoints.openai.server import serve

    made: list[Hermes] = []

    class Counted(Hermes):
        def __init__(self, tools: Any = ()) -> None:
            super().__init__(tools)
            made.append(self)

    monkeypatch.setitem(tool_calls.PARSERS, "hermes", Counted)
    body = {"messages": [{"role": "user", "content": "Weather?"}], "max_tokens": 4, "tools": [WEATHER]}
    with _served("none", None) as (url, _):
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 400 and "--enable-auto-tool-choice" in r.json()["error"]["message"]
    with _served("none", None, tool_call_parser="hermes", enable_auto_tool_choice=True) as (url, _):
        r = httpx.post(f"{url}/v1/chat/completions", json={**body, "n": 2}, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant" and len(made) == 2
        assert all(list(p.tools) == [WEATHER] for p in made)  # each knows the request's tools (glm45 types by them)
        for extra in ({"tool_choice": "none"}, {"tools": None}):
            assert httpx.post(f"{url}/v1/chat/completions", json={**body, **extra}, timeout=60).status_code == 200
        assert len(made) == 2
    with pytest.raises(ValueError, match="--enable-auto-tool-choice needs --tool-call-parser"):
        serve(build_parser().parse_args(["serve", "--enable-auto-tool-choice"]))


V3_CALL = ("<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Paris\"}\n```"
           "<｜tool▁call▁end｜>")
V31_CALL = "<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": \"Rome\"}<｜tool▁call▁end｜>"
KIMI_CALL = ("<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{\"city\": \"Paris\"}"
             "<|tool_call_end|>")
# (parser, answer text) -> (content, [(name, arguments)])
MARKED_CASES = [
    ("deepseek_v3", "Looking it up.<｜tool▁calls▁begin｜>" + V3_CALL + V31_CALL + "<｜tool▁calls▁end｜>",
     ("Looking it up.", [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})])),
    ("deepseek_v3", "No call, a <｜ sign.", ("No call, a <｜ sign.", [])),
    # not a call (no separator; arguments not an object): the text as it came, the section's markers dropped
    ("deepseek_v3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>oops<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
     ("<｜tool▁call▁begin｜>oops<｜tool▁call▁end｜>", [])),
    ("deepseek_v3", "<｜tool▁call▁begin｜>f<｜tool▁sep｜>[1, 2]<｜tool▁call▁end｜>",
     ("<｜tool▁call▁begin｜>f<｜tool▁sep｜>[1, 2]<｜tool▁call▁end｜>", [])),
    ("deepseek_v3", "cut <｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{\"a",
     ("cut <｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{\"a", [])),
    ("kimi_k2", "Sure.<|tool_calls_section_begin|>" + KIMI_CALL
     + KIMI_CALL.replace(":0", ":1").replace("Paris", "Rome") + "<|tool_calls_section_end|>",
     ("Sure.", [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})])),
    ("kimi_k2", "<|tool_call_begin|>functions.f:0 no arguments<|tool_call_end|> after",
     ("<|tool_call_begin|>functions.f:0 no arguments<|tool_call_end|> after", [])),
    ("kimi_k2", "ends in <|tool_calls_sec", ("ends in <|tool_calls_sec", [])),
]


@pytest.mark.parametrize(("name", "text", "want"), MARKED_CASES)
def test_deepseek_and_kimi_calls_whole_and_streamed_alike(name: str, text: str, want: tuple[str, list[Any]]
                                                           ) -> None:
    """`--tool-call-parser deepseek_v3` (V3's fenced arguments and V3.1's plain ones) and `kimi_k2`: whole, a
    character at a time and at random cuts, the same content (a section's markers dropped) and calls; what is not a
    call, or is cut short, stays content as it came."""
    _streamed_alike(text, want, name)


SEARCH = {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {
    "query": {"type": "string"}, "limit": {"type": "integer"}, "tags": {"type": "array"}}}}}
GLM_CALL = ("<tool_call>search\n<arg_key>query</arg_key>\n<arg_value>42</arg_value>\n<arg_key>limit</arg_key>\n"
            "<arg_value>5</arg_value>\n<arg_key>tags</arg_key><arg_value>[\"a\", \"b\"]</arg_value>\n</tool_call>")
GLM_CASES = [
    ("Searching." + GLM_CALL, ("Searching.", [("search", {"query": "42", "limit": 5, "tags": ["a", "b"]})])),
    ("<tool_call>get_weather\n<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>",
     ("", [("get_weather", {"city": "Paris"})])),
    ("<tool_call>now</tool_call>", ("", [("now", {})])),  # a call without arguments
    # Qwen's JSON form, or stray text among the arguments: not GLM's call, kept as it came
    ('<tool_call>{"name": "f"}</tool_call>', ('<tool_call>{"name": "f"}</tool_call>', [])),
    ("<tool_call>f\n<arg_key>a</arg_key><arg_value>1</arg_value> junk</tool_call>",
     ("<tool_call>f\n<arg_key>a</arg_key><arg_value>1</arg_value> junk</tool_call>", [])),
]


@pytest.mark.parametrize(("text", "want"), GLM_CASES)
def test_glm_calls_are_typed_by_the_tools_schema(text: str, want: tuple[str, list[Any]]) -> None:
    """`--tool-call-parser glm45`: a value stays text where the tool's schema says string ("42"), is read as JSON
    elsewhere (5, a list); whole and a character at a time alike."""
    for pieces in ([text], list(text)):
        parser = PARSERS["glm45"]([SEARCH, WEATHER])
        steps = [parser.feed(p) for p in pieces] + [parser.finish()]
        got = "".join(c for c, _ in steps), [(c.name, json.loads(c.arguments)) for _, cs in steps for c in cs]
        assert got == want


def test_kimi_calls_keep_the_models_ids() -> None:
    """A Kimi K2 call's id is the one the model wrote (functions.NAME:INDEX), which its chat template renders back
    with the tool's result; DeepSeek's get ids of their own."""
    _, calls = PARSERS["kimi_k2"]().feed(KIMI_CALL)
    assert [(c.id, c.name) for c in calls] == [("functions.get_weather:0", "get_weather")]
    _, calls = PARSERS["deepseek_v3"]().feed(V31_CALL)
    assert calls[0].id.startswith("call_")


def test_marker_formats_decode_their_answers_with_special_tokens() -> None:
    """DeepSeek's, Kimi's and GLM's markers are special tokens: with their parser a request with tools is decoded
    keeping them (else the calls would vanish from the text); one without tools, or with hermes, is decoded as
    asked."""
    httpx = pytest.importorskip("httpx")
    from test_reasoning import _served

    body = {"messages": [{"role": "user", "content": "Weather?"}], "max_tokens": 2, "tools": [WEATHER]}
    for parser, keeps in (("deepseek_v3", True), ("kimi_k2", True), ("glm45", True), ("hermes", False)):
        with _served("none", None, tool_call_parser=parser, enable_auto_tool_choice=True) as (url, submitted):
            for extra in ({}, {"tools": None}):
                assert httpx.post(f"{url}/v1/chat/completions", json={**body, **extra}, timeout=60).status_code == 200
            assert [p.skip_special_tokens for p in submitted] == [not keeps, True], parser


HARMONY_CALL = ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
                "to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\"}<|call|>")
HARMONY_CALLS = [
    (HARMONY_CALL, ("Need the weather.", "", [("get_weather", {"city": "Paris"})])),
    # the recipient in the role part, a preamble before, a second call after
    ("<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant to=functions.f<|channel|>commentary json"
     "<|message|>{}<|call|><|start|>assistant to=functions.g<|channel|>commentary<|message|> {\"a\": [1]} <|call|>",
     ("", "Checking.", [("f", {}), ("g", {"a": [1]})])),
    # cut short in the call's arguments: they stay content, as they came
    ("<|channel|>commentary to=functions.f<|message|>{\"city\": \"Pa", ("", "{\"city\": \"Pa", [])),
]


@pytest.mark.parametrize(("text", "want"), HARMONY_CALLS)
def test_gpt_oss_calls_are_harmony_messages_to_functions(text: str, want: tuple[str, str, list[Any]]) -> None:
    """The openai_gptoss reasoning parser takes a message to `functions.NAME` out as a call (its text the
    arguments), whole or streamed at any cut."""
    from moebius.entrypoints.openai.reasoning import make_parser

    def parse(pieces: list[str]) -> tuple[str, str, list[Any]]:
        parser, calls, steps = make_parser("openai_gptoss", ""), [], []
        for p in pieces:
            steps.append(parser.feed(p))
            calls += parser.take_calls()
        steps.append(parser.finish())
        calls += parser.take_calls()
        return ("".join(r for r, _ in steps), "".join(c for _, c in steps),
                [(c.name, json.loads(c.arguments)) for c in calls])

    assert parse([text]) == want and parse(list(text)) == want
    rng = random.Random(len(text))
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, 6)))
        assert parse([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]) == want


def test_a_gpt_oss_answer_carries_its_calls() -> None:
    """Served with --tool-call-parser openai (and harmony's reasoning parser): the answer's reasoning, and its call
    as tool_calls with finish_reason tool_calls; the openai parser without harmony's is refused at start."""
    from moebius.entrypoints.openai.app import ServeSettings, create_app
    from moebius.entrypoints.openai.engine_loop import EngineInfo

    choice = _answer([HARMONY_CALL[:50], HARMONY_CALL[50:]], stream=False, tools=PARSERS["openai"],
                     reasoning="openai_gptoss")["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["reasoning_content"] == "Need the weather."
    assert choice["message"]["content"] is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in choice["message"]["tool_calls"]
            ] == [("get_weather", {"city": "Paris"})]

    class Loop:
        info = EngineInfo(None, 64, 256, 1, reasoning_parser=None)

    with pytest.raises(ValueError, match="--tool-call-parser openai reads the calls .* needs --reasoning-parser "
                                         r"openai_gptoss \(or auto, for its family\), got auto \(none\)"):
        create_app(Loop(), ServeSettings("m", tool_call_parser="openai",  # type: ignore[arg-type]
                                         enable_auto_tool_choice=True))
