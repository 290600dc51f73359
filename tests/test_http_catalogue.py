"""The HTTP server's catalogue of bad requests: bad JSON, wrong types, out-of-range sampling values, an unknown model,
oversized bodies, unknown paths and methods, a missing or wrong API key, bad operator bodies, a wrong Content-Type,
null content, a prompt beyond the context... Each is answered with its 4xx in OpenAI's error shape, the message naming
the field or value at fault; after all of them the same server (one for the module) answers a good request with the
same tokens as before, with nothing left in flight and its KV cache free. The server also closes connections that
never finish their headers (--header-timeout) and logs no access lines (--disable-uvicorn-access-log)."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from test_serve import AUTH, KEY, Server  # noqa: E402

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
GOOD = {"prompt": [72, 101, 108, 108, 111], "temperature": 0, "max_tokens": 12, "ignore_eos": True,
        "return_token_ids": True}
GOOD_CHAT = {"messages": [{"role": "user", "content": "Hello there"}], "temperature": 0, "max_tokens": 8,
             "ignore_eos": True, "return_token_ids": True}
JSON = {"Content-Type": "application/json"}


@dataclass(frozen=True)
class Bad:
    """One bad request: what is sent, the status it gets, words its error message must contain (the field or value
    at fault), and the error's `param` where one field is at fault."""

    id: str
    path: str
    body: Any = None  # JSON, or raw bytes
    status: int = 400
    words: tuple[str, ...] = ()
    param: str | None = None
    method: str = "POST"
    headers: dict[str, str] | None = None  # instead of the key and the JSON Content-Type
    code: str | None = None  # the error's code, where it has one to check

    def send(self, url: str) -> Any:
        headers = self.headers if self.headers is not None else {**AUTH, **JSON}
        content = self.body if isinstance(self.body, bytes) else None if self.body is None else json.dumps(self.body)
        return httpx.request(self.method, url + self.path, content=content, headers=headers, timeout=60)


def c(id: str, words: tuple[str, ...], param: str | None = None, status: int = 400, **body: Any) -> Bad:
    """A completions request: {"prompt": "hi"} with `body` over it."""
    return Bad(id, CMPL, {"prompt": "hi", "max_tokens": 2, **body}, status, words, param)


def chat(id: str, words: tuple[str, ...], param: str | None = None, status: int = 400, **body: Any) -> Bad:
    return Bad(id, CHAT, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **body}, status, words,
               param)


def msgs(id: str, messages: Any, words: tuple[str, ...]) -> Bad:
    return Bad(id, CHAT, {"messages": messages, "max_tokens": 2}, 400, words, "messages")


def policy(id: str, body: Any, words: tuple[str, ...], param: str | None = None) -> Bad:
    return Bad(id, "/admin/policy", body, 400, words, param)


BIG = b'{"prompt": "' + b"a" * (5 << 20) + b'"}'

