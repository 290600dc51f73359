"""The operator's switch: POST /admin/switch on a running engine switches layouts between two steps, with the same
outcome and the same tokens as LLM.switch_mode; the API key is enforced; bad bodies get a clear 4xx."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import pytest

from moebius import LLM, SamplingParams

PROMPTS = [[5, 6, 7, 8], [1, 2, 3], list(range(10, 40))]


def _post(port: int, body: bytes, key: str | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/admin/switch", data=body, method="POST",
                                 headers={"Authorization": f"Bearer {key}"} if key else {})
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
        assert code == 400 and "mode" in body["error"]
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
