"""`moebius serve`: the OpenAI-compatible server, started as a process on a loopback port with the built-in model and
spoken to over raw HTTP. Its tokens equal the offline API's (`moebius.LLM`) for the same prompt ids and parameters,
also across a live switch; bad input is a 400 in OpenAI's error shape that disturbs no one else; a client that goes
away frees its KV; a full queue is a 429; SIGTERM drains and exits 0; an engine failure is a 500/503, never silent."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import itertools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

from conftest import _bytes_to_unicode, free_port  # noqa: E402

from moebius import LLM, SamplingParams  # noqa: E402

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
IDS = [[72, 101, 108, 108, 111], [5, 6, 7, 8, 9, 10, 11, 12], list(range(40, 80))]
GREEDY = dict(temperature=0, max_tokens=16, ignore_eos=True)
SEEDED = dict(temperature=0.8, seed=1234, max_tokens=16, ignore_eos=True)


class Server:
    """`moebius serve` in a subprocess (output to a log file), ready once /health answers 200."""

    def __init__(self, tmp: Any, *flags: str, key: str | None = KEY) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.log = open(os.path.join(str(tmp), f"serve-{self.port}.log"), "w+")  # noqa: SIM115
        cmd = [sys.executable, "-m", "moebius.entrypoints.cli", "serve", "--device", "cpu", "--port", str(self.port),
               *(["--api-key", key] if key else []), *flags]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"server exited {self.proc.returncode}:\n{self.tail()}"
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"server did not start:\n{self.tail()}")

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def tail(self) -> str:
        return self.output()[-4000:]

    def post(self, path: str, body: Any = None, raw: bytes | None = None, **kw: Any) -> Any:
        headers = {**self.headers, **kw.pop("headers", {})}
        if raw is not None:
            return httpx.post(self.url + path, content=raw, headers={"Content-Type": "application/json", **headers},
                              timeout=kw.pop("timeout", 60), **kw)
        return httpx.post(self.url + path, json=body, headers=headers, timeout=kw.pop("timeout", 60), **kw)

    def get(self, path: str, **kw: Any) -> Any:
        return httpx.get(self.url + path, headers={**self.headers, **kw.pop("headers", {})}, timeout=30, **kw)

    def stream(self, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any] | str]:
        """The events of a streamed answer: dicts, then "[DONE]"."""
        with httpx.stream("POST", self.url + path, json={**body, "stream": True}, headers=self.headers,
                          timeout=60) as r:
            assert r.status_code == 200, r.read()
            assert r.headers["content-type"].startswith("text/event-stream")
            for line in r.iter_lines():
                if line.startswith("data: "):
                    data = line[len("data: "):]
                    yield data if data == "[DONE]" else json.loads(data)

    def wait_idle(self, timeout: float = 20) -> dict[str, Any]:
        """/admin/status once nothing is in flight and the whole KV cache is free again."""
        deadline = time.monotonic() + timeout
        while True:
            st = self.get("/admin/status").json()
            if st["in_flight"] == 0 and st["kv"]["free_tokens"] == st["kv"]["total_tokens"]:
                return st
            assert time.monotonic() < deadline, st
            time.sleep(0.1)

    def close(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


def collect(events: Iterator[dict[str, Any] | str]) -> tuple[dict[int, list[int]], dict[int, str], list[Any]]:
    """Token ids and text per choice index of a stream, and every event ([DONE] last)."""
    toks: dict[int, list[int]] = {}
    text: dict[int, str] = {}
    seen = list(events)
    assert seen and seen[-1] == "[DONE]" and "[DONE]" not in seen[:-1]
    for ev in seen[:-1]:
        assert isinstance(ev, dict) and "error" not in ev, ev
        for c in ev["choices"]:
            toks.setdefault(c["index"], []).extend(c.get("token_ids", []))
            piece = c["delta"].get("content") if "delta" in c else c["text"]
            text[c["index"]] = text.get(c["index"], "") + (piece or "")
    return toks, text, seen


@pytest.fixture(scope="module")
def ref() -> Iterator[LLM]:
    llm = LLM(device="cpu")
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = Server(tmp_path_factory.mktemp("serve"))
    yield s
    assert s.close() == 0, s.tail()


def offline(ref: LLM, prompt: Any, **kw: Any) -> Any:
    return ref.generate([prompt], SamplingParams(**kw))[0]


# ---- completions and chat, equal to the offline API ----
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_completion_equals_offline(server: Server, ref: LLM, params: dict[str, Any]) -> None:
    for ids in IDS:
        want = offline(ref, ids, **params)
        r = server.post("/v1/completions", {"model": "moebius-demo", "prompt": ids, "return_token_ids": True,
                                            **params})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "text_completion" and body["model"] == "moebius-demo"
        (choice,) = body["choices"]
        assert choice["token_ids"] == want.token_ids and choice["text"] == want.text
        assert choice["finish_reason"] == "length" and choice["prompt_token_ids"] == ids
        usage = body["usage"]
        assert usage.pop("prompt_tokens_details").keys() == {"cached_tokens"}  # test_prompt_tokens_found_cached
        assert usage == {"prompt_tokens": len(ids), "completion_tokens": 16, "total_tokens": len(ids) + 16}


def test_completion_streamed_with_usage(server: Server, ref: LLM) -> None:
    want = offline(ref, IDS[1], **GREEDY)
    toks, text, events = collect(server.stream("/v1/completions", {"prompt": IDS[1], "return_token_ids": True,
                                                                   "stream_options": {"include_usage": True},
                                                                   **GREEDY}))
    assert toks[0] == want.token_ids and text[0] == want.text
    *chunks, usage, _ = events
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 16
    assert usage["usage"]["prompt_tokens"] == len(IDS[1])
    assert all(c["usage"] is None for c in chunks) and chunks[-1]["choices"][0]["finish_reason"] == "length"
    _, _, plain = collect(server.stream("/v1/completions", {"prompt": IDS[1], **GREEDY}))
    assert all("usage" not in e for e in plain[:-1])  # no usage chunk without include_usage


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_streamed_equal_whole(server: Server, ref: LLM, include: bool) -> None:
    out = offline(ref, IDS[2], **{**GREEDY, "max_tokens": 32})
    text, tok = out.text, ref.tokenizer
    assert tok is not None
    # a stop string across the boundary of two tokens (its start already streamed unless held back), seen once
    cuts = [len(tok.decode(out.token_ids[:k])) for k in range(8, 24)]
    stop = next(text[c - 1:c + 2] for c in cuts if 0 < c < len(text) - 2 and text.count(text[c - 1:c + 2]) == 1
                and text[c - 1:c + 2].isprintable())
    params = {**GREEDY, "max_tokens": 32, "stop": [stop, "never-seen"], "include_stop_str_in_output": include}
    want = offline(ref, IDS[2], **params)
    assert want.finish_reason == "stop" and want.text.endswith(stop) == include
    whole = server.post("/v1/completions", {"prompt": IDS[2], **params}).json()["choices"][0]
    assert (whole["text"], whole["finish_reason"], whole["stop_reason"]) == (want.text, "stop", stop)
    _, streamed, _ = collect(server.stream("/v1/completions", {"prompt": IDS[2], **params}))
    assert streamed[0] == want.text


def test_prompt_forms_and_n(server: Server, ref: LLM) -> None:
    r = server.post("/v1/completions", {"prompt": ["Hello", "The quick brown fox"], "n": 2, **SEEDED})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    want = ref.generate(["Hello", "The quick brown fox"], SamplingParams(n=2, **SEEDED))
    assert [c["text"] for c in body["choices"]] == [o.text for w in want for o in w.outputs]
    assert body["usage"]["completion_tokens"] == 64
    r = server.post("/v1/completions", {"prompt": IDS[:2], "n": 2, "return_token_ids": True, **SEEDED})
    want = ref.generate(IDS[:2], SamplingParams(n=2, **SEEDED))
    assert [c["token_ids"] for c in r.json()["choices"]] == [o.token_ids for w in want for o in w.outputs]
    toks, _, _ = collect(server.stream("/v1/completions", {"prompt": IDS[0], "n": 2, "return_token_ids": True,
                                                           **SEEDED}))
    assert [toks[0], toks[1]] == [o.token_ids for o in offline(ref, IDS[0], n=2, **SEEDED).outputs]
    r = server.post("/v1/completions", {"prompt": "hi", "max_tokens": 2, "an_unknown_field": {"x": 1}})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 2


def test_chat(server: Server, ref: LLM) -> None:
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": [{"type": "text", "text": "What is the capital of France?"}]}]
    flat = [messages[0], {"role": "user", "content": "What is the capital of France?"}]
    want = ref.chat(flat, SamplingParams(**GREEDY))[0]
    r = server.post("/v1/chat/completions", {"messages": messages, "return_token_ids": True, **GREEDY})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion"
    (choice,) = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": want.text}
    assert choice["token_ids"] == want.token_ids and body["usage"]["prompt_tokens"] == len(want.prompt_token_ids)
    toks, text, events = collect(server.stream("/v1/chat/completions", {
        "messages": flat, "return_token_ids": True, "stream_options": {"include_usage": True}, **GREEDY}))
    assert toks[0] == want.token_ids and text[0] == want.text
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert events[0]["object"] == "chat.completion.chunk" and events[-2]["usage"]["completion_tokens"] == 16
    r = server.post("/v1/chat/completions", {"messages": flat, "max_completion_tokens": 3, "temperature": 0})
    assert r.json()["usage"]["completion_tokens"] <= 3


def test_info_routes(server: Server) -> None:
    models = server.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["moebius-demo"] and models["data"][0]["max_model_len"] == 4096
    assert server.get("/v1/models/moebius-demo").json()["id"] == "moebius-demo"
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}  # open without the key
    import moebius

    assert server.get("/version").json() == {"version": moebius.__version__}


async def _where_served(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """An ASGI app that answers what runs it: the module of the running event loop's class and that of the uvicorn
    protocol whose task runs the request."""
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    task = asyncio.current_task()
    assert task is not None
    body = {"loop": type(asyncio.get_running_loop()).__module__,
            "protocol": task.get_coro().cr_frame.f_globals["__name__"]}  # type: ignore[union-attr]
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": json.dumps(body).encode()})


@pytest.mark.parametrize("extra", [True, False], ids=["serve-extra", "without-it"])
def test_server_runs_on_uvloop_and_httptools(monkeypatch: pytest.MonkeyPatch, extra: bool) -> None:
    """A server configured as `moebius serve` configures uvicorn answers on uvloop's event loop through httptools'
    protocol, which the serve extra installs (they cut the front end's CPU time per streamed token); without them it
    serves on asyncio and h11. Either way a connection that sends half a request line is closed after the header
    timeout."""

    from moebius.entrypoints.openai.server import uvicorn_config

    if extra and sys.platform == "win32":
        pytest.skip("uvloop does not run on Windows")
    if not extra:
        monkeypatch.setitem(sys.modules, "uvloop", None)  # `import uvloop` raises ImportError
        monkeypatch.setitem(sys.modules, "httptools", None)
    port = free_port()
    with uvicorn_thread(uvicorn_config(_where_served, "127.0.0.1", port, header_timeout=0.5)) as thread:
        got = httpx.get(f"http://127.0.0.1:{port}/", timeout=10).json()
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(b"GET / HT")
            start = time.monotonic()
            assert sock.recv(1024) == b"" and time.monotonic() - start < 3.0
    assert not thread.is_alive()
    loop, protocol = ("uvloop", "httptools_impl") if extra else ("asyncio", "h11_impl")
    assert (got["loop"].split(".")[0], got["protocol"]) == (loop, f"uvicorn.protocols.http.{protocol}"), got


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the rank process through /proc")
def test_one_rank_serves_from_a_process_of_its_own(server: Server, ref: LLM) -> None:
    """Under `moebius serve` the one rank runs in a process of its own (--rank-process auto): its launches (each
    gives up the GIL) would otherwise wait on the HTTP side's Python; and so does the engine loop (--engine-process
    on), which spawned it. Its tokens are the in-process engine's."""
    (engine,) = [p for p in _spawned(server.proc.pid) if p not in _rank_pids(server.proc.pid)]
    assert len(_rank_pids(server.proc.pid)) == 1 and _rank_pids(engine) == _rank_pids(server.proc.pid)
    toks, _, _ = collect(server.stream("/v1/completions", {"prompt": IDS[1], "return_token_ids": True, **GREEDY}))
    assert toks[0] == offline(ref, IDS[1], **GREEDY).token_ids


