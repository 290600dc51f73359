"""StopChecker decodes incrementally (a short window per token) and still finds a stop string the moment its last
token arrives, across multi-byte characters split over byte tokens; its state survives a JSON round trip (a switch
moves it between ranks)."""

from __future__ import annotations

import json

from moebius.engine.request import Request, RequestSpec, requests_from_json, requests_to_json
from moebius.engine.scheduler import StopChecker
from moebius.sampling_params import SamplingParams
from moebius.tokenizer import Tokenizer


def test_incremental_stop_string_matches_full_decode() -> None:
    tok = Tokenizer.builtin()
    text = "héllo wörld 你好 🙂 and then END of it"
    ids = tok.encode(text)
    checker = StopChecker((), tok)
    req = Request(RequestSpec("r", [1], SamplingParams(stop=["END"], max_tokens=None), 0, 10_000))
    for i, t in enumerate(ids):
        req.output_token_ids.append(t)
        if i % 5 == 0:  # move the request as a switch would, now and then
            req = requests_from_json(json.loads(json.dumps(requests_to_json([req]))), {req.request_id: req.spec})[0]
        checker.check(req)
        if req.finish_reason is not None:
            break
    assert req.finish_reason == "stop" and req.stop_reason == "END"
    decoded = tok.decode(req.output_token_ids)
    assert decoded.endswith("END") and decoded.count("END") == 1  # stopped on the token completing the string
    assert req.stop_text == decoded
