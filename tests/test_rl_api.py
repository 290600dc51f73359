"""The RL trainers' HTTP API (`moebius serve`), spoken to with only the documented payloads (httpx): SGLang's
/generate (its greedy tokens equal the offline API's; meta_info's finish reason object, token counts,
output_token_logprobs as [logprob, token_id, text], weight_version; streamed), /pause_generation (an empty body:
abort) with a long /generate in flight (its partial tokens, finish_reason {"type": "abort"}), /continue_generation,
/abort_request, /flush_cache, /update_weights_from_disk to checkpoint B (then B's tokens, /get_weight_version,
/metrics and /admin/status name the version), and vLLM's /pause?mode=, /resume, /is_paused, /reset_prefix_cache,
/abort_requests; bad payloads are a 4xx naming the field and change nothing; every route wants the API key.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from conftest import PROMPTS, Checkpoints, shared_llm  # noqa: E402
from test_serve import Server  # noqa: E402

from moebius import SamplingParams  # noqa: E402

N = 8
IDS = PROMPTS[1:3]  # 5 and 17 tokens
LONG = 400  # max_new_tokens of a generation a pause catches in flight (the context is 512)


@pytest.fixture(scope="module")
def server(ckpt: Checkpoints, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = Server(tmp_path_factory.mktemp("rl"), "--model", ckpt("base"), "--dtype", "float32", "--block-size", "16",
               "--max-total-tokens", "4096", "--seed", "0")
    yield s
    assert s.close() == 0, s.tail()


def offline(path: str, ids: list[int], n: int = N, **kw: Any) -> Any:
    return shared_llm(path).generate([ids], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw))[0]


def gen(server: Server, body: dict[str, Any], **kw: Any) -> Any:
    r = server.post("/generate", body, **kw)
    assert r.status_code == 200, r.text
    return r.json()


def greedy(n: int = N, **kw: Any) -> dict[str, Any]:
    return {"max_new_tokens": n, "temperature": 0, "ignore_eos": True, **kw}


def test_generate_equals_offline(server: Server, ckpt: Checkpoints) -> None:
    a = ckpt("base")
    want = [offline(a, ids, logprobs=0) for ids in IDS]
    one = gen(server, {"input_ids": IDS[0], "sampling_params": greedy(), "return_logprob": True, "rid": "q1",
                       "logprob_start_len": len(IDS[0])})  # (from the prompt's end: the output's tokens only)
    assert one["output_ids"] == want[0].outputs[0].token_ids
    meta = one["meta_info"]
    assert meta["id"] == "q1" and meta["finish_reason"] == {"type": "length", "length": N}
    assert meta["prompt_tokens"] == len(IDS[0]) and meta["completion_tokens"] == N
    assert meta["weight_version"] is None
    lps = meta["output_token_logprobs"]
    assert [t for _, t, _ in lps] == one["output_ids"] and all(text is None for _, _, text in lps)
    for (lp, t, _), ref in zip(lps, want[0].outputs[0].logprobs, strict=True):
        assert lp == pytest.approx(ref[t], abs=1e-4)
    batch = gen(server, {"input_ids": IDS, "sampling_params": greedy()})
    assert isinstance(batch, list) and [b["output_ids"] for b in batch] == [w.outputs[0].token_ids for w in want]
    # n samples of one prompt: a list, each its own id, the offline API's seeded samples
    seeded = {"max_new_tokens": N, "temperature": 0.8, "sampling_seed": 7, "n": 2, "ignore_eos": True}
    two = gen(server, {"input_ids": IDS[0], "sampling_params": seeded, "rid": "s"})
    ref2 = shared_llm(a).generate([IDS[0]], SamplingParams(max_tokens=N, temperature=0.8, seed=7, n=2,
                                                            ignore_eos=True))[0]
    assert [x["output_ids"] for x in two] == [o.token_ids for o in ref2.outputs]
    assert [x["meta_info"]["id"] for x in two] == ["s-0", "s-1"]
    # a stop token: finish_reason names the token matched, the tokens are the offline API's
    stop = want[1].outputs[0].token_ids[2]
    got = gen(server, {"input_ids": IDS[1], "sampling_params": greedy(stop_token_ids=[stop])})
    ref = offline(a, IDS[1], stop_token_ids=[stop]).outputs[0]
    assert got["output_ids"] == ref.token_ids and got["meta_info"]["finish_reason"] == {"type": "stop",
                                                                                      "matched": stop}


def test_generate_streamed(server: Server) -> None:
    whole = gen(server, {"input_ids": IDS[1], "sampling_params": greedy()})
    events = list(server.stream("/generate", {"input_ids": IDS[1], "sampling_params": greedy()}))
    assert events[-1] == "[DONE]" and len(events) > 2
    chunks = [e for e in events[:-1] if isinstance(e, dict)]
    assert chunks[-1]["output_ids"] == whole["output_ids"]  # each event: everything so far
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": N}
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])


def test_generate_batch_streamed(server: Server, ckpt: Checkpoints) -> None:
    events = list(server.stream("/generate", {"input_ids": IDS, "sampling_params": greedy()}))
    assert events[-1] == "[DONE]"
    last = {e["index"]: e for e in events[:-1] if isinstance(e, dict)}
    assert [last[i]["output_ids"] for i in range(2)] == [offline(ckpt("base"), ids).outputs[0].token_ids
                                                         for ids in IDS]


def _wait_running(server: Server, n: int = 1) -> None:
    deadline = time.monotonic() + 30
    while server.get("/admin/status").json()["running"] < n:
        assert time.monotonic() < deadline
        time.sleep(0.01)


def _long(server: Server, rid: str, box: dict[str, Any]) -> threading.Thread:
    """A long greedy /generate in a thread; its answer into box[rid]."""
    def run() -> None:
        box[rid] = server.post("/generate", {"input_ids": IDS[0], "rid": rid, "sampling_params": greedy(LONG)},
                               timeout=120)

    t = threading.Thread(target=run)
    t.start()
    return t


def test_pause_abort_returns_partial_tokens(server: Server, ckpt: Checkpoints) -> None:
    box: dict[str, Any] = {}
    t = _long(server, "long", box)
    _wait_running(server)
    r = httpx.post(server.url + "/pause_generation", headers=server.headers, timeout=60)  # no body: mode abort
    assert r.status_code == 200, r.text
    t.join(60)
    out = box["long"].json()
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    got = out["output_ids"]
    assert 0 < len(got) < LONG and out["meta_info"]["completion_tokens"] == len(got)
    assert got == offline(ckpt("base"), IDS[0], len(got)).outputs[0].token_ids
    assert server.get("/is_paused").json() == {"is_paused": True}
    # while paused a request waits; /continue_generation (empty body) lets it run
    box2: dict[str, Any] = {}
    t2 = threading.Thread(target=lambda: box2.update(r=server.post("/generate", {"input_ids": IDS[1],
                                                                                 "sampling_params": greedy()})))
    t2.start()
    time.sleep(0.5)
    assert t2.is_alive() and server.get("/admin/status").json()["waiting"] == 1
    assert httpx.post(server.url + "/continue_generation", headers=server.headers, timeout=60).status_code == 200
    t2.join(60)
    assert box2["r"].json()["output_ids"] == offline(ckpt("base"), IDS[1]).outputs[0].token_ids
    assert server.get("/is_paused").json() == {"is_paused": False}


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_pause_retract_or_keep_then_continue_gives_the_same_tokens(server: Server, ckpt: Checkpoints,
                                                                     mode: str) -> None:
    box: dict[str, Any] = {}
    t = _long(server, f"long-{mode}", box)
    _wait_running(server)
    assert server.post("/pause_generation", {"mode": mode}).status_code == 200
    st = server.get("/admin/status").json()
    assert st["paused"] is True and t.is_alive()
    if mode == "retract":
        assert st["kv"]["free_tokens"] == st["kv"]["total_tokens"]  # its KV freed: it recomputes after continue
    assert server.post("/continue_generation", {}).status_code == 200
    t.join(120)
    out = box[f"long-{mode}"].json()
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": LONG}
    assert out["output_ids"] == offline(ckpt("base"), IDS[0], LONG).outputs[0].token_ids


def test_abort_request_by_rid_and_vllm_names(server: Server, ckpt: Checkpoints) -> None:
    box: dict[str, Any] = {}
    t = _long(server, "mine", box)
    _wait_running(server)
    assert server.post("/abort_request", {"rid": "mine"}).json() == {"aborted": 1}
    t.join(60)
    assert box["mine"].json()["meta_info"]["finish_reason"]["type"] == "abort"
    t = _long(server, "theirs", box)
    _wait_running(server)
    assert server.post("/abort_requests", {"request_ids": ["theirs"]}).json() == {"aborted": 1}
    t.join(60)
    assert box["theirs"].json()["meta_info"]["finish_reason"]["type"] == "abort"
    for path, body in (("/abort_request", {"abort_all": True}), ("/abort_requests", {})):
        t = _long(server, "all", box)
        _wait_running(server)
        assert server.post(path, body).json() == {"aborted": 1}
        t.join(60)
        assert box["all"].json()["meta_info"]["finish_reason"]["type"] == "abort"
    # vLLM's mode wait: /pause answers once the generation in flight has finished
    t = _long(server, "waited", box)
    _wait_running(server)
    r = httpx.post(server.url + "/pause?mode=wait", headers=server.headers, timeout=120)
    assert r.status_code == 200, r.text
    t.join(30)
    assert box["waited"].json()["meta_info"]["finish_reason"] == {"type": "length", "length": LONG}
    assert server.get("/is_paused").json() == {"is_paused": True}
    assert httpx.post(server.url + "/resume", headers=server.headers, timeout=60).status_code == 200
    # vLLM's pause / is_paused / resume (its clear_cache on by default: the prefix cache's pages dropped); the prefix
    # cache flushed under both names
    gen(server, {"input_ids": IDS[1], "sampling_params": greedy()})  # its prompt's full page cached
    assert server.post("/reset_prefix_cache").json()["pages"] > 0
    gen(server, {"input_ids": IDS[1], "sampling_params": greedy()})
    r = httpx.post(server.url + "/pause?mode=keep", headers=server.headers, timeout=60)
    assert r.status_code == 200 and server.get("/is_paused").json() == {"is_paused": True}
    assert server.post("/reset_prefix_cache").json()["pages"] == 0  # /pause cleared it
    assert httpx.post(server.url + "/resume", headers=server.headers, timeout=60).status_code == 200
    assert server.get("/is_paused").json() == {"is_paused": False}
    assert server.post("/reset_prefix_cache").status_code == 200
    r = server.get("/flush_cache")
    assert r.status_code == 200 and r.text.startswith("Cache flushed")
    assert server.post("/flush_cache").status_code == 200
    assert gen(server, {"input_ids": IDS[1], "sampling_params": greedy()})["output_ids"] == \
        offline(ckpt("base"), IDS[1]).outputs[0].token_ids


def test_retract_update_continue_finishes_on_the_new_weights(server: Server, ckpt: Checkpoints) -> None:
    """A trainer's step: pause (retract) with a generation in flight, update to B, continue: the answer is A's tokens
    up to the pause, then B's continuation of prompt + those (a fresh engine on B), under B's version."""
    a, b = ckpt("base"), ckpt("base_b")
    box: dict[str, Any] = {}
    t = _long(server, "rl-step", box)
    _wait_running(server)
    try:
        assert server.post("/pause_generation", {"mode": "retract"}).status_code == 200
        r = server.post("/update_weights_from_disk", {"model_path": b, "weight_version": "B-r"})
        assert r.status_code == 200, r.text
        assert server.post("/continue_generation").status_code == 200
        t.join(120)
    finally:
        server.post("/continue_generation")
        assert server.post("/update_weights_from_disk", {"model_path": a, "weight_version": "A"}).status_code == 200
    out = box["rl-step"].json()
    assert out["meta_info"]["weight_version"] == "B-r"
    got, on_a = out["output_ids"], offline(a, IDS[0], LONG).outputs[0].token_ids
    k = next(i for i, (x, y) in enumerate(zip(got, on_a, strict=True)) if x != y)  # where A's tokens end
    assert k > 0
    assert got[k:] == offline(b, IDS[0] + got[:k], LONG - k).outputs[0].token_ids


class _Here(Server):
    """A server started by test_serve.served_here (no API key), spoken to as a Server."""

    def __init__(self, url: str) -> None:
        self.url, self.headers = url, {}


def test_trainer_step_on_two_ranks_in_ep(ckpt: Checkpoints) -> None:
    """The trainer's step above with two spawned ranks in EP (each retracts its own requests)."""
    from test_serve import served_here

    with served_here(model=ckpt("base"), num_ranks=2, mode="ep", dtype="float32", block_size=16,
                     max_total_tokens=4096, seed=0) as (url, _):
        test_retract_update_continue_finishes_on_the_new_weights(_Here(url), ckpt)