def test_rank_process_on_gives_the_in_process_tokens(ref: LLM) -> None:
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True)
    with LLM(device="cpu", rank_process="on") as spawned:
        assert type(spawned.engine.ranks).__name__ == "SpawnedRanks"
        # start-up's objects (~175k: torch, the model, the warm-up's) kept out of the rank's collections
        assert all(h["frozen"] > 50_000 for h in spawned.engine.query("heap")), spawned.engine.query("heap")
        got = [o.token_ids for o in spawned.generate(IDS, params)]
    assert got == [o.token_ids for o in ref.generate(IDS, params)]


@pytest.mark.parametrize("ahead", [1, 2])
def test_rank_processes_get_the_next_plan_before_a_step_is_taken_in(ref: LLM, ahead: int) -> None:
    """With rank processes, step() sends the next plan (--plans-ahead 2: the next two) as soon as a step's result is
    in (the ranks launch it while the front end detokenizes and delivers); a switch rides on its own call's step,
    never sent ahead; a query reads the steps in flight first; nothing is left in flight once the ranks are idle,
    and a request added then is served in full. In process there is nothing to overlap."""
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    with LLM(device="cpu", rank_process="on", plans_ahead=ahead) as spawned:
        engine = spawned.engine
        rid = engine.add_request(IDS[0], params)
        last = {o.request_id: o for o in engine.step()}
        assert engine.steps_in_flight == ahead  # the next steps are already on the ranks
        engine.request_switch("ep")
        last.update({o.request_id: o for o in engine.step()})
        assert engine.last_switch is not None and engine.last_switch.done and engine.mode == "ep"
        assert engine.steps_in_flight == 0  # nothing goes ahead of a switch's step
        last.update({o.request_id: o for o in engine.step()})
        assert engine.steps_in_flight == ahead
        assert engine.query("requests") and engine.steps_in_flight == 0  # read first
        engine.request_switch("tp")  # rides on the next step, not on a query in between
        assert engine.query("requests") and engine.mode == "ep"
        last.update({o.request_id: o for o in engine.step()})
        assert engine.mode == "tp" and engine.last_switch is not None and engine.last_switch.done
        while engine.has_unfinished():
            last.update({o.request_id: o for o in engine.step()})
        assert engine.steps_in_flight == 0  # idle: nothing left on the ranks
        rid2 = engine.add_request(IDS[1], params)  # ... so a request added now starts with the next call
        while engine.has_unfinished():
            last.update({o.request_id: o for o in engine.step()})
    # the same tokens as one step at a time in process, nothing lost or doubled across the reads ahead
    assert last[rid].outputs[0].token_ids == ref.generate([IDS[0]], params)[0].token_ids
    assert last[rid2].outputs[0].token_ids == ref.generate([IDS[1]], params)[0].token_ids
    assert ref.engine.steps_in_flight == 0


def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def test_metrics(server: Server) -> None:
    before = server.get("/metrics").text
    assert server.post("/v1/completions", {"prompt": IDS[0], **GREEDY}).status_code == 200
    after = server.get("/metrics")
    assert after.headers["content-type"].startswith("text/plain")
    for name in ("moebius:num_requests_running", "moebius:num_requests_waiting", "moebius:kv_cache_usage_perc",
                 "moebius:prompt_tokens_total", "moebius:generation_tokens_total",
                 "moebius:time_to_first_token_seconds_bucket", "moebius:time_per_output_token_seconds_bucket",
                 "moebius:e2e_request_latency_seconds_bucket", 'moebius:layout{layout="tp"}',
                 "moebius:num_preemptions_total"):
        assert name in after.text, name
    gen = "moebius:generation_tokens_total"
    assert _metric(after.text, gen) - _metric(before, gen) == 16
    prompt = "moebius:prompt_tokens_total"
    assert _metric(after.text, prompt) - _metric(before, prompt) == len(IDS[0])
    count = "moebius:e2e_request_latency_seconds_count"
    assert _metric(after.text, count) - _metric(before, count) == 1
    # rank 0's time a step, by part: a step each (16 tokens: at least 16 steps), host work in every one
    for part in ("host", "device", "plan"):
        steps = f'moebius:rank_step_seconds_count{{part="{part}"}}'
        assert _metric(after.text, steps) - _metric(before, steps) >= 16, part
    host = 'moebius:rank_step_seconds_sum{part="host"}'
    assert _metric(after.text, host) > _metric(before, host)


