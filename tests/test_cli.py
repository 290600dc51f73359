"""The command line agrees with the API: the same sampling defaults, `seed` per request in JSONL (no CLI-only
seed flag), and `moebius --version`."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import pytest

from moebius import __version__
from moebius.entrypoints.cli import SAMPLING_FLAGS, _read_prompts, _sampling, build_parser
from moebius.sampling_params import SamplingParams


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        build_parser().parse_args(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"moebius {__version__}"


def test_sampling_defaults_are_the_api_defaults() -> None:
    args = build_parser().parse_args(["generate", "hi"])
    got = _sampling(args, {})
    want = SamplingParams()
    for f in dataclasses.fields(SamplingParams):
        if f.init:
            assert getattr(got, f.name) == getattr(want, f.name), f.name
    assert {name for name, *_ in SAMPLING_FLAGS} <= {f.name for f in dataclasses.fields(SamplingParams)}


def test_seed_comes_per_request_from_jsonl(tmp_path: object) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--sampling-seed", "3", "hi"])
    path = f"{tmp_path}/in.jsonl"
    with open(path, "w") as f:
        f.write(json.dumps({"prompt": "a", "seed": 7, "temperature": 0.5}) + "\n" + json.dumps({"prompt": "b"}) + "\n")
    args = build_parser().parse_args(["generate", "--input", path, "--max-tokens", "5"])
    items = _read_prompts(args)
    params = [_sampling(args, overrides) for _, overrides in items]
    assert [(p.seed, p.temperature, p.max_tokens) for p in params] == [(7, 0.5, 5), (None, 1.0, 5)]


def test_calibrate_writes_and_prints_the_profile(tmp_path: object, capsys: pytest.CaptureFixture[str]) -> None:
    from moebius.entrypoints.cli import main

    args = ["calibrate", "--calibration-dir", str(tmp_path), "--batches", "1,4", "--context", "8", "--device", "cpu"]
    assert main(args) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["batches"] == [1, 4] and len(printed["tp_ms"]) == len(printed["ep_ms"]) == 2
    assert set(printed["switch_ms"]) == {"tp", "ep"}
    # the same batches with an 8-token prompt arriving every step (mixed steps)
    assert printed["mixed_batches"] == [1, 4] and len(printed["tp_mixed_ms"]) == len(printed["ep_mixed_ms"]) == 2
    kept = list(pathlib.Path(str(tmp_path)).iterdir())
    assert len(kept) == 1 and json.loads(kept[0].read_text()) == printed


def test_generate_rejects_bad_input_before_loading_the_model(tmp_path: object, capsys: pytest.CaptureFixture[str]
                                                             ) -> None:
    from moebius.entrypoints.cli import main

    def fails(args: list[str], words: str) -> None:
        assert main(["generate", "--device", "cpu", *args]) == 2
        err = capsys.readouterr().err
        assert words in err and "Traceback" not in err, err

    fails(["--temperature", "-1", "hi"], "temperature")
    fails(["--output", f"{tmp_path}/missing/out.jsonl", "hi"], "its folder does not exist")
    bad_key = f"{tmp_path}/bad_key.jsonl"
    with open(bad_key, "w") as f:
        f.write(json.dumps({"prompt": "a"}) + "\n" + json.dumps({"prompt": "b", "temprature": 1}) + "\n")
    fails(["--input", bad_key], "bad_key.jsonl:2: unknown sampling key")
    bad_value = f"{tmp_path}/bad_value.jsonl"
    with open(bad_value, "w") as f:
        f.write(json.dumps({"prompt": "a", "top_p": 2}) + "\n")
    fails(["--input", bad_value], "bad_value.jsonl:1: top_p")
    not_utf8 = f"{tmp_path}/latin1.jsonl"
    with open(not_utf8, "wb") as f:
        f.write(b'{"prompt": "a"}\n{"prompt": "caf\xe9"}\n')
    fails(["--input", not_utf8], "latin1.jsonl:2: not UTF-8")