def test_abort_while_paused_answers_and_frees_the_kv(server: Server) -> None:
    box: dict[str, Any] = {}
    t = _long(server, "held", box)
    _wait_running(server)
    assert server.post("/pause_generation", {"mode": "keep"}).status_code == 200
    st = server.get("/admin/status").json()
    assert st["kv"]["free_tokens"] < st["kv"]["total_tokens"]
    assert server.post("/abort_request", {"abort_all": True}).json() == {"aborted": 1}
    t.join(60)
    assert box["held"].json()["meta_info"]["finish_reason"]["type"] == "abort"
    st = server.get("/admin/status").json()
    assert st["paused"] is True and st["in_flight"] == 0
    assert st["kv"]["free_tokens"] == st["kv"]["total_tokens"]  # freed with no step to do it
    assert server.post("/continue_generation").status_code == 200


def _metric_lines(server: Server) -> list[str]:
    return [ln for ln in server.get("/metrics").text.splitlines() if ln.startswith("moebius:weight_version{")]


def test_update_weights_from_disk(server: Server, ckpt: Checkpoints) -> None:
    a, b = ckpt("base"), ckpt("base_b")
    try:
        r = server.post("/update_weights_from_disk", {"model_path": b, "weight_version": "B-1"})
        assert r.status_code == 200 and r.json()["success"] is True, r.text
        assert server.get("/get_weight_version").json() == {"weight_version": "B-1"}
        out = gen(server, {"input_ids": IDS[1], "sampling_params": greedy()})
        assert out["output_ids"] == offline(b, IDS[1]).outputs[0].token_ids
        assert out["meta_info"]["weight_version"] == "B-1"
        assert server.get("/admin/status").json()["weight_version"] == "B-1"
        assert any('version="B-1"' in ln and ln.endswith(" 1.0") for ln in _metric_lines(server))
        assert not any('version=""' in ln for ln in _metric_lines(server))
    finally:
        r = server.post("/update_weights_from_disk", {"model_path": a, "weight_version": "A-2",
                                                       "flush_cache": True, "abort_all_requests": True})
        assert r.status_code == 200, r.text
    # no version given: the weights change, the version stays (as SGLang)
    assert server.post("/update_weights_from_disk", {"model_path": a}).status_code == 200
    assert server.get("/get_weight_version").json() == {"weight_version": "A-2"}
    assert gen(server, {"input_ids": IDS[1], "sampling_params": greedy()})["output_ids"] == \
        offline(a, IDS[1]).outputs[0].token_ids