def test_prompt_tokens_found_cached(server: Server) -> None:
    """The prefix cache in the answers' usage (OpenAI's prompt_tokens_details) and in /metrics."""
    ids = list(range(100, 150))  # 50 tokens: 3 full pages of 16 short of the last token; no other test sends it
    before = server.get("/metrics").text
    first = server.post("/v1/completions", {"prompt": ids, **GREEDY}).json()
    again = server.post("/v1/completions", {"prompt": ids, **GREEDY}).json()
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert again["usage"]["prompt_tokens_details"] == {"cached_tokens": 48}
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    *_, usage, _ = collect(server.stream("/v1/completions", {"prompt": ids, "stream_options": {"include_usage": True},
                                                             **GREEDY}))[2]
    assert usage["usage"]["prompt_tokens_details"] == {"cached_tokens": 48}
    # two samples of a new prompt: it counts once in usage, as in prompt_tokens (its first sample computed it)
    two = server.post("/v1/completions", {"prompt": ids[1:], "n": 2, **GREEDY}).json()
    assert two["usage"]["prompt_tokens"] == 49 and two["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    after = server.get("/metrics").text
    queries, hits = "moebius:prefix_cache_queries_total", "moebius:prefix_cache_hits_total"
    assert _metric(after, queries) - _metric(before, queries) == 3 * 50 + 2 * 49
    assert _metric(after, hits) - _metric(before, hits) == 2 * 48 + 48  # the second sample of the two found 48


# ---- operator switches ----
def test_admin_switch_and_status(server: Server) -> None:
    r = server.post("/admin/switch", {"mode": "ep"})
    assert r.status_code == 200 and r.json()["done"] and r.json()["to"] == "ep"
    st = server.get("/admin/status").json()
    assert st["mode"] == "ep" and st["timeline"]["switches"][-1]["target"] == "ep"
    assert {"kv", "running", "waiting", "policy", "timeline"} <= set(st) and len(st["timeline"]["samples"]) <= 100
    assert server.post("/admin/switch", {"mode": "ep"}).json()["done"] is False  # already there: refused
    assert server.post("/admin/switch", {"mode": "tp"}).json()["done"]
    text = server.get("/metrics").text
    assert 'moebius:layout{layout="tp"} 1.0' in text and 'moebius:layout{layout="ep"} 0.0' in text
    assert 'moebius:switches_total{direction="tp_to_ep",outcome="done"}' in text
    assert 'moebius:switches_total{direction="ep_to_tp",outcome="done"}' in text
    for phase in ("total", "weights", "kv"):
        assert f'moebius:switch_duration_seconds_count{{phase="{phase}"}}' in text


def test_pause_holds_requests_until_resume(server: Server, ref: LLM) -> None:
    """RL weight-update windows: while paused no step runs, requests still come in; resume finishes them."""
    params = {**GREEDY, "max_tokens": 8}
    want = ref.generate(IDS[0], SamplingParams(**params))[0].token_ids
    assert server.post("/admin/pause", {}).json() == {"paused": True}
    got: dict[str, Any] = {}
    t = threading.Thread(target=lambda: got.update(server.post("/v1/completions", {
        "prompt": IDS[0], "return_token_ids": True, **params}).json()))
    t.start()
    t.join(1.5)
    assert t.is_alive() and server.get("/admin/status").json()["paused"] is True  # held, not lost
    assert server.post("/admin/resume", {}).json() == {"paused": False}
    t.join(30)
    assert got["choices"][0]["token_ids"] == want


def test_pause_mid_stream_runs_no_step_until_resume(server: Server, ref: LLM) -> None:
    """A pause while a request streams reads the steps already sent to the rank (it gets plans ahead) before it
    answers: nothing is in flight and no token comes while paused; resume finishes with the same tokens."""
    params = {**GREEDY, "max_tokens": 120}
    want = ref.generate(IDS[2], SamplingParams(**params))[0].token_ids
    got: list[int] = []
    started = threading.Event()

    def read() -> None:
        for chunk in server.stream("/v1/completions", {"prompt": IDS[2], "return_token_ids": True, **params}):
            for c in chunk.get("choices", []) if isinstance(chunk, dict) else []:
                got.extend(c.get("token_ids") or [])
            if len(got) >= 4:
                started.set()

    t = threading.Thread(target=read)
    t.start()
    try:
        assert started.wait(30)
        assert server.post("/admin/pause", {}).json() == {"paused": True}
        st = server.get("/admin/status").json()
        assert st["paused"] is True and st["steps_in_flight"] == 0
        time.sleep(0.2)  # what was read before the pause reaches the client
        n = len(got)
        time.sleep(0.5)
        assert len(got) == n < len(want)  # no step while paused
    finally:
        assert server.post("/admin/resume", {}).json() == {"paused": False}
        t.join(60)
    assert got == want


def test_policy_is_refused_on_one_rank(server: Server) -> None:
    r = server.post("/admin/policy", {"policy": "threshold", "high": 4})
    assert r.status_code == 400 and "one rank" in r.json()["error"]["message"]
    assert server.post("/admin/policy", {"policy": "off"}).json() == {"policy": None}
    assert server.post("/admin/policy", {"high": "x"}).status_code == 400


def test_switch_while_streaming_keeps_tokens(server: Server, ref: LLM) -> None:
    params = {**GREEDY, "max_tokens": 48}
    want = [o.token_ids for o in ref.generate(IDS, SamplingParams(**params))]
    got: dict[int, list[int]] = {}
    first = [threading.Event() for _ in IDS]

    def run(i: int) -> None:
        toks: list[int] = []
        for ev in server.stream("/v1/completions", {"prompt": IDS[i], "return_token_ids": True, **params}):
            if isinstance(ev, dict):
                toks += ev["choices"][0]["token_ids"]
                first[i].set()
        got[i] = toks

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(IDS))]
    for t in threads:
        t.start()
    for e in first:
        assert e.wait(30)
    assert server.post("/admin/switch", {"mode": "ep"}).json()["done"]
    time.sleep(0.05)
    assert server.post("/admin/switch", {"mode": "tp"}).json()["done"]
    for t in threads:
        t.join(60)
    assert [got[i] for i in range(len(IDS))] == want


