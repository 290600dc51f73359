"""Stop strings are checked where the text is decoded, at the front end: a stop string is found the moment its last
token arrives (across multi-byte characters split over byte tokens), the returned text is cut there, the front end
asks the ranks to release the request, and a stream of deltas never takes back text it sent."""

from __future__ import annotations

from moebius.frontend.output_processor import FrontRequest
from moebius.link.messages import TokenDelta
from moebius.sampling_params import RequestOutputKind, SamplingParams
from moebius.tokenizer import Tokenizer


def _request(tok: Tokenizer, params: SamplingParams, kind: RequestOutputKind) -> FrontRequest:
    return FrontRequest.make("r", None, [1], params, 0.0, kind, tok)


def test_incremental_stop_string_matches_full_decode() -> None:
    tok = Tokenizer.builtin()
    text = "héllo wörld 你好 🙂 and then END of it"
    ids = tok.encode(text)
    fr = _request(tok, SamplingParams(stop=["END"], max_tokens=None), RequestOutputKind.CUMULATIVE)
    for i, t in enumerate(ids):
        released = fr.take(0, TokenDelta("r", [t], None), float(i))
        if fr.finished:
            break
    out = fr.output()
    assert out is not None and out.finished
    assert released, "the ranks still run it: the front end must release it"
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == "END"
    decoded = tok.decode(out.token_ids)
    assert decoded.endswith("END") and decoded.count("END") == 1  # stopped on the token completing the string
    assert out.text == decoded[: -len("END")]  # cut before the stop string
    assert fr.ended(0)  # a step already on its way may report more tokens: the engine drops them
    assert fr.output() is None  # and nothing new is returned


def test_deltas_hold_back_what_may_begin_a_stop_string_and_never_retract() -> None:
    tok = Tokenizer.builtin()
    ids = tok.encode("abc stops here: STOP, and more")
    fr = _request(tok, SamplingParams(stop=["STOP", "never"], max_tokens=None), RequestOutputKind.DELTA)
    streamed = ""
    for t in ids:
        fr.take(0, TokenDelta("r", [t], None), 0.0)
        out = fr.output()
        assert out is not None and len(out.outputs) == 1
        piece = out.outputs[0].text
        streamed += piece
        if not out.finished:  # what may still begin a stop string ("STO", "neve") stays back
            assert len(fr.samples[0].out.text) - len(streamed) == min(4, len(fr.samples[0].out.text))
        else:
            break
    assert streamed == "abc stops here: " and fr.samples[0].out.text == streamed


def test_stop_strings_before_min_tokens_do_not_count_and_a_rank_end_comes_first() -> None:
    tok = Tokenizer.builtin()
    ids = tok.encode("xx")
    fr = _request(tok, SamplingParams(stop=["x"], min_tokens=2, max_tokens=None), RequestOutputKind.CUMULATIVE)
    assert not fr.take(0, TokenDelta("r", [ids[0]], None), 0.0) and not fr.finished  # "x" before min_tokens
    assert fr.take(0, TokenDelta("r", [ids[1]], None), 0.0) and fr.finished  # the second "x" ends it
    assert fr.samples[0].out.text == "x"
    # EOS (a rank's "stop" without a stop token) is applied before stop strings, as on the ranks
    fr = _request(tok, SamplingParams(stop=["y"]), RequestOutputKind.FINAL_ONLY)
    assert not fr.take(0, TokenDelta("r", tok.encode("y"), "stop"), 0.0)
    out = fr.output()
    assert out is not None and out.outputs[0].stop_reason is None and out.text == "y"
    # a stop string on the last token allowed: "stop" with the string (before "length"), nothing to release
    fr = _request(tok, SamplingParams(stop=["y"], max_tokens=1), RequestOutputKind.FINAL_ONLY)
    assert not fr.take(0, TokenDelta("r", tok.encode("y"), "length"), 0.0)
    out = fr.output()
    assert out is not None and out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == "y"
