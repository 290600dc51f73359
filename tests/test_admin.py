"""The operator's switch: POST /admin/switch on a running engine switches layouts between two steps, with the same
outcome and the same tokens as LLM.switch_mode; the API key is enforced; bad bodies get a clear 4xx in the shape
`moebius serve` answers with, naming what is wrong; a client that never finishes its request is dropped."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import pytest

from moebius import LLM, SamplingParams

PROMPTS = [[5, 6, 7, 8], [1, 2, 3], list(range(10, 40))]


def _post(port: int, body: bytes, key: str | None = None, content_type: str | None = "application/json",
          path: str = "/admin/switch") -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body, method="POST",
                                 headers={**headers, **({"Content-Type": content_type} if content_type else {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_admin_switch_between_steps_keeps_tokens() -> None:
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with LLM() as llm:
        want = [o.token_ids for o in llm.generate(PROMPTS, sp)]
    with LLM(admin_port=0, api_key="s3cret") as llm:
        port = llm.admin.port
        assert _post(port, b'{"mode": "ep"}')[0] == 401
        assert _post(port, b'{"mode": "ep"}', "wrong")[0] == 401
        code, body = _post(port, b'{"mode": "xp"}', "s3cret")
        assert code == 400 and body["error"]["param"] == "mode" and '"xp"' in body["error"]["message"]
        assert _post(port, b"not json", "s3cret")[0] == 400
        ids = [llm.add_request(p, sp) for p in PROMPTS]
        for _ in range(5):
            llm.step()
        result: dict = {}
        caller = threading.Thread(target=lambda: result.update(r=_post(port, b'{"mode": "ep"}', "s3cret")))
        caller.start()
        outs = {}
        while llm.has_unfinished() or caller.is_alive():
            outs.update({o.request_id: o.token_ids for o in llm.step() if o.finished})
        caller.join()
        code, outcome = result["r"]
        assert code == 200 and outcome["done"] and outcome["to"] == "ep"
        assert llm.mode == "ep"
        assert [outs[i] for i in ids] == want
        req = urllib.request.Request(f"http://127.0.0.1:{port}/admin/status",
                                     headers={"Authorization": "Bearer s3cret"})
        with urllib.request.urlopen(req, timeout=10) as r:
            status = json.loads(r.read())
        assert status["mode"] == "ep" and status["kv"]["free_tokens"] == status["kv"]["total_tokens"]


def test_admin_binds_loopback_only() -> None:
    with LLM(admin_port=0) as llm:
        assert llm.admin.httpd.server_address[0] == "127.0.0.1"


@pytest.mark.parametrize("path", ["/admin/nope", "/"])
def test_admin_unknown_path_is_404(path: str) -> None:
    with LLM(admin_port=0) as llm:
        req = urllib.request.Request(f"http://127.0.0.1:{llm.admin.port}{path}")
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=10)
        assert e.value.code == 404


def test_admin_bad_requests_are_named_and_slow_clients_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each bad request is a 4xx in OpenAI's shape (as `moebius serve` answers) whose message names what is wrong:
    the Content-Type, the JSON, the field, the value; the engine is untouched. A connection that never finishes its
    request line or headers is closed after the header timeout (it held a thread for as long as it liked)."""
    from moebius.entrypoints import admin

    monkeypatch.setattr(admin, "HEADER_TIMEOUT_S", 0.5)
    with LLM(admin_port=0) as llm:
        port = llm.admin.port
        for body, ctype, status, words, param in (
                (b'{"mode": "ep"}', "text/plain", 415, ["Content-Type", "'text/plain'", "application/json"], None),
                (b'{"mode": "ep"}', None, 415, ["'application/x-www-form-urlencoded'"], None),  # urllib's (curl -d's)
                (b"not json", "application/json", 400, ["not valid JSON"], None),
                (b"\xff\xfe", "application/json", 400, ["not valid JSON"], None),
                (b"[1, 2]", "application/json", 400, ["JSON object", "[1, 2]"], None),
                (b"", "application/json", 400, ["not valid JSON"], None),
                (b'{"mode": "ep", "force": true}', "application/json", 400, ["force"], "force"),
                (b"{}", "application/json", 400, ["mode is required"], "mode"),
                (b'{"mode": 5}', "application/json", 400, ["mode", "5"], "mode"),
                (b'{"mode": "EP"}', "application/json", 400, ["mode", '"EP"'], "mode")):
            code, got = _post(port, body, content_type=ctype)
            err = got["error"]
            assert code == status and set(err) == {"message", "type", "param", "code"}, (body, got)
            assert err["type"] == "invalid_request_error" and err["param"] == param, (body, err)
            assert all(w in err["message"] for w in words), (body, err)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("POST", "/admin/switch", body=b'{"mode": "ep"}')  # no Content-Type at all
        r = conn.getresponse()
        assert r.status == 415 and "no Content-Type" in json.loads(r.read())["error"]["message"]
        for path, want in (("/admin/status", 405), ("/admin/nope", 404)):
            assert _post(port, b'{"mode": "ep"}', path=path)[0] == want
        llm.step()  # a step boundary: nothing was queued
        assert llm.mode == "tp"
        for sent in (b"", b"POST /admin/sw", b"GET /admin/status HTTP/1.1\r\nHost: x\r\n"):
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                sock.sendall(sent)
                start = time.monotonic()
                while sock.recv(4096):  # (http.server may answer 408 first) until it closes
                    pass
                assert time.monotonic() - start < 3.0, sent
        result: dict[str, Any] = {}  # still serving: a good switch goes through at the next step boundary
        caller = threading.Thread(target=lambda: result.update(r=_post(port, b'{"mode": "ep"}')))
        caller.start()
        while caller.is_alive():
            llm.step()
            time.sleep(0.01)
        code, outcome = result["r"]
        assert code == 200 and outcome["to"] == "ep" and llm.mode == "ep"