CATALOGUE: list[Bad] = [
    # ---- the prompt ----
    Bad("prompt-number", CMPL, {"prompt": 5}, 400, ("prompt", "5"), "prompt"),
    Bad("prompt-empty-list", CMPL, {"prompt": []}, 400, ("prompt", "[]"), "prompt"),
    Bad("prompt-empty-string", CMPL, {"prompt": ""}, 400, ("prompt", "empty"), "prompt"),
    Bad("prompt-null", CMPL, {"prompt": None}, 400, ("prompt", "null"), "prompt"),
    Bad("prompt-missing", CMPL, {"max_tokens": 2}, 400, ("prompt is required",), "prompt"),
    Bad("prompt-mixed-list", CMPL, {"prompt": [1, "a"]}, 400, ("prompt", '[1, "a"]'), "prompt"),
    Bad("prompt-empty-inner-list", CMPL, {"prompt": [[1, 2], []]}, 400, ("prompt", "[[1, 2], []]"), "prompt"),
    Bad("prompt-booleans", CMPL, {"prompt": [True, False]}, 400, ("prompt", "[true, false]"), "prompt"),
    Bad("prompt-id-beyond-vocab", CMPL, {"prompt": [100000]}, 400, ("100000", "vocabulary"), "prompt"),
    Bad("prompt-id-negative", CMPL, {"prompt": [-1]}, 400, ("-1", "vocabulary"), "prompt"),
    Bad("prompt-too-many", CMPL, {"prompt": ["x"] * 65}, 400, ("at most 64", "65"), "prompt"),
    Bad("prompt-beyond-context", CMPL, {"prompt": [1] * 5000}, 400, ("5000", "4096"), "prompt"),
    # prompt + max_tokens beyond the context: refused with the numbers, not cut short (finish reason "length")
    Bad("prompt-plus-max-tokens-beyond-context", CMPL, {"prompt": [1] * 4000, "max_tokens": 100}, 400,
        ("4000", "100", "ask for at most 96 tokens"), "max_tokens"),
    # ---- sampling and stopping ----
    c("max-tokens-0", ("max_tokens", "0"), "max_tokens", max_tokens=0),
    c("max-tokens-string", ("max_tokens", '"8"'), "max_tokens", max_tokens="8"),
    c("max-tokens-fraction", ("max_tokens", "1.5"), "max_tokens", max_tokens=1.5),
    c("max-tokens-beyond-context", ("max_tokens", "1000000000", "4096"), "max_tokens", max_tokens=10**9),
    c("temperature-negative", ("temperature", "-1"), "temperature", temperature=-1),
    c("temperature-boolean", ("temperature", "true"), "temperature", temperature=True),
    c("temperature-string", ("temperature", '"hot"'), "temperature", temperature="hot"),
    Bad("temperature-nan", CMPL, b'{"prompt": "hi", "temperature": NaN}', 400, ("temperature", "NaN"),
        "temperature"),
    c("top-p-0", ("top_p", "0"), "top_p", top_p=0),
    c("top-p-above-1", ("top_p", "1.5"), "top_p", top_p=1.5),
    Bad("top-p-infinity", CMPL, b'{"prompt": "hi", "top_p": Infinity}', 400, ("top_p", "Infinity"), "top_p"),
    c("top-k-below-minus-1", ("top_k", "-2"), "top_k", top_k=-2),
    c("top-k-fraction", ("top_k", "1.5"), "top_k", top_k=1.5),
    c("min-p-above-1", ("min_p", "1.5"), "min_p", min_p=1.5),
    c("min-p-negative", ("min_p", "-0.1"), "min_p", min_p=-0.1),
    c("n-0", ("n:", "0"), "n", n=0),
    c("n-above-16", ("n:", "17"), "n", n=17),
    c("best-of-above-16", ("best_of", "17"), "best_of", best_of=17),
    c("best-of-other-than-n", ("best_of", "2"), "best_of", best_of=2),
    c("stop-too-many", ("at most 16", "17"), "stop", stop=["x"] * 17),
    c("stop-empty-string", ("stop", "''"), "stop", stop=[""]),
    c("stop-number", ("stop", "3"), "stop", stop=3),
    c("stop-list-of-numbers", ("stop", "[1]"), "stop", stop=[1]),
    c("stop-token-id-beyond-vocab", ("stop_token_ids", "100000"), "stop_token_ids", stop_token_ids=[100000]),
    c("stop-token-id-negative", ("stop_token_ids", "-1"), "stop_token_ids", stop_token_ids=[-1]),
    c("stop-token-ids-string", ("stop_token_ids", '"1"'), "stop_token_ids", stop_token_ids="1"),
    c("seed-string", ("seed", '"abc"'), "seed", seed="abc"),
    c("seed-beyond-int64", ("seed", str(2**64)), "seed", seed=2**64),
    c("seed-fraction", ("seed", "1.5"), "seed", seed=1.5),
    c("min-tokens-above-max-tokens", ("min_tokens 10", "max_tokens 5"), "min_tokens", min_tokens=10, max_tokens=5),
    c("min-tokens-negative", ("min_tokens", "-1"), "min_tokens", min_tokens=-1),
    c("logprobs-above-20", ("logprobs", "21"), "logprobs", logprobs=21),
    c("logprobs-negative", ("logprobs", "-1"), "logprobs", logprobs=-1),
    c("logprobs-boolean", ("logprobs", "true"), "logprobs", logprobs=True),
    c("ignore-eos-string", ("ignore_eos", '"yes"'), "ignore_eos", ignore_eos="yes"),
    c("skip-special-tokens-number", ("skip_special_tokens", "1"), "skip_special_tokens", skip_special_tokens=1),
    c("return-token-ids-string", ("return_token_ids", '"yes"'), "return_token_ids", return_token_ids="yes"),
    c("stream-string", ("stream", '"yes"'), "stream", stream="yes"),
    c("stream-options-without-stream", ("stream_options", "stream: true"), "stream_options",
      stream_options={"include_usage": True}),
    c("include-usage-string", ("include_usage", '"yes"'), "stream_options", stream=True,
      stream_options={"include_usage": "yes"}),
    c("presence-penalty-unsupported", ("presence_penalty", "0.5"), "presence_penalty", presence_penalty=0.5),
    c("presence-penalty-out-of-range", ("presence_penalty", "3"), "presence_penalty", presence_penalty=3),
    c("frequency-penalty-unsupported", ("frequency_penalty", "1"), "frequency_penalty", frequency_penalty=1),
    c("repetition-penalty-unsupported", ("repetition_penalty", "1.2"), "repetition_penalty",
      repetition_penalty=1.2),
    c("repetition-penalty-0", ("repetition_penalty", "0"), "repetition_penalty", repetition_penalty=0),
    c("logit-bias-unsupported", ("logit_bias",), "logit_bias", logit_bias={"1": 5}),
    c("echo-unsupported", ("echo",), "echo", echo=True),
    c("suffix-unsupported", ("suffix",), "suffix", suffix="x"),
    c("user-number", ("user", "5"), "user", user=5),
    c("model-number", ("model", "5"), "model", model=5),
    c("model-unknown", ("other-model", "moebius-demo"), "model", status=404, model="other-model"),
    # ---- the body itself ----
    Bad("json-truncated", CMPL, b'{"prompt": "hi"', 400, ("not valid JSON", "character 15")),
    Bad("json-array", CMPL, b"[1, 2]", 400, ("JSON object", "an array")),
    Bad("json-string", CMPL, b'"hi"', 400, ("JSON object", "a string")),
    Bad("json-empty", CMPL, b"", 400, ("missing",)),
    Bad("json-not-utf8", CMPL, b"\xff\xfe", 400, ("not valid JSON",)),
    Bad("body-too-large", CMPL, BIG, 413, ("larger than", str(4 << 20)), code="request_too_large"),
    Bad("content-type-text", CMPL, {"prompt": "hi"}, 415, ("Content-Type", "'text/plain'", "application/json"),
        headers={**AUTH, "Content-Type": "text/plain"}, code="unsupported_media_type"),
    Bad("content-type-none", CMPL, {"prompt": "hi"}, 415, ("no Content-Type", "application/json"), headers=AUTH,
        code="unsupported_media_type"),
    Bad("content-type-form", CHAT, {"messages": []}, 415, ("'application/x-www-form-urlencoded'",),
        headers={**AUTH, "Content-Type": "application/x-www-form-urlencoded"}, code="unsupported_media_type"),
    # ---- paths, methods and the key ----
    Bad("get-completions", CMPL, None, 405, ("GET", CMPL), method="GET", code="method_not_allowed"),
    Bad("delete-chat", CHAT, None, 405, ("DELETE", CHAT), method="DELETE", code="method_not_allowed"),
    Bad("put-models", "/v1/models", None, 405, ("PUT", "/v1/models"), method="PUT", code="method_not_allowed"),
    Bad("unknown-path", "/v1/nothing-here", None, 404, ("/v1/nothing-here",), method="GET", code="not_found"),
    Bad("unknown-route-embeddings", "/v1/embeddings", {"input": "hi"}, 404, ("/v1/embeddings",),
        code="not_found"),
    Bad("unknown-model-card", "/v1/models/gpt-4", None, 404, ("gpt-4",), "model", method="GET",
        code="model_not_found"),
    Bad("no-api-key", CMPL, {"prompt": "hi"}, 401, ("API key",), headers=JSON, code="invalid_api_key"),
    Bad("wrong-api-key", CMPL, {"prompt": "hi"}, 401, ("API key",),
        headers={**JSON, "Authorization": "Bearer wrong"}, code="invalid_api_key"),
    Bad("api-key-without-bearer", CMPL, {"prompt": "hi"}, 401, ("Bearer",),
        headers={**JSON, "Authorization": KEY}, code="invalid_api_key"),
    Bad("metrics-without-key", "/metrics", None, 401, ("API key",), method="GET", headers={},
        code="invalid_api_key"),
    Bad("admin-without-key", "/admin/switch", {"mode": "ep"}, 401, ("API key",), headers=JSON,
        code="invalid_api_key"),
    # ---- chat ----
    msgs("messages-empty", [], ("messages", "[]")),
    msgs("messages-string", "hi", ("messages", '"hi"')),
    Bad("messages-missing", CHAT, {"max_tokens": 2}, 400, ("messages is required",), "messages"),
    msgs("message-without-role", [{"content": "hi"}], ("messages[0].role is required",)),
    msgs("message-empty-role", [{"role": "", "content": "hi"}], ("messages[0].role", '""')),
    msgs("message-content-number", [{"role": "user", "content": 5}], ("messages[0].content", "5")),
    msgs("message-content-null", [{"role": "user", "content": None}], ("messages[0].content", "null")),
    msgs("system-message-without-content", [{"role": "system"}, {"role": "user", "content": "hi"}],
         ("messages[0].content", "missing", "'system'")),
    msgs("message-image-part", [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
         ("messages[0].content", "'image_url'")),
    msgs("message-text-part-without-text", [{"role": "user", "content": [{"type": "text"}]}],
         ("messages[0].content", "'text'")),
    msgs("message-name-number", [{"role": "user", "content": "hi", "name": 5}], ("messages[0].name", "5")),
    msgs("message-not-an-object", [{"role": "user", "content": "hi"}, "hello"], ("messages[1]", '"hello"')),
    msgs("chat-beyond-context", [{"role": "user", "content": " ".join(str(i) for i in range(3000))}],
         ("prompt", "4096")),
    chat("top-logprobs-above-20", ("top_logprobs", "21"), "top_logprobs", logprobs=True, top_logprobs=21),
    chat("top-logprobs-without-logprobs", ("top_logprobs", "logprobs"), "top_logprobs", top_logprobs=2),
    chat("chat-logprobs-number", ("logprobs", "3"), "logprobs", logprobs=3),
    chat("tool-without-function", ("tools[0].function is required",), "tools", tools=[{"type": "function"}]),
    chat("tools-without-the-parser", ("--enable-auto-tool-choice", "--tool-call-parser"), "tool_choice",
         tools=[{"type": "function", "function": {"name": "f"}}]),
    chat("tool-choice-required", ("'required' is not supported",), "tool_choice", tool_choice="required",
         tools=[{"type": "function", "function": {"name": "f"}}]),
    chat("template-kwargs-reserved", ("add_generation_prompt",), "chat_template_kwargs",
         chat_template_kwargs={"add_generation_prompt": 1}),
    chat("template-kwargs-string", ("chat_template_kwargs", '"x"'), "chat_template_kwargs",
         chat_template_kwargs="x"),
    chat("max-completion-tokens-negative", ("max_completion_tokens", "-3"), "max_completion_tokens",
         max_completion_tokens=-3),
    chat("response-format-json", ("response_format", "json_object"), "response_format",
         response_format={"type": "json_object"}),
    chat("add-generation-prompt-string", ("add_generation_prompt", '"yes"'), "add_generation_prompt",
         add_generation_prompt="yes"),
    chat("chat-model-unknown", ("gpt-4",), "model", status=404, model="gpt-4"),
    # ---- the operator's endpoints ----
    Bad("switch-unknown-mode", "/admin/switch", {"mode": "xp"}, 400, ("mode", "'xp'"), "mode"),
    Bad("switch-without-mode", "/admin/switch", {}, 400, ("mode is required",), "mode"),
    Bad("switch-mode-number", "/admin/switch", {"mode": 1}, 400, ("mode", "1"), "mode"),
    Bad("switch-unknown-field", "/admin/switch", {"mode": "ep", "force": True}, 400, ("force",), "force"),
    Bad("switch-get", "/admin/switch", None, 405, ("GET", "/admin/switch"), method="GET"),
    Bad("status-post", "/admin/status", {}, 405, ("POST", "/admin/status")),
    Bad("pause-get", "/admin/pause", None, 405, ("GET", "/admin/pause"), method="GET"),
    Bad("policy-text-plain", "/admin/policy", {"high": 4}, 415, ("'text/plain'",),
        headers={**AUTH, "Content-Type": "text/plain"}),
    policy("policy-high-negative", {"high": -5}, ("high", "-5"), "high"),
    policy("policy-low-infinite", b'{"low": 1e999}', ("low", "finite", "Infinity"), "low"),
    policy("policy-high-nan", b'{"high": NaN}', ("high", "NaN"), "high"),
    policy("policy-cooldown-negative", {"cooldown": -1}, ("cooldown", "-1"), "cooldown"),
    policy("policy-window-0", {"window": 0}, ("window", "0"), "window"),
    policy("policy-window-fraction", {"window": 1.5}, ("window", "1.5"), "window"),
    policy("policy-high-string", {"high": "4"}, ("high", '"4"'), "high"),
    policy("policy-unknown", {"policy": "sometimes"}, ("policy", "sometimes"), "policy"),
    policy("policy-profile-unknown", {"profile": "batch"}, ("profile", "batch"), "profile"),
    policy("policy-misspelt-field", {"hihg": 4}, ("hihg",), "hihg"),
    policy("policy-off-with-settings", {"policy": "off", "high": 3}, ("off", "high")),
    policy("policy-on-one-rank", {"policy": "threshold", "high": 4}, ("one rank",)),
]


def test_the_catalogue_is_large_and_distinct() -> None:
    assert len(CATALOGUE) >= 60
    assert len({b.id for b in CATALOGUE}) == len(CATALOGUE)
    sent = {(b.method, b.path, b.body if isinstance(b.body, bytes) else json.dumps(b.body, sort_keys=True),
             json.dumps(b.headers, sort_keys=True)) for b in CATALOGUE}
    assert len(sent) == len(CATALOGUE)


@dataclass
class Served:
    server: Server
    before: dict[str, list[int]] = field(default_factory=dict)  # a good request's tokens before the catalogue


def _good(server: Server) -> dict[str, list[int]]:
    r = server.post(CMPL, GOOD)
    assert r.status_code == 200, r.text
    chat_r = server.post(CHAT, GOOD_CHAT)
    assert chat_r.status_code == 200, chat_r.text
    return {"completion": r.json()["choices"][0]["token_ids"], "chat": chat_r.json()["choices"][0]["token_ids"]}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    s = Server(tmp_path_factory.mktemp("catalogue"), "--header-timeout", "1", "--disable-uvicorn-access-log")
    try:
        yield Served(s, _good(s))
    finally:
        assert s.close() == 0, s.tail()


@pytest.mark.parametrize("bad", CATALOGUE, ids=[b.id for b in CATALOGUE])
def test_bad_request(served: Served, bad: Bad) -> None:
    r = bad.send(served.server.url)
    assert r.status_code == bad.status, (bad.id, r.status_code, r.text[:500])
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    assert err["type"] == "invalid_request_error", err
    missing = [w for w in bad.words if w not in err["message"]]
    assert not missing, (bad.id, missing, err["message"])
    if bad.param is not None:
        assert err["param"] == bad.param, (bad.id, err)
    if bad.code is not None:
        assert err["code"] == bad.code, (bad.id, err)


def test_the_server_serves_as_before(served: Served) -> None:
    """After the catalogue: the same tokens for the same good requests, nothing in flight, the KV cache free, no
    access line logged (--disable-uvicorn-access-log)."""
    s = served.server
    assert _good(s) == served.before
    assert s.get("/health").status_code == 200
    st = s.wait_idle()
    assert st["running"] == st["waiting"] == 0
    log = s.output()
    assert "HTTP/1.1\" 200" not in log and "HTTP/1.1\" 4" not in log, log[-2000:]


def _closed_within(url: str, sent: bytes, bound: float) -> float:
    """Connect, send `sent` (a request head cut short, or nothing), and the seconds until the server closes."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=bound + 5) as sock:
        if sent:
            sock.sendall(sent)
        start = time.monotonic()
        data = b""
        while chunk := sock.recv(4096):  # an answer, if any, then the close
            data += chunk
        elapsed = time.monotonic() - start
    assert elapsed < bound, (sent, elapsed, data[:200])
    return elapsed


def test_connections_that_never_finish_their_headers_are_closed(served: Served) -> None:
    """--header-timeout 1: a connection that sends nothing, half a request line, or headers without their end is
    closed within the second (uvicorn alone kept each open as long as the client liked); so is a kept-alive one
    whose next request stops halfway. A request whose head came in time is not cut however long its answer takes
    (held here by a pause)."""
    s = served.server
    head = f"GET /health HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n".encode()
    for sent in (b"", b"POST /v1/compl", head):
        assert _closed_within(s.url, sent, 3.0) >= 0.5  # (not at once: the deadline, not a refusal)
    host, port = s.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=8) as sock:
        sock.sendall(head + b"\r\n")
        answer = b""
        while not answer.endswith(b'{"status":"ok"}'):  # the head and the body may come in two reads
            answer += sock.recv(4096)
        assert answer.startswith(b"HTTP/1.1 200")
        sock.sendall(b"GET /hea")  # uvicorn's keep-alive timer stops at this byte
        start = time.monotonic()
        assert sock.recv(4096) == b"" and time.monotonic() - start < 3.0
    assert s.post("/admin/pause", {}).json() == {"paused": True}
    got: dict[str, Any] = {}
    waiting = threading.Thread(target=lambda: got.update(r=s.post(CMPL, GOOD)))
    waiting.start()
    try:
        time.sleep(1.6)  # longer than the header timeout, while the request waits for its answer
        assert waiting.is_alive()
    finally:
        assert s.post("/admin/resume", {}).json() == {"paused": False}
        waiting.join(30)
    assert got["r"].status_code == 200 and got["r"].json()["choices"][0]["token_ids"] == served.before["completion"]
