"""StopRules decodes incrementally (a short window per token) and still finds a stop string the moment its last
token arrives, across multi-byte characters split over byte tokens; its state survives a JSON round trip (a switch
moves it between ranks)."""

from __future__ import annotations

import json

from moebius.link.codec import decode, encode
from moebius.link.lifecycle import StopRules
from moebius.link.messages import RequestList
from moebius.link.request import Request, RequestSpec
from moebius.sampling_params import SamplingParams
from moebius.tokenizer import Tokenizer


def test_incremental_stop_string_matches_full_decode() -> None:
    tok = Tokenizer.builtin()
    text = "héllo wörld 你好 🙂 and then END of it"
    ids = tok.encode(text)
    checker = StopRules((), tok)
    req = Request(RequestSpec("r", [1], SamplingParams(stop=["END"], max_tokens=None), 0, 10_000))
    for i, t in enumerate(ids):
        req.output_token_ids.append(t)
        if i % 5 == 0:  # move the request as a switch would, now and then
            msg = json.loads(json.dumps(encode(RequestList.of([req]))))
            req = decode(RequestList, msg).requests_with({req.request_id: req.spec})[0]
        checker.check(req)
        if req.finish_reason is not None:
            break
    assert req.finish_reason == "stop" and req.stop_reason == "END"
    decoded = tok.decode(req.output_token_ids)
    assert decoded.endswith("END") and decoded.count("END") == 1  # stopped on the token completing the string
    assert req.stop_text == decoded
