"""The command line's bad-input catalogue: each bad flag value, input file, JSONL line or output path is answered with
exit code 2 and one line `moebius: error: ...` naming what is wrong, no traceback, and without loading the model
(everything here can be checked before). A good run before and after the catalogue gives the same tokens."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest

from moebius.entrypoints.cli import main

GOOD = ["generate", "--device", "cpu", "--max-tokens", "4", "--no-progress", "hi"]
GEN = ["generate", "--device", "cpu", "--no-progress"]


def _line(obj: dict[str, Any] | str) -> str:
    return (obj if isinstance(obj, str) else json.dumps(obj)) + "\n"


# (case id, arguments after `moebius`, what the error line must contain, the --input file's content: {in} in the
# arguments is its path, {dir} a folder of this test)
Case = tuple[str, list[str], str, str | bytes | None]

FLAGS: list[Case] = [
    ("max-tokens-0", [*GEN, "--max-tokens", "0", "hi"], "--max-tokens must be an integer >= 1, got 0", None),
    ("max-tokens-negative", [*GEN, "--max-tokens", "-5", "hi"], "--max-tokens must be an integer >= 1", None),
    ("max-tokens-word", [*GEN, "--max-tokens", "abc", "hi"], "argument --max-tokens: invalid int value: 'abc'", None),
    ("max-tokens-float", [*GEN, "--max-tokens", "1.5", "hi"], "argument --max-tokens: invalid int value: '1.5'", None),
    ("min-tokens-negative", [*GEN, "--min-tokens", "-1", "hi"], "--min-tokens must be an integer >= 0", None),
    ("min-above-max", [*GEN, "--min-tokens", "20", "--max-tokens", "4", "hi"],
     "--min-tokens 20 is larger than --max-tokens 4", None),
    ("temperature-negative", [*GEN, "--temperature", "-0.1", "hi"], "--temperature must be a number >= 0", None),
    ("temperature-nan", [*GEN, "--temperature", "nan", "hi"], "--temperature", None),
    ("temperature-inf", [*GEN, "--temperature", "inf", "hi"], "--temperature", None),
    ("top-p-0", [*GEN, "--top-p", "0", "hi"], "--top-p must be a number in (0, 1]", None),
    ("top-p-above-1", [*GEN, "--top-p", "1.5", "hi"], "--top-p must be a number in (0, 1]", None),
    ("top-p-nan", [*GEN, "--top-p", "nan", "hi"], "--top-p", None),
    ("top-k-below-minus-1", [*GEN, "--top-k", "-2", "hi"], "--top-k must be -1 (disabled) or a positive", None),
    ("top-k-word", [*GEN, "--top-k", "x", "hi"], "argument --top-k: invalid int value: 'x'", None),
    ("n-0", [*GEN, "--n", "0", "hi"], "--n must be an integer >= 1", None),
    ("stop-empty", [*GEN, "--stop", "", "hi"], "--stop strings must be non-empty", None),
    ("device-tpu", [*GEN, "--device", "tpu", "hi"], "argument --device: invalid choice: 'tpu'", None),
    ("dtype-fp8", [*GEN, "--dtype", "fp8", "hi"], "argument --dtype: invalid choice: 'fp8'", None),
    ("load-format-gguf", [*GEN, "--load-format", "gguf", "hi"], "argument --load-format: invalid choice", None),
    ("mode-dp", [*GEN, "--mode", "dp", "hi"], "argument --mode: invalid choice: 'dp'", None),
    ("switch-policy", [*GEN, "--switch-policy", "magic", "hi"], "argument --switch-policy: invalid choice", None),
    ("switch-profile", [*GEN, "--switch-profile", "batch", "hi"], "argument --switch-profile: invalid choice", None),
    ("rank-process", [*GEN, "--rank-process", "maybe", "hi"], "argument --rank-process: invalid choice", None),
    ("warmup", [*GEN, "--warmup", "some", "hi"], "argument --warmup: invalid choice", None),
    ("block-size-0", [*GEN, "--block-size", "0", "hi"], "--block-size must be a positive power of two, got 0", None),
    ("block-size-24", [*GEN, "--block-size", "24", "hi"], "--block-size must be a positive power of two, got 24",
     None),
    ("block-size-negative", [*GEN, "--block-size", "-16", "hi"], "--block-size must be a positive power of two",
     None),
    ("token-budget-0", [*GEN, "--max-num-batched-tokens", "0", "hi"], "--max-num-batched-tokens must be positive",
     None),
    ("running-0", [*GEN, "--max-running-requests", "0", "hi"], "--max-running-requests must be positive", None),
    ("total-tokens-below-a-block", [*GEN, "--max-total-tokens", "8", "hi"],
     "--max-total-tokens 8 is smaller than one block", None),
    ("num-ranks-0", [*GEN, "--num-ranks", "0", "hi"], "--num-ranks must be >= 1", None),
    ("mem-fraction-0", [*GEN, "--mem-fraction", "0", "hi"], "--mem-fraction must be in (0, 1]", None),
    ("mem-fraction-1.5", [*GEN, "--mem-fraction", "1.5", "hi"], "--mem-fraction must be in (0, 1]", None),
    ("mem-fraction-nan", [*GEN, "--mem-fraction", "nan", "hi"], "--mem-fraction must be a finite number", None),
    ("max-model-len-0", [*GEN, "--max-model-len", "0", "hi"], "--max-model-len must be positive", None),
    ("cpu-threads-0", [*GEN, "--cpu-threads", "0", "hi"], "--cpu-threads must be >= 1", None),
    ("admin-port-70000", [*GEN, "--admin-port", "70000", "hi"], "--admin-port must be a port number", None),
    ("admin-port-negative", [*GEN, "--admin-port", "-1", "hi"], "--admin-port must be a port number", None),
    ("switch-high-negative", [*GEN, "--switch-high", "-1", "hi"], "--switch-high must be >= 0", None),
    ("switch-high-nan", [*GEN, "--switch-high", "nan", "hi"], "--switch-high must be a finite number", None),
    ("switch-high-inf", [*GEN, "--switch-high", "inf", "hi"], "--switch-high must be a finite number", None),
    ("switch-low-negative", [*GEN, "--switch-low", "-2", "hi"], "--switch-low must be >= 0", None),
    ("switch-low-above-high", [*GEN, "--switch-low", "5", "--switch-high", "2", "hi"],
     "--switch-low 5.0 is above --switch-high 2.0", None),
    ("switch-window-0", [*GEN, "--switch-window", "0", "hi"], "--switch-window must be at least 1", None),
    ("switch-cooldown-negative", [*GEN, "--switch-cooldown", "-1", "hi"], "--switch-cooldown must be >= 0", None),
    ("switch-cooldown-nan", [*GEN, "--switch-cooldown", "nan", "hi"], "--switch-cooldown must be a finite", None),
    ("switch-cooldown-inf", [*GEN, "--switch-cooldown", "inf", "hi"], "--switch-cooldown must be a finite", None),
    ("graph-bs-0", [*GEN, "--cuda-graph-max-bs", "0", "hi"], "--cuda-graph-max-bs must be >= 1", None),
    ("graph-tokens-negative", [*GEN, "--cuda-graph-max-tokens", "-1", "hi"], "--cuda-graph-max-tokens must be >= 0",
     None),
    ("plans-ahead-3", [*GEN, "--plans-ahead", "3", "hi"], "--plans-ahead must be 1 or 2", None),
    ("watchdog-negative", [*GEN, "--watchdog-timeout", "-1", "hi"], "--watchdog-timeout must be >= 0", None),
    ("watchdog-inf", [*GEN, "--watchdog-timeout", "inf", "hi"], "--watchdog-timeout must be a finite number", None),
    ("seed-negative", [*GEN, "--seed", "-1", "hi"], "--seed must be in 0..2^63 - 1, got -1", None),
    ("seed-2-63", [*GEN, "--seed", str(2**63), "hi"], "--seed must be in 0..2^63 - 1", None),
    ("seed-word", [*GEN, "--seed", "abc", "hi"], "argument --seed: invalid int value", None),
    ("api-key-empty", [*GEN, "--api-key", "", "hi"], "--api-key must be a non-empty key", None),
    ("api-key-blank", [*GEN, "--api-key", "   ", "hi"], "--api-key must be a non-empty key", None),
    ("tokenizer-with-demo", [*GEN, "--tokenizer", "{dir}", "hi"], "--tokenizer", None),
    ("model-empty", [*GEN, "--model", "", "hi"], "--model must not be empty", None),
    ("model-missing", [*GEN, "--model", "{dir}/no-such-model", "hi"], "is not a directory", None),
    ("model-folder-without-config", [*GEN, "--model", "{dir}", "hi"], "has no config.json", None),
    ("admin-host-empty", [*GEN, "--admin-host", "", "hi"], "--admin-host must not be empty", None),
    ("calibration-dir-empty", [*GEN, "--calibration-dir", "", "hi"], "--calibration-dir must not be empty", None),
    ("num-layers-0", [*GEN, "--num-layers", "0", "hi"], "--num-layers 0 must be between 1 and", None),
    ("num-layers-too-many", [*GEN, "--num-layers", "99", "hi"], "--num-layers 99 must be between 1 and", None),
    ("unknown-flag", [*GEN, "--temprature", "1", "hi"], "unrecognized arguments: --temprature", None),
    ("empty-prompt-argument", [*GEN, ""], "prompt argument 1 is empty", None),
    ("no-command", [], "the following arguments are required: command", None),
    ("unknown-command", ["frobnicate"], "argument command: invalid choice: 'frobnicate'", None),
]

FILES: list[Case] = [
    ("input-folder", [*GEN, "--input", "{dir}"], "is a folder, not a JSONL file", None),
    ("input-missing", [*GEN, "--input", "{dir}/missing.jsonl"], "missing.jsonl: no such file", None),
    ("input-empty", [*GEN, "--input", "{in}"], "no prompts (the file is empty or has only blank lines)", ""),
    ("input-blank-lines", [*GEN, "--input", "{in}"], "no prompts", "\n   \n\t\n"),
    ("input-bom-only", [*GEN, "--input", "{in}"], "no prompts", b"\xef\xbb\xbf"),
    ("output-folder", [*GEN, "--output", "{dir}", "hi"], "is a folder; give a file path", None),
    ("output-missing-folder", [*GEN, "--output", "{dir}/nowhere/out.jsonl", "hi"], "does not exist", None),
]

LINES: list[tuple[str, str | bytes, str]] = [
    ("not-json", _line('{"prompt": "a"'), "in.jsonl:1: not valid JSON"),
    ("array", _line("[1, 2]"), "in.jsonl:1: expected an object"),
    ("string", _line('"hello"'), "in.jsonl:1: expected an object"),
    ("number", _line("5"), "in.jsonl:1: expected an object"),
    ("null", _line("null"), "in.jsonl:1: expected an object"),
    ("no-prompt", _line({}), 'in.jsonl:1: give exactly one of "prompt", "prompt_token_ids", "messages" (got none)'),
    ("two-prompts", _line({"prompt": "a", "messages": []}), "got prompt, messages"),
    ("prompt-int", _line({"prompt": 123}), 'in.jsonl:1: "prompt" must be a string'),
    ("prompt-null", _line({"prompt": None}), '"prompt" must be a string'),
    ("prompt-list", _line({"prompt": ["a"]}), '"prompt" must be a string'),
    ("prompt-empty", _line({"prompt": ""}), '"prompt" is empty'),
    ("ids-string", _line({"prompt_token_ids": "abc"}), '"prompt_token_ids" must be a non-empty list'),
    ("ids-empty", _line({"prompt_token_ids": []}), '"prompt_token_ids" must be a non-empty list'),
    ("ids-nested", _line({"prompt_token_ids": [[1, 2], [3]]}), '"prompt_token_ids"[0] must be an integer'),
    ("ids-bool", _line({"prompt_token_ids": [True, False]}), '"prompt_token_ids"[0] must be an integer token id, '
     "got true"),
    ("ids-float", _line({"prompt_token_ids": [1, 1.5]}), '"prompt_token_ids"[1] must be an integer'),
    ("ids-negative", _line({"prompt_token_ids": [-1]}), '"prompt_token_ids"[0] = -1 is outside the vocabulary'),
    ("ids-past-vocab", _line({"prompt_token_ids": [5, 999999]}), '"prompt_token_ids"[1] = 999999 is outside'),
    ("messages-string", _line({"messages": "hello"}), '"messages" must be a non-empty list'),
    ("messages-empty", _line({"messages": []}), '"messages" must be a non-empty list'),
    ("messages-of-strings", _line({"messages": ["hi"]}), '"messages": message 0 must be a dict'),
    ("message-no-content", _line({"messages": [{"role": "user"}]}),
     '"messages": message 0 (user): content is missing'),
    ("message-null-content", _line({"messages": [{"role": "user", "content": None}]}),
     '"messages": message 0 (user): content is null'),
    ("message-int-content", _line({"messages": [{"role": "user", "content": 5}]}), "content must be a string (or a "
     "list of text parts), got int 5"),
    ("message-empty-role", _line({"messages": [{"role": "", "content": "x"}]}), '"messages": message 0: role must '
     "be a non-empty string, got ''"),
    ("message-text-part-not-text", _line({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
     "only text parts"),
    ("message-int-role", _line({"messages": [{"role": 1, "content": "x"}]}), "message 0: role must be a non-empty "
     "string, got 1"),
    ("max-tokens-string", _line({"prompt": "a", "max_tokens": "10"}), "in.jsonl:1: max_tokens must be an integer"),
    ("max-tokens-float", _line({"prompt": "a", "max_tokens": 1.5}), "max_tokens must be an integer"),
    ("max-tokens-bool", _line({"prompt": "a", "max_tokens": True}), "max_tokens must be an integer"),
    ("temperature-string", _line({"prompt": "a", "temperature": "hot"}), "temperature must be a number"),
    ("temperature-nan", _line('{"prompt": "a", "temperature": NaN}'), "temperature must be a number"),
    ("temperature-huge", _line('{"prompt": "a", "temperature": 1e999}'), "temperature must be a number"),
    ("seed-string", _line({"prompt": "a", "seed": "7"}), "seed must be an integer"),
    ("seed-past-int64", _line({"prompt": "a", "seed": 2**70}), "seed must be an integer"),
    ("stop-int", _line({"prompt": "a", "stop": 123}), "stop must be a string or a list of strings"),
    ("stop-ids-string", _line({"prompt": "a", "stop_token_ids": "5"}), "stop_token_ids must be a list"),
    ("ignore-eos-string", _line({"prompt": "a", "ignore_eos": "yes"}), "ignore_eos must be true or false"),
    ("logprobs-too-many", _line({"prompt": "a", "logprobs": 100}), "logprobs must be at most"),
    ("logprobs-negative", _line({"prompt": "a", "logprobs": -1}), "logprobs must be an integer >= 0"),
    ("top-p-0", _line({"prompt": "a", "top_p": 0}), "top_p must be a number in (0, 1]"),
    ("n-0", _line({"prompt": "a", "n": 0}), "n must be an integer >= 1"),
    ("min-above-max", _line({"prompt": "a", "min_tokens": 10, "max_tokens": 2}), "min_tokens 10 is larger than "
     "max_tokens 2"),
    ("unknown-key", _line({"prompt": "a", "temprature": 1}), "in.jsonl:1: unknown key(s) ['temprature']"),
    ("prompt-logits", _line({"prompt": "a", "prompt_logits": True}), "key 'prompt_logits' is not taken here"),
    ("output-kind", _line({"prompt": "a", "output_kind": "DELTA"}), "key 'output_kind' is not taken here"),
    ("duplicate-key", _line('{"prompt": "a", "prompt": "b"}'), "in.jsonl:1: key 'prompt' appears twice"),
    ("second-line", _line({"prompt": "a"}) + "\n" + _line({"prompt": 7}), 'in.jsonl:3: "prompt" must be a string'),
    ("not-utf8", b'{"prompt": "a"}\n{"prompt": "caf\xe9"}\n', "in.jsonl:2: not UTF-8 text"),
]

CALIBRATE: list[Case] = [
    ("batches-word", ["calibrate", "--batches", "1,x"], "argument --batches: 'x' in '1,x' is not a positive integer",
     None),
    ("batches-0", ["calibrate", "--batches", "0"], "'0' in '0' is not a positive integer", None),
    ("batches-empty", ["calibrate", "--batches", ""], "'' in '' is not a positive integer", None),
    ("context-0", ["calibrate", "--context", "0"], "--context must be at least 1 cached token, got 0", None),
    ("context-negative", ["calibrate", "--context", "-5"], "--context must be at least 1", None),
    ("calibrate-admin-port", ["calibrate", "--admin-port", "1"], "unrecognized arguments: --admin-port", None),
    ("calibrate-mode-auto", ["calibrate", "--mode", "auto"], "argument --mode: invalid choice: 'auto'", None),
    ("calibrate-static-layout", ["calibrate", "--static-layout"], "unrecognized arguments: --static-layout", None),
    ("calibrate-mem-fraction", ["calibrate", "--mem-fraction", "2"], "--mem-fraction must be in (0, 1]", None),
    ("calibrate-seed", ["calibrate", "--seed", "-3"], "--seed must be in 0..2^63 - 1", None),
]

CASES: list[Case] = [*FLAGS, *FILES, *[(f"line-{name}", [*GEN, "--input", "{in}"], words, content)
                                      for name, content, words in LINES], *CALIBRATE]


def _good_tokens(capsys: pytest.CaptureFixture[str]) -> list[list[int]]:
    assert main(GOOD) == 0
    return [r["outputs"][0]["token_ids"] for r in map(json.loads, capsys.readouterr().out.splitlines())]


@pytest.fixture(scope="module")
def before() -> dict[str, list[list[int]]]:
    return {}


def test_a_good_run_before(before: dict[str, list[list[int]]], capsys: pytest.CaptureFixture[str]) -> None:
    before["tokens"] = _good_tokens(capsys)
    assert len(before["tokens"]) == 1 and len(before["tokens"][0]) == 4


def test_the_catalogue_is_large_and_distinct() -> None:
    assert len({c[0] for c in CASES}) == len(CASES) >= 60
    assert len({(tuple(c[1]), c[3]) for c in CASES}) == len(CASES)  # no two cases give the same input


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input(case: Case, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
                   capsys: pytest.CaptureFixture[str]) -> None:
    from moebius.frontend.core import EngineCore

    def no_loading(*_: Any, **__: Any) -> None:
        raise AssertionError("the model loaded for input that could be checked before")

    monkeypatch.setattr(EngineCore, "__init__", no_loading)
    _, args, words, content = case
    src = tmp_path / "in.jsonl"
    if content is not None:
        src.write_bytes(content if isinstance(content, bytes) else content.encode())
    argv = [a.replace("{in}", str(src)).replace("{dir}", str(tmp_path)) for a in args]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert out == "" and len(lines) == 1 and lines[0].startswith("moebius: error: "), err
    assert words in lines[0], err


def test_a_good_run_after_gives_the_same_tokens(before: dict[str, list[list[int]]],
                                                capsys: pytest.CaptureFixture[str]) -> None:
    if "tokens" not in before:  # run alone: the run before is this one's first
        before["tokens"] = _good_tokens(capsys)
    assert _good_tokens(capsys) == before["tokens"]