BAD: list[tuple[str, Any, int, str]] = [  # (path, body, status, a word the message must hold)
    ("/generate", {"input_ids": IDS[0], "text": "hi", "sampling_params": greedy()}, 400, "exactly one"),
    ("/generate", {"sampling_params": greedy()}, 400, "exactly one"),
    ("/generate", {"input_ids": []}, 400, "input_ids"),
    ("/generate", {"input_ids": [[1, 2], []]}, 400, "input_ids"),
    ("/generate", {"input_ids": ["a"]}, 400, "input_ids"),
    ("/generate", {"input_ids": [10**9]}, 400, "vocabulary"),
    ("/generate", {"text": "hello"}, 400, "tokenizer"),
    ("/generate", {"input_ids": IDS[0], "sampling_params": {"max_tokens": 4}}, 400, "sampling_params.max_tokens"),
    ("/generate", {"input_ids": IDS[0], "sampling_params": {"temperature": -1}}, 400, "sampling_params.temperature"),
    ("/generate", {"input_ids": IDS[0], "sampling_params": {"top_p": 0}}, 400, "sampling_params.top_p"),
    ("/generate", {"input_ids": IDS[0], "sampling_params": {"max_new_tokens": 100000}}, 400, "max_new_tokens"),
    ("/generate", {"input_ids": IDS[0], "sampling_params": {"repetition_penalty": 1.2}}, 400, "repetition_penalty"),
    ("/generate", {"input_ids": IDS[1], "sampling_params": {"max_new_tokens": 500}}, 400, "max_new_tokens is 500"),
    ("/generate", {"input_ids": IDS, "sampling_params": [greedy()]}, 400, "sampling_params"),
    ("/generate", {"input_ids": IDS, "sampling_params": [greedy(), greedy(repetition_penalty=2.0)]}, 400,
     "sampling_params[1].repetition_penalty"),
    ("/generate", {"input_ids": IDS, "rid": ["x", "x"]}, 400, "rid"),
    ("/generate", {"input_ids": IDS[0], "return_logprob": "yes"}, 400, "return_logprob"),
    ("/generate", {"input_ids": IDS[0], "bogus": 1}, 400, "bogus"),
    ("/generate", {"input_ids": IDS[0], "return_logprob": True, "logprob_start_len": 0}, 400, "logprob_start_len"),
    ("/pause_generation", {"mode": "sleep"}, 400, "mode"),
    ("/pause_generation", {"mode": 1}, 400, "mode"),
    ("/pause_generation", {"mood": "abort"}, 400, "mood"),
    ("/continue_generation", {"torch_empty_cache": "no"}, 400, "torch_empty_cache"),
    ("/abort_request", {}, 400, "rid"),
    ("/abort_request", {"rid": "x", "abort_all": True}, 400, "rid"),
    ("/abort_requests", {"request_ids": "r1"}, 400, "request_ids"),
    ("/pause?clear_cache=maybe", {}, 400, "clear_cache"),
    ("/update_weights_from_disk", {}, 400, "model_path"),
    ("/update_weights_from_disk", {"model_path": "/nonexistent/ckpt"}, 400, "/nonexistent/ckpt"),
    ("/update_weights_from_disk", {"model_path": "/tmp", "weight_version": 3}, 400, "weight_version"),
    ("/update_weights_from_disk", {"model_path": "/tmp", "load_format": "gguf"}, 400, "load_format"),
]