# ---- refusals ----
def test_api_key(server: Server) -> None:
    body = {"prompt": "hi", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        for path in ("/v1/completions", "/admin/switch"):
            r = httpx.post(server.url + path, json=body, headers=headers, timeout=10)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        for path in ("/v1/models", "/metrics", "/admin/status", "/version", "/nope"):
            assert httpx.get(server.url + path, headers=headers, timeout=10).status_code == 401
    assert server.post("/v1/completions", body).status_code == 200
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_not_found_method_and_size(server: Server) -> None:
    r = server.post("/v1/completions", {"model": "gpt-4", "prompt": "hi"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert r.json()["error"]["param"] == "model"
    assert server.get("/v1/models/gpt-4").status_code == 404
    r = server.get("/v1/nothing-here")
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = server.get("/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    assert httpx.put(server.url + "/v1/models", headers=server.headers).status_code == 405
    big = b'{"prompt": "' + b"a" * (5 << 20) + b'"}'
    r = server.post("/v1/completions", raw=big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = server.post("/v1/completions", raw=iter([big[i:i + (1 << 20)] for i in range(0, len(big), 1 << 20)]))
    assert r.status_code == 413  # chunked, no Content-Length: counted as it arrives


MSG = [{"role": "user", "content": "hi"}]
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"


def _c(**kw: Any) -> tuple[str, dict[str, Any]]:
    return CMPL, {"prompt": "hi", **kw}


def _chat(**kw: Any) -> tuple[str, dict[str, Any]]:
    return CHAT, {"messages": MSG, **kw}


BAD: list[tuple[str, Any]] = [  # (route, JSON body or raw bytes): each must be a 400 (404 for the model)
    (CMPL, {"prompt": 5}), (CMPL, {"prompt": []}), (CMPL, {"prompt": ""}), (CMPL, {"prompt": [1, "a"]}),
    (CMPL, {"prompt": [[1, 2], []]}), (CMPL, {"prompt": [100000]}), (CMPL, {"prompt": [-1]}), (CMPL, {}),
    (CMPL, {"prompt": [1] * 5000}), (CMPL, {"prompt": [True, False]}), (CMPL, {"prompt": ["x"] * 65}),
    _c(max_tokens=0), _c(max_tokens="8"), _c(max_tokens=1.5), _c(max_tokens=10**9), _c(temperature=-1),
    _c(temperature=True), _c(top_p=0), _c(top_p=1.5), _c(top_k=-2), _c(n=0), _c(n=17), _c(stop=["x"] * 17),
    _c(stop=[""]), _c(stop=3), _c(seed="abc"), _c(seed=2**64), _c(min_tokens=10, max_tokens=5), _c(logprobs=21),
    _c(min_p=1.5), _c(logprobs=-1), _c(stop_token_ids=[100000], min_tokens=2), _c(stream="yes"),
    _c(stream_options={"include_usage": True}), _c(presence_penalty=0.5), _c(echo=True), _c(model="other-model"),
    (CMPL, b'{"prompt": "hi"'), (CMPL, b"[1, 2]"), (CMPL, b""), (CMPL, b'{"prompt": "hi", "temperature": NaN}'),
    (CMPL, b"\xff\xfe"),
    (CHAT, {"messages": []}), (CHAT, {"messages": "hi"}), (CHAT, {"messages": [{"content": "hi"}]}),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}),
    _chat(logprobs=True, top_logprobs=21), _chat(top_logprobs=2), _chat(tools=[{"type": "function"}]),
    _chat(chat_template_kwargs={"add_generation_prompt": 1}), _chat(max_completion_tokens=-3),
    ("/admin/switch", {"mode": "xp"}), ("/admin/switch", {}),
]


def test_logprobs_and_min_p(server: Server, ref: LLM) -> None:
    """logprobs equal the offline API's (the model's log-probabilities of each token and its top k), whole and
    streamed, completions and chat; min_p = 1 keeps only the most likely token: a sample equals the greedy tokens."""
    params = {**GREEDY, "max_tokens": 6}
    want = ref.generate(IDS[1], SamplingParams(**params, logprobs=3))[0].outputs[0]
    body = {"prompt": IDS[1], "return_token_ids": True, "logprobs": 3, **params}
    got = server.post("/v1/completions", body).json()["choices"][0]
    assert got["token_ids"] == want.token_ids
    lp = got["logprobs"]
    assert lp["token_logprobs"] == pytest.approx([e[t] for t, e in zip(want.token_ids, want.logprobs, strict=True)])
    assert all(len(top) in (3, 4) for top in lp["top_logprobs"]) and len(lp["text_offset"]) == 6
    streamed = [ev["choices"][0]["logprobs"]["token_logprobs"] for ev in server.stream(
        "/v1/completions", {**body, "stream": True}) if isinstance(ev, dict) and ev["choices"][0]["logprobs"]]
    assert [x for chunk in streamed for x in chunk] == pytest.approx(lp["token_logprobs"])
    msgs = [{"role": "user", "content": "Hello there"}]
    chat = server.post("/v1/chat/completions", {"messages": msgs, "logprobs": True, "top_logprobs": 2,
                                                **{**GREEDY, "max_tokens": 4}}).json()["choices"][0]["logprobs"]
    offline_chat = ref.chat(msgs, SamplingParams(**{**GREEDY, "max_tokens": 4}, logprobs=2))[0].outputs[0]
    assert [c["logprob"] for c in chat["content"]] == pytest.approx(
        [e[t] for t, e in zip(offline_chat.token_ids, offline_chat.logprobs, strict=True)])
    assert all(len(c["top_logprobs"]) == 2 and c["bytes"] is not None for c in chat["content"])
    greedy = offline(ref, IDS[0], **{**GREEDY, "max_tokens": 12}).token_ids
    sampled = server.post("/v1/completions", {"prompt": IDS[0], "return_token_ids": True, "temperature": 1.5,
                                              "seed": 7, "min_p": 1.0, "max_tokens": 12, "ignore_eos": True}).json()
    assert sampled["choices"][0]["token_ids"] == greedy


def test_bad_inputs_leave_a_running_stream_alone(server: Server, ref: LLM) -> None:
    params = {**GREEDY, "max_tokens": 200}
    want = offline(ref, IDS[2], **params).token_ids
    events: list[Any] = []
    started = threading.Event()

    def run() -> None:
        for ev in server.stream("/v1/completions", {"prompt": IDS[2], "return_token_ids": True, **params}):
            events.append(ev)
            started.set()

    t = threading.Thread(target=run)
    t.start()
    assert started.wait(30)
    for path, body in BAD:
        r = server.post(path, raw=body) if isinstance(body, bytes) else server.post(path, body)
        expected = 404 if isinstance(body, dict) and body.get("model") else 400
        assert r.status_code == expected, (path, body if len(str(body)) < 200 else "...", r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], err
        assert err["type"] == "invalid_request_error"
    err = server.post("/v1/completions", {"prompt": "hi", "temperature": -1}).json()["error"]
    assert err["param"] == "temperature" and "temperature" in err["message"]
    t.join(60)
    toks, _, _ = collect(iter(events))
    assert toks[0] == want
    assert server.get("/health").status_code == 200


def test_disconnect_aborts_and_frees_kv(server: Server) -> None:
    server.wait_idle()
    body = {"prompt": IDS[2], "max_tokens": 4000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=server.headers, timeout=30) as r:
        lines = r.iter_lines()
        for _ in range(5):
            next(lines)
        assert server.get("/admin/status").json()["in_flight"] == 1
    st = server.wait_idle(10)  # 4000 tokens would take far longer: it was aborted
    assert st["running"] == 0
    with pytest.raises(httpx.ReadTimeout):  # a non-streamed request whose client gives up
        server.post("/v1/completions", {**body, "stream": False}, timeout=1.0)
    server.wait_idle(10)
    assert _metric(server.get("/metrics").text, "moebius:kv_cache_usage_perc") == 0


# ---- load, shutdown, failure ----
def test_full_queue_is_429(tmp_path: Any) -> None:
    s = Server(tmp_path, "--max-waiting-requests", "2", "--max-running-requests", "1", key=None)
    try:
        codes: list[Any] = []

        def one() -> None:
            r = s.post("/v1/completions", {"prompt": IDS[1], "max_tokens": 40, "ignore_eos": True})
            codes.append((r.status_code, r.headers.get("retry-after"), r.json()))

        threads = [threading.Thread(target=one) for _ in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        refused = [c for c in codes if c[0] == 429]
        done = [c for c in codes if c[0] == 200]
        assert refused and done and len(refused) + len(done) == 12, codes
        assert all(c[1] is not None and int(c[1]) >= 1 for c in refused)
        assert refused[0][2]["error"]["type"] == "rate_limit_error"
        assert all(c[2]["usage"]["completion_tokens"] == 40 for c in done)
        s.wait_idle()
        counted = 'moebius:requests_refused_total{code="rate_limit_exceeded",model_name="moebius-demo"}'
        assert _metric(s.get("/metrics").text, counted) == len(refused)  # every 429 counted
    finally:
        assert s.close() == 0, s.tail()


def test_sigterm_drains_then_exits_0(tmp_path: Any, ref: LLM) -> None:
    s = Server(tmp_path, key=None)
    params = {**GREEDY, "max_tokens": 300}
    events: list[Any] = []
    started = threading.Event()

    def run() -> None:
        for ev in s.stream("/v1/completions", {"prompt": IDS[0], "return_token_ids": True, **params}):
            events.append(ev)
            started.set()

    t = threading.Thread(target=run)
    t.start()
    assert started.wait(30)
    s.proc.send_signal(signal.SIGTERM)
    for pid in _spawned(s.proc.pid) if os.path.isdir("/proc") else []:  # as a signal to the process group
        # (systemd's stop) reaches the engine process and the rank too
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 5
    while s.get("/health").status_code == 200:  # the signal lands within moments
        assert time.monotonic() < deadline
        time.sleep(0.01)
    r = s.post("/v1/completions", {"prompt": "hi"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
    t.join(60)
    toks, _, _ = collect(iter(events))  # the stream in flight ran to its end
    assert toks[0] == offline(ref, IDS[0], **params).token_ids
    assert s.proc.wait(60) == 0, s.tail()
    s.close()


def test_engine_failure_is_reported() -> None:
    """An exception inside the engine loop fails the requests in flight and makes /health unhealthy; the server stays
    up to say so. (In process, to inject the failure into the engine's step.)"""
    import uvicorn

    from moebius.config import EngineConfig
    from moebius.entrypoints.openai.app import ServeSettings, create_app
    from moebius.entrypoints.openai.engine_loop import EngineLoop
    from moebius.entrypoints.openai.metrics import ServerMetrics
    from moebius.frontend.core import EngineCore

    engine = EngineCore(EngineConfig(device="cpu"))
    boom = threading.Event()
    step = engine.step

    def failing_step() -> Any:
        if boom.is_set():
            raise RuntimeError("injected failure")
        return step()

    engine.step = failing_step  # type: ignore[method-assign]
    metrics = ServerMetrics("moebius-demo")
    loop = EngineLoop(engine, metrics)
    loop.start()
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(loop, ServeSettings("moebius-demo"), metrics),
                                           host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        while not server.started:
            time.sleep(0.05)
        body = {"prompt": IDS[0], "max_tokens": 3000, "ignore_eos": True}
        results: dict[str, Any] = {}

        def whole() -> None:
            results["whole"] = httpx.post(url + "/v1/completions", json=body, timeout=30)

        events: list[Any] = []
        waiter = threading.Thread(target=whole)
        waiter.start()
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=30) as r:
            while httpx.get(url + "/admin/status", timeout=10).json()["running"] < 2:  # both generating
                time.sleep(0.01)
            boom.set()
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        waiter.join(30)
        assert events[-1] == "[DONE]" and "injected failure" in json.loads(events[-2])["error"]["message"]
        assert results["whole"].status_code == 500
        assert "injected failure" in results["whole"].json()["error"]["message"]
        health = httpx.get(url + "/health", timeout=10)
        assert health.status_code == 503 and "injected failure" in health.json()["error"]["message"]
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi"}, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
        assert "moebius:engine_healthy 0.0" in httpx.get(url + "/metrics", timeout=10).text
    finally:
        server.should_exit = True
        thread.join(30)
        loop.stop()


@pytest.mark.slow
def test_two_ranks(tmp_path: Any) -> None:
    s = Server(tmp_path, "--num-ranks", "2", "--mode", "tp", key=None)
    try:
        params, long = {**GREEDY, "max_tokens": 40}, {**GREEDY, "max_tokens": 96}
        prompts = [[(i * 31 + j * 7) % 250 + 1 for j in range(4 + i % 9)] for i in range(32)]
        with LLM(device="cpu", num_ranks=2, mode="tp") as ref2:
            want = [o.token_ids for o in ref2.generate(prompts, SamplingParams(**long))]
            want += [o.token_ids for o in ref2.generate(IDS[:1], SamplingParams(**params))]
        toks, _, _ = collect(s.stream("/v1/completions", {"prompt": IDS[0], "return_token_ids": True, **params}))
        assert toks[0] == want[-1]
        got: dict[int, list[int]] = {}
        first = [threading.Event() for _ in prompts]

        def run(i: int) -> None:
            toks: list[int] = []
            for ev in s.stream("/v1/completions", {"prompt": prompts[i], "return_token_ids": True, **long}):
                if isinstance(ev, dict):
                    toks += ev["choices"][0]["token_ids"]
                    first[i].set()
            got[i] = toks

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for e in first:
            assert e.wait(60)
        assert s.get("/admin/status").json()["running"] == 32  # all streaming
        outcome = s.post("/admin/switch", {"mode": "ep"}).json()  # a real reshard, with 32 streams running
        assert outcome["done"], outcome
        for t in threads:
            t.join(120)
        assert [got[i] for i in range(len(prompts))] == want[:-1]
        assert all(len(got[i]) == 96 for i in got)
        assert s.get("/admin/status").json()["mode"] == "ep"
        # the policy, changed live: back to TP once fewer than 2 are in flight (idle now), then nothing moves it
        r = s.post("/admin/policy", {"policy": "threshold", "high": 2, "low": 2, "window": 1, "cooldown": 0})
        assert r.status_code == 200 and "T_h" not in r.json()["policy"] and "above 2" in r.json()["policy"]
        toks, _, _ = collect(s.stream("/v1/completions", {"prompt": IDS[0], "return_token_ids": True, **params}))
        assert toks[0] == want[-1]
        st = s.get("/admin/status").json()
        assert st["mode"] == "tp" and st["timeline"]["switches"][-1]["target"] == "tp", st["timeline"]["switches"]
        assert s.post("/admin/policy", {"policy": "off"}).json() == {"policy": None}
    finally:
        assert s.close() == 0, s.tail()


def _wait_gone(pids: list[int], timeout: float = 30) -> None:
    """Until none of these processes runs (a zombie counts as gone)."""
    deadline = time.monotonic() + timeout
    while any(os.path.exists(f"/proc/{p}") and open(f"/proc/{p}/stat").read().split()[2] != "Z" for p in pids):
        assert time.monotonic() < deadline, f"processes {pids} left running"
        time.sleep(0.2)


def _rank_pids(parent: int) -> list[int]:
    """The rank processes of a server: the spawned processes under it that spawned none themselves (its engine
    process, with --engine-process on, spawned them)."""
    spawned = _spawned(parent)
    return [p for p in spawned if not _spawned(p)]


def _spawned(parent: int) -> list[int]:
    """The spawned processes of a server, at any depth (multiprocessing's spawn_main: its engine process and rank
    processes)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read()
        except (OSError, ValueError, IndexError):
            continue
        if b"spawn_main" in cmd:
            children.setdefault(ppid, []).append(int(d))
    pids, todo = [], [parent]
    while todo:
        kids = children.get(todo.pop(), [])
        pids += kids
        todo += kids
    return pids


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the rank processes through /proc")
def test_rank_killed_under_the_server(tmp_path: Any) -> None:
    """A rank process killed while a request streams: that request ends with an error naming the dead rank, /health
    and new requests answer 503, then the server logs the cause and exits 1 on its own, no rank process left."""
    s = Server(tmp_path, "--num-ranks", "2", "--mode", "ep", key=None)
    try:
        pids = _rank_pids(s.proc.pid)
        assert len(pids) == 2, pids
        events = s.stream("/v1/completions", {"prompt": IDS[0], "max_tokens": 3000, "ignore_eos": True})
        assert isinstance(next(events), dict)  # generating
        os.kill(pids[-1], signal.SIGKILL)
        rest = list(events)
        assert rest[-1] == "[DONE]" and "exited unexpectedly" in rest[-2]["error"]["message"], rest[-2:]
        health = s.get("/health")  # the server answers 503 for a few seconds before it exits
        assert health.status_code == 503 and "exited unexpectedly" in health.json()["error"]["message"]
        r = s.post("/v1/completions", {"prompt": "hi"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
        assert s.proc.wait(60) == 1, s.tail()
        assert "the engine failed (RankError: rank process(es) [" in s.tail(), s.tail()
    finally:
        s.close()
    _wait_gone(pids)


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the engine process through /proc")
def test_engine_process_killed_under_the_server(tmp_path: Any) -> None:
    """The engine process killed while a request streams: that request ends with an error, /health and new requests
    answer 503 naming it, the server exits 1 on its own, and the rank process (its child) ends too."""
    s = Server(tmp_path, key=None)
    try:
        ranks = _rank_pids(s.proc.pid)
        (engine,) = [p for p in _spawned(s.proc.pid) if p not in ranks]
        events = s.stream("/v1/completions", {"prompt": IDS[0], "max_tokens": 3000, "ignore_eos": True})
        assert isinstance(next(events), dict)  # generating
        os.kill(engine, signal.SIGKILL)
        rest = list(events)
        assert rest[-1] == "[DONE]" and "engine process died" in rest[-2]["error"]["message"], rest[-2:]
        health = s.get("/health")
        assert health.status_code == 503 and "engine process died" in health.json()["error"]["message"]
        r = s.post("/v1/completions", {"prompt": "hi"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
        assert s.proc.wait(60) == 1, s.tail()
    finally:
        s.close()
    _wait_gone(ranks)


def test_engine_loop_in_the_servers_process(tmp_path: Any, ref: LLM) -> None:
    """--engine-process off: the engine loop is a thread of the server's process (its rank still one of its own);
    the same tokens, metrics and status."""
    s = Server(tmp_path, "--engine-process", "off", key=None)
    try:
        if os.path.isdir("/proc"):
            assert _spawned(s.proc.pid) == _rank_pids(s.proc.pid) and len(_rank_pids(s.proc.pid)) == 1
        toks, _, _ = collect(s.stream("/v1/completions", {"prompt": IDS[2], "return_token_ids": True, **GREEDY}))
        assert toks[0] == offline(ref, IDS[2], **GREEDY).token_ids
        assert _metric(s.get("/metrics").text, "moebius:generation_tokens_total") == 16
        assert s.wait_idle()["mode"] == "tp"
    finally:
        assert s.close() == 0, s.tail()


def test_openai_client(server: Server, ref: LLM) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in client.models.list()] == ["moebius-demo"]
    want = offline(ref, "The quick brown fox", **GREEDY)
    out = client.completions.create(model="moebius-demo", prompt="The quick brown fox", max_tokens=16, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].text == want.text and out.usage.completion_tokens == 16
    msgs = [{"role": "user", "content": "Hello there"}]
    want = ref.chat(msgs, SamplingParams(**GREEDY))[0]
    chunks = list(client.chat.completions.create(model="moebius-demo", messages=msgs, max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert chunks[-1].usage.completion_tokens == 16
    lp = client.chat.completions.create(model="moebius-demo", messages=msgs, max_tokens=4, temperature=0,
                                        logprobs=True, top_logprobs=2).choices[0].logprobs
    assert len(lp.content) == 4 and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in lp.content)
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(model="moebius-demo", messages=msgs, top_logprobs=2)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="hi")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()


def test_stats_line_while_busy(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A stats line (throughput, running, waiting, KV use, layout) every STATS_EVERY_S seconds while busy: its
    figures follow the one request through its course (waiting, then decoding with its KV page held and tokens
    flowing, then finished with its page free again)."""
    import logging
    import re

    from moebius.config import EngineConfig
    from moebius.entrypoints.openai import engine_loop
    from moebius.entrypoints.openai.engine_loop import EngineLoop
    from moebius.frontend.core import EngineCore

    monkeypatch.setattr(engine_loop, "STATS_EVERY_S", 0.0)
    # a small KV pool, so that the request's one page shows in the percentage
    loop = EngineLoop(EngineCore(EngineConfig(device="cpu", max_total_tokens=256)))
    with caplog.at_level(logging.INFO, logger="moebius"):
        loop.start()
        asyncio.run(_one_request(loop))
        loop.stop()
    line = re.compile(r"([\d.]+) tokens/s generated, (\d+) running, (\d+) waiting, KV ([\d.]+)% used, layout (\w+)")
    lines = [r.getMessage() for r in caplog.records if "tokens/s generated" in r.getMessage()]
    stats = [line.fullmatch(m) for m in lines]
    assert stats and all(stats), lines
    rows = [(float(m[1]), int(m[2]), int(m[3]), float(m[4]), m[5]) for m in stats if m is not None]
    assert {layout for *_, layout in rows} == {"tp"}, lines
    assert {(running, waiting) for _, running, waiting, _, _ in rows} <= {(0, 1), (1, 0), (0, 0)}, lines
    decoding = [(rate, kv) for rate, running, _, kv, _ in rows if running == 1]
    assert decoding and all(rate > 0 and kv > 0 for rate, kv in decoding), lines  # a token since the line before
    assert rows[-1][1:4] == (0, 0, 0.0), lines  # finished: nothing running or waiting, its page free


async def _one_request(loop: Any) -> None:
    sink = loop.submit([(list(IDS[0]), SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))])
    while True:
        ev = await sink.get()
        if getattr(ev, "finished", False) or type(ev).__name__ == "Failure":
            return


def test_a_step_wakes_the_event_loop_once() -> None:
    """A step's outputs for all streams reach the event loop in one wake-up: a wake-up a stream (256 a step at 256
    streams) gives up the engine thread's GIL as often, and held served steps a third over their offline time."""
    from moebius.config import EngineConfig
    from moebius.entrypoints.openai import control
    from moebius.entrypoints.openai.engine_loop import EngineLoop, Update
    from moebius.frontend.core import EngineCore

    engine = EngineCore(EngineConfig(device="cpu"))
    steps, step = [0], engine.step

    def counted() -> Any:
        steps[0] += 1
        return step()

    engine.step = counted  # type: ignore[method-assign]
    loop = EngineLoop(engine)
    loop.start()

    async def streams(n: int) -> tuple[int, list[list[int]]]:
        ev_loop, wakes = asyncio.get_running_loop(), [0]
        wake = ev_loop.call_soon_threadsafe

        def counting(*a: Any, **kw: Any) -> Any:
            wakes[0] += 1
            return wake(*a, **kw)

        ev_loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        loop.call(control.pause).result(10)  # all n start in the same step
        sinks = [loop.submit([(list(IDS[i % len(IDS)]), SamplingParams(temperature=0, max_tokens=6,
                                                                        ignore_eos=True))]) for i in range(n)]
        loop.call(control.resume).result(10)
        tokens: list[list[int]] = [[] for _ in range(n)]
        for i, sink in enumerate(sinks):
            while not isinstance(ev := await sink.get(), Update) or not ev.finished:
                if isinstance(ev, Update):
                    tokens[i] += [t for d in ev.samples for t in d.token_ids]
            tokens[i] += [t for d in ev.samples for t in d.token_ids]
        return wakes[0], tokens

    try:
        wakes, tokens = asyncio.run(streams(8))
    finally:
        loop.stop()
    assert [len(t) for t in tokens] == [6] * 8
    assert wakes <= 8 + steps[0], (wakes, steps[0])  # one Accepted a request, then at most one a step


def test_a_lagging_stream_sends_what_arrived_together_in_one_write() -> None:
    """Updates that piled up while a stream's task waited (the HTTP side behind the engine) go out in one write, in
    order, each its own event with the same bytes as alone; a failure after them ends the stream with its error
    event, after theirs."""
    from moebius.entrypoints.openai.engine_loop import Accepted, EngineInfo, Failure, SampleDelta, Sink, Update
    from moebius.entrypoints.openai.protocol import APIError
    from moebius.entrypoints.openai.serving import Answer, Generation

    class Loop:  # what a Generation asks of the engine loop
        def submit(self, items: Any, param: str) -> Sink:
            return Sink(["r-0"])

        def abort(self, request_ids: list[str]) -> None:
            pass

    def token(t: int, last: bool = False) -> Update:
        return Update(0, [SampleDelta(0, [t], "", "length" if last else None, None)], last)

    async def stream(events: list[Any], together: bool) -> list[str]:
        gen = Generation(Loop(), [([1, 2], SamplingParams(max_tokens=3))], "prompt")  # type: ignore[arg-type]
        gen.sink.receive(Accepted(["r-0"], [[1, 2]]))
        await gen.start()
        writes = Answer(gen, chat=False, model="m", return_token_ids=True,
                        info=EngineInfo(None, 64, 256, 1)).stream(include_usage=True)
        out = []
        for ev in events:
            gen.sink.receive(ev)
            if not together and isinstance(ev, Update):
                out.append(await writes.__anext__())  # each read before the next arrives
        return out + [w async for w in writes]

    def events_of(writes: list[str]) -> list[Any]:
        return [json.loads(e[6:]) if e[6:] != "[DONE]" else e[6:] for w in writes for e in w.split("\n\n") if e]

    three = [token(5), token(6), token(7, last=True)]
    alone, together = (asyncio.run(stream(three, t)) for t in (False, True))
    assert len(alone) == 5 and all(w.startswith("data: ") and w.endswith("\n\n") for w in alone)  # + usage, [DONE]
    assert len(together) == 3 and together[0].count("data: ") == 3
    same = [{k: v for k, v in e.items() if k != "id"} if isinstance(e, dict) else e for e in events_of(together)]
    assert same == [{k: v for k, v in e.items() if k != "id"} if isinstance(e, dict) else e for e in events_of(alone)]
    got = events_of(alone)
    assert [e["choices"][0]["token_ids"] for e in got[:3]] == [[5], [6], [7]]
    assert got[0]["choices"][0]["prompt_token_ids"] == [1, 2] and got[3]["usage"]["completion_tokens"] == 3
    # a failure after two tokens that arrived with it: one write of both, then the error event, then [DONE]
    failed = asyncio.run(stream([token(5), token(6), Failure(APIError(500, "boom"))], together=True))
    assert len(failed) == 3 and failed[0].count("data: ") == 2
    got = events_of(failed)
    assert [e["choices"][0]["token_ids"] for e in got[:2]] == [[5], [6]] and got[3] == "[DONE]"
    assert got[2] == {"error": {"message": "boom", "type": "server_error", "param": None, "code": None}}


def test_engine_client_streams_aborts_and_counts(ref: LLM) -> None:
    """The HTTP side's EngineClient against an engine process: a stream's updates (each carrying only the text it
    adds) rebuild the offline text and tokens; an aborted stream leaves nothing behind; the counts go back to 0; an
    operator call runs there by name."""
    from moebius.config import EngineConfig
    from moebius.entrypoints.openai import control
    from moebius.entrypoints.openai.engine_loop import Accepted, Update
    from moebius.entrypoints.openai.engine_process import EngineClient
    from moebius.entrypoints.openai.serving import Choice

    client = EngineClient(EngineConfig(device="cpu"))
    client.start()

    async def run() -> tuple[list[int], str, int]:
        sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        whole = client.submit([(list(IDS[2]), sp)])
        gone = client.submit([(list(IDS[1]), SamplingParams(temperature=0, max_tokens=3000, ignore_eos=True))])
        assert isinstance(await whole.get(), Accepted) and isinstance(await gone.get(), Accepted)
        assert client.in_flight == 2
        while not isinstance(ev := await gone.get(), Update) or not ev.samples:
            pass
        client.abort(gone.request_ids)
        choice, updates = Choice(), 0
        while True:
            ev = await whole.get()
            assert isinstance(ev, Update)
            for d in ev.samples:
                choice.apply(d)
                updates += 1
            if ev.finished:
                return choice.tokens, choice.text, updates

    try:
        tokens, text, updates = asyncio.run(run())
        want = offline(ref, IDS[2], temperature=0, max_tokens=40, ignore_eos=True)
        assert tokens == want.token_ids and text == want.text and updates > 1
        assert client.call(control.status).result(30)["mode"] == "tp"
        deadline = time.monotonic() + 20
        while client.in_flight or client._sinks:  # the abort reached the engine; no sink is kept
            assert time.monotonic() < deadline, (client.in_flight, client._sinks)
            time.sleep(0.05)
        assert client.waiting == client.running == 0 and client.healthy
    finally:
        client.stop()
    assert not client.healthy


def test_an_engine_that_cannot_start_is_reported() -> None:
    """An engine the flags make impossible (8 experts over 3 ranks) fails in the engine process while it builds: the
    server exits with that error, as a start-up in its own process would."""
    run = subprocess.run([sys.executable, "-m", "moebius.entrypoints.cli", "serve", "--device", "cpu", "--port",
                          str(free_port()), "--num-ranks", "3"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "num_experts 8 is not divisible by 3 ranks" in run.stderr, run.stderr[-2000:]


# ---- the serve command line ----
def _serve_exit(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    """`moebius serve ARGV` run in this process (it must stop before starting anything): exit code, output."""
    from moebius.entrypoints.cli import main

    try:
        code = main(["serve", *argv])
    except SystemExit as e:  # argparse's own exits (a bad value, --help)
        code = int(e.code or 0)
    out = capsys.readouterr()
    return code, out.out + out.err


@pytest.mark.parametrize("flags, words", [
    (["--port", "99999"], ["--port", "1-65535", "99999"]), (["--port", "0"], ["--port", "1-65535", "0"]),
    (["--port", "-1"], ["--port", "-1"]), (["--port", "http"], ["--port", "'http'"]),
    (["--host", ""], ["--host", "''"]), (["--served-model-name", ""], ["--served-model-name", "''"]),
    (["--served-model-name", "  "], ["--served-model-name", "'  '"]),
    (["--admin-port", "9000"], ["--admin-port"]), (["--admin-host", "0.0.0.0"], ["--admin-host"]),
    (["--header-timeout", "0"], ["--header-timeout", "'0'"]), (["--header-timeout", "inf"], ["--header-timeout"]),
    (["--shutdown-timeout", "nan"], ["--shutdown-timeout", "'nan'"]),
    (["--shutdown-timeout", "-1"], ["--shutdown-timeout", "'-1'"]),
    (["--max-waiting-requests", "0"], ["--max-waiting-requests", "0"]),
    (["--api-key", ""], ["--api-key", "''"]),  # (the engine flags' checks, before the engine starts)
    (["--switch-high", "-5"], ["--switch-high", "-5"]),
])
def test_serve_refuses_bad_flags_before_starting(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                                                 flags: list[str], words: list[str]) -> None:
    """A port outside 1-65535 (99999 would listen on 34463), an empty model name, the offline engine's admin server
    (serve hosts /admin on --port) and other values serve cannot run with exit 2 naming the flag and the value."""
    from moebius.entrypoints.openai import engine_process

    def started(*args: Any, **kwargs: Any) -> None:
        raise AssertionError(f"serve started an engine with {flags}")

    monkeypatch.setattr(engine_process, "EngineClient", started)
    code, out = _serve_exit(capsys, "--device", "cpu", *flags)
    assert code == 2 and "Traceback" not in out, out
    assert all(w in out for w in words), out


def _help_entries(text: str) -> dict[str, str]:
    """An option's help text by its first flag (argparse's layout: an entry starts at a line "  -...")."""
    entries: dict[str, str] = {}
    flag = None
    for line in text.splitlines():
        if re.match(r"^  -", line):
            flag = line.split()[0].rstrip(",")
            entries[flag] = line
        elif flag is not None and line.startswith("    "):
            entries[flag] += " " + line.strip()
        else:
            flag = None
    return entries


def test_serve_help_states_each_default_once(capsys: pytest.CaptureFixture[str]) -> None:
    """`serve --help`: no "(default: None)" after a sentence saying what no value means, no default stated twice,
    and no option the command would then refuse (the offline engine's --admin-port / --admin-host)."""
    code, text = _serve_exit(capsys, "--help")
    assert code == 0
    entries = _help_entries(text)
    assert {"--port", "--served-model-name", "--disable-uvicorn-access-log", "--header-timeout", "--api-key",
            "--max-model-len"} <= set(entries), sorted(entries)
    assert not {"--admin-port", "--admin-host"} & set(entries)
    doubled = {f: t for f, t in entries.items() if len(re.findall(r"\bdefault\b", t, re.IGNORECASE)) > 1}
    assert not doubled, doubled
    assert "(default: None)" not in text and "(default: False)" not in text
    assert "(default: 8000)" in entries["--port"] and "'moebius-demo'" in entries["--served-model-name"]
    assert "every route but /health" in " ".join(text.split())


def test_access_log_is_on_by_default(server: Server) -> None:
    """Without --disable-uvicorn-access-log (test_http_catalogue.py serves with it), each request is logged."""
    assert server.get("/version").status_code == 200
    deadline = time.monotonic() + 5
    while '"GET /version HTTP/1.1" 200' not in server.output():
        assert time.monotonic() < deadline, server.tail()
        time.sleep(0.05)


# ---- clear errors ----
def test_json_routes_need_a_json_content_type(server: Server) -> None:
    """A body sent as text/plain, a form or with no Content-Type is a 415 saying so (FastAPI read it as bytes and
    answered that the JSON object was no object); application/json with a charset is fine, and the routes that take
    no body need none."""
    body = json.dumps({"prompt": "hi", "max_tokens": 1}).encode()
    for ctype in ("text/plain", None, "application/x-www-form-urlencoded", "application/jsonx"):
        headers = {**server.headers, **({"Content-Type": ctype} if ctype else {})}
        for path in (CMPL, "/admin/switch"):
            r = httpx.post(server.url + path, content=body, headers=headers, timeout=30)
            assert r.status_code == 415, (ctype, path, r.text)
            err = r.json()["error"]
            assert err["code"] == "unsupported_media_type" and err["type"] == "invalid_request_error"
            assert "application/json" in err["message"] and (repr(ctype) if ctype else "no Content-Type") in \
                err["message"], err
    r = httpx.post(server.url + CMPL, content=body, timeout=30,
                   headers={**server.headers, "Content-Type": "Application/JSON; charset=utf-8"})
    assert r.status_code == 200, r.text
    assert httpx.post(server.url + "/admin/resume", headers=server.headers, timeout=30).json() == {"paused": False}


def test_chat_message_without_content_is_refused(server: Server) -> None:
    """A user or system message whose content is null or missing is a 400 naming it (as the offline API refuses
    it), not an empty turn; an assistant turn without text (OpenAI's form for a tool call) is taken."""
    for messages, i in (([{"role": "user", "content": None}], 0),
                        ([{"role": "system"}, {"role": "user", "content": "hi"}], 0),
                        ([{"role": "user", "content": "hi"}, {"role": "user", "content": None}], 1)):
        r = server.post(CHAT, {"messages": messages, "max_tokens": 2})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "messages" and f"messages[{i}].content is null or missing" in err["message"], err
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None},
             {"role": "user", "content": "again"}]
    assert server.post(CHAT, {"messages": turns, "max_tokens": 2}).status_code == 200


# ---- log-probabilities ----
def test_streamed_text_offsets_run_on(server: Server) -> None:
    """A streamed completion's logprobs.text_offset continues from chunk to chunk: together they are the whole
    answer's offsets (each token's start in the text), not a fresh 0 in every chunk."""
    body = {"prompt": IDS[1], "logprobs": 1, **GREEDY}
    whole = server.post(CMPL, body).json()["choices"][0]["logprobs"]
    assert whole["text_offset"] == list(itertools.accumulate((len(t) for t in whole["tokens"][:-1]), initial=0))
    chunks = [ev["choices"][0]["logprobs"] for ev in server.stream(CMPL, body)
              if isinstance(ev, dict) and ev["choices"] and ev["choices"][0]["logprobs"]]
    assert len(chunks) > 1
    assert [o for c in chunks for o in c["text_offset"]] == whole["text_offset"]
    assert [t for c in chunks for t in c["tokens"]] == whole["tokens"]


def test_chat_logprob_bytes_are_the_tokens_own(server: Server, ref: LLM) -> None:
    """Chat logprobs' `bytes` are the token's own bytes: a byte token that is part of a UTF-8 character gives its
    raw byte (the demo model's tokens 128-255), not the bytes of the "\ufffd" its text decodes to."""
    tok = ref.tokenizer
    assert tok is not None
    byte_of = {c: b for b, c in _bytes_to_unicode().items()}

    def own(t: int) -> list[int]:
        if t in tok.all_special_ids:
            return list(tok.decode([t], skip_special_tokens=False).encode())
        piece = tok.id_to_token(t)
        assert piece is not None
        return [byte_of[c] for c in piece]

    r = server.post(CHAT, {
        "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "return_token_ids": True, **GREEDY})
    choice = r.json()["choices"][0]
    ids, content = choice["token_ids"], choice["logprobs"]["content"]
    assert any(128 <= t < 256 for t in ids), ids  # the case at stake: a lone byte of a multi-byte character
    assert [c["bytes"] for c in content] == [own(t) for t in ids]
    assert bytes(b for c in content for b in c["bytes"]).decode("utf-8", "replace") == choice["message"]["content"]


# ---- served from this process: a request that fails; two ranks' policy and what the ranks expose ----
@contextlib.contextmanager
def served_here(**flags: Any) -> Iterator[tuple[str, Any]]:
    """An engine with these flags behind the app, served from this process as `moebius serve` configures uvicorn
    (so a test can patch what runs in it): the URL and the engine."""

    from moebius.config import EngineConfig
    from moebius.entrypoints.openai.app import ServeSettings, create_app
    from moebius.entrypoints.openai.engine_loop import EngineLoop
    from moebius.entrypoints.openai.server import uvicorn_config
    from moebius.frontend.core import EngineCore

    engine = EngineCore(EngineConfig(device="cpu", **flags))
    loop = EngineLoop(engine)
    loop.start()
    port = free_port()
    try:
        with uvicorn_thread(uvicorn_config(create_app(loop, ServeSettings("moebius-demo")), "127.0.0.1", port,
                                           access_log=False)):
            yield f"http://127.0.0.1:{port}", engine
    finally:
        loop.stop()


@contextlib.contextmanager
def uvicorn_thread(config: Any) -> Iterator[threading.Thread]:
    """A uvicorn server with this config run in a thread of this process, started; stopped on the way out."""
    import uvicorn

    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        yield thread
    finally:
        server.should_exit = True
        thread.join(30)


def test_a_request_that_fails_is_a_500_and_the_server_serves_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """A request the engine ends with finish_reason "error" (here: its sampling values fail on the rank, as a seed
    outside int64 did) is a 500 naming why, an error event in a stream, and its other prompts stop; the next request
    gets the tokens it got before."""
    from test_offline_catalogue import fail_sampling_for_seed

    fail_sampling_for_seed(monkeypatch, 666)
    good = {"prompt": IDS[1], **GREEDY, "return_token_ids": True}
    bad = {"prompt": [IDS[1], IDS[2]], "temperature": 0.9, "seed": 666, "max_tokens": 8}
    with served_here(rank_process="off") as (url, engine):
        before = httpx.post(url + CMPL, json=good, timeout=60).json()["choices"][0]["token_ids"]
        r = httpx.post(url + CMPL, json=bad, timeout=60)
        assert r.status_code == 500, r.text
        err = r.json()["error"]
        assert err["code"] == "generation_error" and "OverflowError: Overflow when unpacking long long" in \
            err["message"], err
        with httpx.stream("POST", url + CMPL, json={**bad, "stream": True}, timeout=60) as s:
            events = [ln.removeprefix("data: ") for ln in s.iter_lines() if ln.startswith("data: ")]
        assert events[-1] == "[DONE]" and "OverflowError" in json.loads(events[-2])["error"]["message"], events
        assert httpx.post(url + CMPL, json=good, timeout=60).json()["choices"][0]["token_ids"] == before
        assert not engine.has_unfinished()


@pytest.fixture(scope="module")
def two_ranks() -> Iterator[tuple[str, Any]]:
    """Two spawned CPU ranks behind the app, served from this process."""
    with served_here(num_ranks=2, mode="tp") as served:
        yield served


def test_policy_changes_only_the_fields_given(two_ranks: tuple[str, Any]) -> None:
    """POST /admin/policy keeps the settings in effect (the last applied, or the engine's flags) and changes only
    those it is given: a second POST no longer resets the first's. A refused body (a negative, infinite or NaN
    threshold, a window of 0, low above high) is a 400 naming the field and changes nothing."""
    url = two_ranks[0]

    def post(body: dict[str, Any] | bytes) -> Any:
        if isinstance(body, bytes):
            return httpx.post(url + "/admin/policy", content=body, timeout=60,
                              headers={"Content-Type": "application/json"})
        return httpx.post(url + "/admin/policy", json=body, timeout=60)

    def status() -> dict[str, Any]:
        return httpx.get(url + "/admin/status", timeout=30).json()

    r = post({"policy": "threshold", "high": 6, "low": 2, "window": 3, "cooldown": 0.5})
    assert r.status_code == 200, r.text
    assert r.json()["settings"] == {"policy": "threshold", "profile": "interactive", "high": 6, "low": 2,
                                    "window": 3, "cooldown": 0.5}
    r = post({"low": 4})  # T_l only: T_h, W and C stay as the first call set them
    assert r.status_code == 200, r.text
    kept = "TP -> EP above 6 in flight, EP -> TP below a mean 4 over 3 steps, cooldown 0.5 s"
    assert kept in r.json()["policy"] and status()["policy"] == r.json()["policy"]
    assert post({"policy": "off"}).json() == {"policy": None} and status()["policy"] is None
    r = post({"cooldown": 1})  # on again: the kept settings, the cooldown changed
    assert r.status_code == 200, r.text
    note = r.json()["policy"]
    assert "TP -> EP above 6 in flight, EP -> TP below a mean 4 over 3 steps, cooldown 1 s" in note
    for body, field, words in (
            ({"high": 3}, None, ["low 4", "high 3"]), ({"high": -5}, "high", ["high", "-5"]),
            ({"low": -0.5}, "low", ["low", "-0.5"]), ({"cooldown": -1}, "cooldown", ["cooldown", "-1"]),
            ({"window": 0}, "window", ["window", "0"]), ({"window": 2.5}, "window", ["window", "2.5"]),
            ({"high": "8"}, "high", ["high", '"8"']), ({"policy": "sometimes"}, "policy", ["policy", "sometimes"]),
            ({"profile": "batch"}, "profile", ["profile", "batch"]), ({"hihg": 8}, "hihg", ["hihg"]),
            ({"policy": "off", "high": 8}, None, ["off", "high"]),
            (b'{"low": 1e999}', "low", ["low", "finite", "Infinity"]), (b'{"high": NaN}', "high", ["high", "NaN"]),
            (b'{"cooldown": -Infinity}', "cooldown", ["cooldown", "finite"])):
        r = post(body)
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert err["param"] == field and all(w in err["message"] for w in words), (body, err)
    assert status()["policy"] == note  # nothing refused changed the policy
    assert post({"policy": "off"}).json() == {"policy": None}


def _listening(pid: int) -> list[str]:
    """The local addresses ("ip:port") of the TCP sockets process `pid` listens on (from /proc)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            if link.startswith("socket:["):
                inodes.add(link[len("socket:["):-1])
    found = []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in itertools.islice(f, 1, None):
                local, state, inode = (line.split()[i] for i in (1, 3, 9))
                if state == "0A" and inode in inodes:  # 0A: LISTEN
                    ip, port = local.split(":")
                    raw = bytes.fromhex(ip)  # host-order 32-bit words
                    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                    found.append(f"{ipaddress.ip_address(raw)}:{int(port, 16)}")
    return found


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads the rank processes' sockets from /proc")
def test_rank_processes_listen_on_the_loopback_only(two_ranks: tuple[str, Any]) -> None:
    """Spawned ranks meet at a rendezvous store that listens on 127.0.0.1 (torch's TCPStore server, given only a
    port, listened on every interface while the HTTP server binds the loopback); their gloo pairs too."""
    engine = two_ranks[1]
    pids = [p.pid for p in engine.ranks._procs]
    assert len(pids) == 2
    found = {pid: _listening(pid) for pid in pids}
    assert found[pids[0]], found  # rank 0 serves the store
    assert all(a.startswith("127.0.0.1:") for addrs in found.values() for a in addrs), found


TWO_RANKS_SCRIPT = """
from moebius import LLM, SamplingParams

with LLM(device="cpu", num_ranks=2, mode="tp") as llm:
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2)
    llm.generate([[1, 2, 3], [4, 5]], sp)
    assert llm.switch_mode("ep").done
    llm.generate([[1, 2, 3], [4, 5]], sp)
    assert llm.switch_mode("tp").done
print("ok")
"""


def test_two_ranks_warn_nothing_deprecated() -> None:
    """A 2-rank CPU engine (both layouts and a switch each way) run with every warning shown, ranks included: torch
    warns of nothing deprecated (the collectives under their current names, as torch 2.13 has them)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.run([sys.executable, "-W", "default", "-c", TWO_RANKS_SCRIPT], capture_output=True, text=True,
                         timeout=180, cwd=root)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-4000:]
    warned = [line for line in run.stderr.splitlines()
              if re.search(r"(Deprecation|Future)Warning", line) and "torch" in line]
    assert not warned, warned