def test_bad_payloads_are_4xx_naming_the_field_and_change_nothing(server: Server, ckpt: Checkpoints) -> None:
    before = server.get("/get_weight_version").json()
    want = offline(ckpt("base"), IDS[1]).outputs[0].token_ids
    for path, body, status, word in BAD:
        r = server.post(path, body)
        assert r.status_code == status, (path, body, r.text)
        err = r.json()["error"]
        assert word in err["message"] or word == err["param"], (path, body, err)
    # a body that is not JSON on a JSON route: 415 naming the Content-Type
    r = httpx.post(server.url + "/generate", content=b"input_ids=1", timeout=30,
                   headers={**server.headers, "Content-Type": "application/x-www-form-urlencoded"})
    assert r.status_code == 415
    r = httpx.post(server.url + "/pause_generation", content=b"{not json", timeout=30,
                   headers={**server.headers, "Content-Type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/pause?mode=sleep", headers=server.headers, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "mode" and "'sleep'" in r.text
    # nothing changed: not paused, the same weights and version, the same tokens
    assert server.get("/is_paused").json() == {"is_paused": False}
    assert server.get("/get_weight_version").json() == before
    assert gen(server, {"input_ids": IDS[1], "sampling_params": greedy()})["output_ids"] == want


def test_release_and_resume_memory_over_http(server: Server, ckpt: Checkpoints) -> None:
    """SGLang's /release_memory_occupation and /resume_memory_occupation, vLLM's /sleep, /wake_up and /is_sleeping:
    a /generate sent while released waits and ends after the resume with the tokens it would have had; dropped
    weights come back through an update; an update while the weights are released, or a KV release with a request
    in flight, is a 409 that changes nothing; bad tags and levels are 400s."""
    want = [offline(ckpt("base"), ids).outputs[0].token_ids for ids in IDS]
    r = server.post("/release_memory_occupation", raw=b"")
    assert r.status_code == 200 and r.json()["success"] and r.json()["nbytes"] > 0, r.text
    assert server.get("/is_sleeping").json() == {"is_sleeping": True}
    assert server.get("/admin/status").json()["memory_released"] == ["kv_cache", "weights"]
    box: dict[str, Any] = {}
    t = threading.Thread(target=lambda: box.update(r=server.post("/generate", {"input_ids": IDS[0],
                                                                                "sampling_params": greedy()})))
    t.start()
    t.join(1.0)
    assert t.is_alive()  # held: no step runs while the memory is released
    r = server.post("/resume_memory_occupation", {"tags": ["weights", "kv_cache"]})
    assert r.status_code == 200 and r.json()["success"], r.text
    t.join(60)
    assert box["r"].status_code == 200 and box["r"].json()["output_ids"] == want[0]
    assert server.get("/is_sleeping").json() == {"is_sleeping": False}

    r = httpx.post(server.url + "/sleep?level=2", headers=server.headers, timeout=60)
    assert r.status_code == 200 and r.json()["host_bytes"] == 0, r.text
    r = server.post("/update_weights_from_disk", {"model_path": ckpt("base")})
    assert r.status_code == 409 and "resume_memory_occupation" in r.json()["message"], r.text
    r = httpx.post(server.url + "/wake_up?tags=weights&tags=kv_cache", headers=server.headers, timeout=60)
    assert r.status_code == 200, r.text
    assert server.post("/update_weights_from_disk", {"model_path": ckpt("base")}).status_code == 200
    assert gen(server, {"input_ids": IDS[1], "sampling_params": greedy()})["output_ids"] == want[1]

    box = {}
    t = _long(server, "held", box)
    _wait_running(server)
    r = server.post("/release_memory_occupation", {"tags": ["kv_cache"]})
    assert r.status_code == 409 and "1 request(s) in flight" in r.json()["message"], r.text
    for body, word in [({"tags": ["gpu"]}, "'gpu'"), ({"tags": "weights"}, "tags"), ({"keep_weights": "no"},
                                                                                     "keep_weights")]:
        r = server.post("/release_memory_occupation", body)
        assert r.status_code == 400 and word in r.text, (body, r.text)
    r = httpx.post(server.url + "/sleep?level=3", headers=server.headers, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "level"
    assert server.get("/is_sleeping").json() == {"is_sleeping": False}
    server.post("/abort_request", {"abort_all": True})
    t.join(60)


@pytest.mark.parametrize("method,path", [("POST", "/generate"), ("POST", "/pause_generation"),
                                         ("POST", "/continue_generation"), ("POST", "/abort_request"),
                                         ("GET", "/flush_cache"), ("GET", "/get_weight_version"),
                                         ("POST", "/update_weights_from_disk"), ("POST", "/pause"),
                                         ("POST", "/resume"), ("GET", "/is_paused"), ("POST", "/reset_prefix_cache"),
                                         ("POST", "/abort_requests"), ("POST", "/release_memory_occupation"),
                                         ("POST", "/resume_memory_occupation"), ("POST", "/sleep"),
                                         ("POST", "/wake_up"), ("GET", "/is_sleeping")])
def test_every_route_wants_the_api_key(server: Server, method: str, path: str) -> None:
    r = httpx.request(method, server.url + path, json={}, timeout=30)
    assert r.status_code == 401 and json.loads(r.text)["error"]["code"] == "invalid_api_key"
    assert server.get("/is_paused").json() == {"is_paused": False}


def test_text_prompts_logprob_text_and_stop_strings(ckpt: Checkpoints) -> None:
    """With a tokenizer (the engine loop in this process): text in, the offline API's text and tokens out, each
    token's text with return_text_in_logprobs, the top log-probabilities, and a stop string as the match."""
    from test_serve import served_here

    path = ckpt("text")
    ref = shared_llm(path)
    with served_here(model=path, dtype="float32", block_size=16, max_total_tokens=4096, seed=0) as (url, _):
        def post(body: dict[str, Any]) -> Any:
            r = httpx.post(url + "/generate", json=body, timeout=60)
            assert r.status_code == 200, r.text
            return r.json()

        sp = {"max_new_tokens": N, "temperature": 0}
        want = ref.generate(["Hello"], SamplingParams(max_tokens=N, temperature=0.0, logprobs=2))[0].outputs[0]
        out = post({"text": "Hello", "sampling_params": sp, "return_logprob": True, "return_text_in_logprobs": True,
                    "top_logprobs_num": 2})
        assert out["text"] == want.text and out["output_ids"] == want.token_ids
        meta = out["meta_info"]
        assert "".join(text for _, _, text in meta["output_token_logprobs"]) == out["text"]
        assert len(meta["output_top_logprobs"]) == len(out["output_ids"])
        for top, lps in zip(meta["output_top_logprobs"], want.logprobs, strict=True):
            assert len(top) == 2 and top[0][0] >= top[1][0]
            assert top[0][0] == pytest.approx(max(lps.values()), abs=1e-4)
        stop = want.text[2:4]
        got = post({"text": "Hello", "sampling_params": {**sp, "stop": stop}})
        ref_stop = ref.generate(["Hello"], SamplingParams(max_tokens=N, temperature=0.0, stop=stop))[0].outputs[0]
        assert got["text"] == ref_stop.text and got["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


def test_an_update_crosses_the_engine_process_pipe_whole() -> None:
    """The engine process packs each Update as tuples: the weight version and a failed sample's error come through."""
    from moebius.entrypoints.openai.engine_loop import SampleDelta, Update
    from moebius.entrypoints.openai.engine_process import _pack, _unpack

    upd = Update(1, [SampleDelta(0, [5, 6], "ab", "error", None, [{5: -0.1}, {6: -0.2}], 3, "why it failed")], True,
                 "step-7")
    assert _unpack(_pack(upd)) == upd
