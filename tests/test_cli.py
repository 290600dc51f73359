"""The command line agrees with the API (the same sampling defaults, `seed` per request in JSONL, `moebius --version`),
writes results as they finish and keeps them on Ctrl-C, takes nothing silently, and says each default once in --help.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import math
import os
import pathlib
import re
import signal
import subprocess
import sys
import time
from typing import Any

import pytest

from moebius import __version__
from moebius.config import ConfigError, EngineConfig, HelpFormatter
from moebius.entrypoints.cli import CALIBRATE_EXCLUDES, SAMPLING_FLAGS, _read_prompts, _sampling, build_parser, main
from moebius.models.builtin import BUILTIN_NOTICE
from moebius.sampling_params import SamplingParams

DEMO = ["generate", "--device", "cpu", "--no-progress"]
ROOT = pathlib.Path(__file__).resolve().parent.parent


def _jsonl(path: pathlib.Path, *objs: dict[str, Any]) -> str:
    path.write_text("".join(json.dumps(o) + "\n" for o in objs))
    return str(path)


def _cli(*args: str) -> list[str]:
    """The command a user runs, as a subprocess of this interpreter."""
    return [sys.executable, "-m", "moebius.entrypoints.cli", *args]


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


def test_seed_comes_per_request_from_jsonl(tmp_path: pathlib.Path) -> None:
    assert main(["generate", "--sampling-seed", "3", "hi"]) == 2
    path = _jsonl(tmp_path / "in.jsonl", {"prompt": "a", "seed": 7, "temperature": 0.5}, {"prompt": "b"})
    args = build_parser().parse_args(["generate", "--input", path, "--max-tokens", "5"])
    items = _read_prompts(args)
    params = [_sampling(args, item.overrides) for item in items]
    assert [(p.seed, p.temperature, p.max_tokens) for p in params] == [(7, 0.5, 5), (None, 1.0, 5)]


def test_calibrate_writes_and_prints_the_profile(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["calibrate", "--calibration-dir", str(tmp_path), "--batches", "1,4", "--context", "8", "--device", "cpu"]
    assert main(args) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["batches"] == [1, 4] and len(printed["tp_ms"]) == len(printed["ep_ms"]) == 2
    assert set(printed["switch_ms"]) == {"tp", "ep"}
    # the same batches with an 8-token prompt arriving every step (mixed steps)
    assert printed["mixed_batches"] == [1, 4] and len(printed["tp_mixed_ms"]) == len(printed["ep_mixed_ms"]) == 2
    kept = list(tmp_path.iterdir())
    assert len(kept) == 1 and json.loads(kept[0].read_text()) == printed


def test_generate_rejects_bad_input_before_loading_the_model(tmp_path: pathlib.Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    def fails(args: list[str], words: str) -> None:
        assert main(["generate", "--device", "cpu", *args]) == 2
        err = capsys.readouterr().err
        assert words in err and "Traceback" not in err, err

    fails(["--temperature", "-1", "hi"], "--temperature")
    fails(["--output", f"{tmp_path}/missing/out.jsonl", "hi"], "does not exist")
    bad_key = _jsonl(tmp_path / "bad_key.jsonl", {"prompt": "a"}, {"prompt": "b", "temprature": 1})
    fails(["--input", bad_key], "bad_key.jsonl:2: unknown key(s) ['temprature']")
    bad_value = _jsonl(tmp_path / "bad_value.jsonl", {"prompt": "a", "top_p": 2})
    fails(["--input", bad_value], "bad_value.jsonl:1: top_p")
    not_utf8 = tmp_path / "latin1.jsonl"
    not_utf8.write_bytes(b'{"prompt": "a"}\n{"prompt": "caf\xe9"}\n')
    fails(["--input", str(not_utf8)], "latin1.jsonl:2: not UTF-8")


# ---- results are written as they finish -------------------------------------------------------------------------


def test_results_are_written_as_they_finish(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """Each line is written and flushed when its request ends (finishing order, with its index), while the others
    still run: the file holds the short request's line at a step where the long one is unfinished."""
    from moebius.entrypoints.llm import LLM

    out = tmp_path / "out.jsonl"
    lines_seen: list[int] = []
    step = LLM.step

    def counting_step(self: LLM) -> list[Any]:
        lines_seen.append(len(out.read_text().splitlines()) if out.exists() else 0)
        return step(self)

    monkeypatch.setattr(LLM, "step", counting_step)
    src = _jsonl(tmp_path / "in.jsonl", {"prompt": "long", "max_tokens": 12, "ignore_eos": True},
                 {"prompt": "short", "max_tokens": 2, "ignore_eos": True})
    assert main([*DEMO, "--input", src, "--output", str(out)]) == 0
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["index"] for r in recs] == [1, 0]  # finishing order, each with its input index
    assert [len(r["outputs"][0]["token_ids"]) for r in recs] == [2, 12]
    assert 1 in lines_seen  # a step ran with the finished line already on disk
    assert "2 requests, 14 output tokens" in capsys.readouterr().err


def test_requests_finishing_together_are_written_in_input_order(monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """Whatever order a step hands its outputs back in (here reversed), those of one step come in input order."""
    from moebius.entrypoints.llm import LLM

    step = LLM.step
    monkeypatch.setattr(LLM, "step", lambda self: step(self)[::-1])
    assert main([*DEMO, "--max-tokens", "3", "--ignore-eos", "c", "a", "b"]) == 0
    assert [json.loads(line)["index"] for line in capsys.readouterr().out.splitlines()] == [0, 1, 2]


def test_ctrl_c_keeps_the_finished_lines(tmp_path: pathlib.Path) -> None:
    """SIGINT once a line is written: the process exits 130 saying how many finished, the line stays, no
    traceback; the demo-model warning came once."""
    src = _jsonl(tmp_path / "in.jsonl", {"prompt": "quick", "max_tokens": 2, "ignore_eos": True},
                 {"prompt": "slow", "max_tokens": 4000, "ignore_eos": True})
    out = tmp_path / "out.jsonl"
    # (Ctrl-C's SIGINT at its default in the child, as a terminal starts it: a run started in the background by a
    # non-interactive shell, `nohup cmd &`, inherits it ignored, and Python then never raises KeyboardInterrupt)
    proc = subprocess.Popen(_cli(*DEMO, "--input", src, "--output", str(out)), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 60
        while not (out.exists() and out.read_text().endswith("\n")):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no line written in 60 s"
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["index"] for r in recs] == [0] and recs[0]["outputs"][0]["finish_reason"] == "length"
    assert "1 of 2 requests finished" in err and "1 did not" in err and "Traceback" not in err, err
    assert err.count(BUILTIN_NOTICE) == 1, err


def test_a_folder_as_output_is_refused_before_loading(tmp_path: pathlib.Path) -> None:
    done = subprocess.run(_cli(*DEMO, "--output", str(tmp_path), "hi"), capture_output=True, text=True, cwd=ROOT,
                          timeout=120)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [f"moebius: error: --output {tmp_path}: is a folder; give a file path"]


def test_an_unwritable_output_is_refused_before_loading(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    from moebius.frontend.core import EngineCore

    def no_loading(*_: Any, **__: Any) -> None:
        raise AssertionError("the model loaded before --output was refused")

    monkeypatch.setattr(EngineCore, "__init__", no_loading)
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    target = locked / "out.jsonl"
    try:
        open(target, "w").close()  # root writes anyway: a folder of /sys refuses everyone
    except PermissionError:
        pass
    else:
        target = pathlib.Path("/sys/moebius-out.jsonl")
        try:
            open(target, "w").close()
            pytest.skip("no unwritable folder here")
        except PermissionError:
            pass
    assert main([*DEMO, "--output", str(target), "hi"]) == 2
    assert capsys.readouterr().err == f"moebius: error: --output {target}: cannot be written (Permission denied)\n"


def test_a_full_disk_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    assert main([*DEMO, "--max-tokens", "2", "--output", "/dev/full", "hi"]) == 1
    err = capsys.readouterr().err
    assert "moebius: error: --output /dev/full: cannot write (No space left on device)" in err
    assert "Traceback" not in err


def test_a_full_disk_midway_keeps_what_was_written(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """ENOSPC on the second line: exit 1 naming it and how many were written; the first line is in the file."""
    import errno

    from moebius.entrypoints import cli

    real = cli._record
    calls = []

    def second_fails(index: int, out: Any) -> str:
        calls.append(index)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(index, out)

    monkeypatch.setattr(cli, "_record", second_fails)
    out = tmp_path / "out.jsonl"
    src = _jsonl(tmp_path / "in.jsonl", {"prompt": "a", "max_tokens": 1}, {"prompt": "b", "max_tokens": 6,
                                                                            "ignore_eos": True})
    assert main([*DEMO, "--input", src, "--output", str(out)]) == 1
    err = capsys.readouterr().err
    assert "No space left on device" in err and "results written before: 1 of 2" in err, err
    assert [json.loads(line)["index"] for line in out.read_text().splitlines()] == [0]


def test_an_engine_failure_midway_keeps_what_was_written(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """A step that raises (a rank died) after one request finished: exit 1 with one line saying so, no traceback,
    the finished line in the file."""
    from moebius.entrypoints.llm import LLM

    step = LLM.step
    calls = []

    def failing_step(self: LLM) -> list[Any]:
        outs = step(self)
        calls.append(any(o.finished for o in outs))
        if sum(calls) and not calls[-1]:  # a step after the one that finished the short request
            raise RuntimeError("rank 1 died")
        return outs

    monkeypatch.setattr(LLM, "step", failing_step)
    out = tmp_path / "out.jsonl"
    src = _jsonl(tmp_path / "in.jsonl", {"prompt": "a", "max_tokens": 1}, {"prompt": "b", "max_tokens": 8,
                                                                            "ignore_eos": True})
    assert main([*DEMO, "--input", src, "--output", str(out)]) == 1
    err = capsys.readouterr().err
    assert (f"moebius: error: the engine failed (RuntimeError: rank 1 died); results written to {out} before: 1 of 2"
            in err and "Traceback" not in err), err
    assert [json.loads(line)["index"] for line in out.read_text().splitlines()] == [0]


def test_a_request_that_fails_is_written_with_its_error(tmp_path: pathlib.Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A request the engine ends with finish_reason "error" (its sampling values fail on the rank) is written with
    why; the other requests' lines are as they are without it, and the command succeeds."""
    from test_offline_catalogue import fail_sampling_for_seed

    good = {"prompt": "a", "max_tokens": 4, "ignore_eos": True, "temperature": 0}
    want = tmp_path / "want.jsonl"
    assert main([*DEMO, "--input", _jsonl(tmp_path / "good.jsonl", good), "--output", str(want)]) == 0
    fail_sampling_for_seed(monkeypatch, 666)
    out = tmp_path / "out.jsonl"
    src = _jsonl(tmp_path / "in.jsonl", {"prompt": "b", "seed": 666, "max_tokens": 4}, good)
    assert main([*DEMO, "--input", src, "--output", str(out)]) == 0
    lines = {r["index"]: r["outputs"][0] for r in map(json.loads, out.read_text().splitlines())}
    assert lines[0]["finish_reason"] == "error"
    assert lines[0]["error"] == "OverflowError: Overflow when unpacking long long"
    assert lines[1]["token_ids"] == json.loads(want.read_text())["outputs"][0]["token_ids"]


def test_input_from_stdin_and_a_byte_order_mark(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = b'\xef\xbb\xbf{"prompt": "a", "max_tokens": 3}\n\n{"prompt_token_ids": [1, 2]}\n'
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
    items = _read_prompts(build_parser().parse_args(["generate", "--input", "-"]))
    assert [(i.index, i.prompt, i.overrides, i.where) for i in items] == [
        (0, "a", {"max_tokens": 3}, "<stdin>:1"), (1, [1, 2], {}, "<stdin>:3")]
    path = tmp_path / "bom.jsonl"
    path.write_bytes(data)
    assert [i.prompt for i in _read_prompts(build_parser().parse_args(["generate", "-i", str(path)]))] == ["a", [1, 2]]


# ---- nothing taken silently ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_an_empty_input_is_an_error_not_the_demo_prompt(tmp_path: pathlib.Path, content: str) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match="no prompts"):
        _read_prompts(build_parser().parse_args(["generate", "--input", str(path)]))


def test_logprobs_key_is_written(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    """"logprobs" in a line: each output token's log-probability (its own token first) and the top k's."""
    src = _jsonl(tmp_path / "in.jsonl", {"prompt": "hi", "max_tokens": 3, "logprobs": 2}, {"prompt": "hi"})
    out = tmp_path / "out.jsonl"
    assert main([*DEMO, "--input", src, "--output", str(out)]) == 0
    recs = {r["index"]: r["outputs"][0] for r in map(json.loads, out.read_text().splitlines())}
    steps = recs[0]["logprobs"]
    assert len(steps) == len(recs[0]["token_ids"]) == 3
    for token, step in zip(recs[0]["token_ids"], steps, strict=True):
        assert next(iter(step)) == str(token) and 2 <= len(step) <= 3
        assert all(v <= 0 and math.isfinite(v) for v in step.values())
    assert "logprobs" not in recs[1]


def test_prompt_logits_key_is_refused(tmp_path: pathlib.Path) -> None:
    src = _jsonl(tmp_path / "in.jsonl", {"prompt": "hi", "prompt_logits": True})
    with pytest.raises(ValueError, match=r"in.jsonl:1: key 'prompt_logits' is not taken here"):
        _read_prompts(build_parser().parse_args(["generate", "--input", src]))


def test_tokenizer_with_the_demo_model_is_refused(ckpt: Any, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError, match="tokenizer .* needs a model"):
        EngineConfig(tokenizer=ckpt("text"))
    assert main([*DEMO, "--tokenizer", ckpt("text"), "hi"]) == 2
    assert "moebius: error: --tokenizer" in capsys.readouterr().err
    EngineConfig(model="qwen3-30b-a3b", load_format="dummy", tokenizer=ckpt("text"))  # with a model it is used


@pytest.mark.parametrize("kwargs", [
    dict(switch_high=-1.0), dict(switch_low=-0.5), dict(switch_high=math.inf), dict(switch_high=math.nan),
    dict(switch_low=math.inf), dict(switch_cooldown=math.nan), dict(switch_cooldown=math.inf),
    dict(switch_cooldown=-1.0), dict(switch_window=0), dict(switch_window=-3),
])
def test_auto_mode_thresholds_must_be_finite_and_non_negative(kwargs: dict[str, Any]) -> None:
    name = next(iter(kwargs))
    with pytest.raises(ConfigError, match=name):
        EngineConfig.from_kwargs(mode="auto", **kwargs)  # /admin/policy builds its config this way


def test_auto_mode_thresholds_at_zero_are_taken() -> None:
    cfg = EngineConfig.from_kwargs(switch_high=0.0, switch_low=0.0, switch_cooldown=0.0, switch_window=1)
    assert (cfg.switch_high, cfg.switch_low) == (0.0, 0.0)


@pytest.mark.parametrize("kwargs", [
    dict(api_key=""), dict(api_key="   "), dict(api_key="a\nb"), dict(seed=-1), dict(seed=2**63),
    dict(model=""), dict(tokenizer="", model="qwen3-30b-a3b"), dict(calibration_dir=""), dict(admin_host=""),
    dict(mem_fraction=math.nan), dict(watchdog_timeout=math.inf), dict(cpu_threads=0),
])
def test_engine_values_a_user_could_not_mean_are_refused(kwargs: dict[str, Any]) -> None:
    name = next(iter(kwargs))
    with pytest.raises(ConfigError, match=name):
        EngineConfig.from_kwargs(**kwargs)


def test_api_key_help_says_what_it_covers() -> None:
    helps = {a.dest: a.help for a in build_parser()._subparsers._group_actions[0].choices["generate"]._actions}
    assert "every HTTP route but /health" in helps["api_key"]


def test_summary_says_1_request(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*DEMO, "--max-tokens", "1", "hi"]) == 0
    assert re.search(r"^1 request, 1 output token in ", capsys.readouterr().err, re.MULTILINE)


def test_the_demo_model_warning_comes_once(capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
                                           ) -> None:
    assert main([*DEMO, "--max-tokens", "1", "hi"]) == 0
    said = capsys.readouterr().err.count(BUILTIN_NOTICE) + sum(r.getMessage() == BUILTIN_NOTICE
                                                               for r in caplog.records)
    assert said == 1


# ---- --help -------------------------------------------------------------------------------------------------------


def _helps(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Each option's help text as --help prints it (defaults expanded), by its first flag."""
    fmt = parser._get_formatter()
    return {(a.option_strings or [a.dest])[0]: fmt._expand_help(a) for a in parser._actions if a.help}


def _engine_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(formatter_class=HelpFormatter)
    EngineConfig.add_cli_args(p)
    return p


@pytest.mark.parametrize("which", ["generate", "calibrate", "engine"])
def test_help_states_each_default_once(which: str) -> None:
    """No "(default: None)", no option with two mentions of its default; every option that takes a value says its
    default once (a flag is off unless given)."""
    parser = _engine_parser() if which == "engine" else build_parser()._subparsers._group_actions[0].choices[which]
    flags = {a.option_strings[0] for a in parser._actions
             if a.option_strings and isinstance(a, argparse._StoreConstAction | argparse._HelpAction)}
    for opt, text in _helps(parser).items():
        assert "(default: None)" not in text, (opt, text)
        mentions = len(re.findall(r"\bdefault\b", text, re.IGNORECASE))
        assert mentions <= 1 if opt in flags else mentions == 1, (opt, text)
    assert "(default: None)" not in parser.format_help()


def test_calibrate_offers_no_option_it_would_ignore(capsys: pytest.CaptureFixture[str]) -> None:
    for name in CALIBRATE_EXCLUDES:
        if name == "mode":  # its own: tp or ep
            continue
        flag = "--" + name.replace("_", "-")
        value = [] if name == "static_layout" else ["1"]
        assert main(["calibrate", flag, *value]) == 2
        assert f"unrecognized arguments: {flag}" in capsys.readouterr().err
    assert main(["calibrate", "--mode", "auto"]) == 2  # auto mode would calibrate at start-up already
    assert "argument --mode: invalid choice: 'auto'" in capsys.readouterr().err
    p = argparse.ArgumentParser()
    EngineConfig.add_cli_args(p, exclude=("admin_port",))  # as `moebius serve` may leave it out
    args = p.parse_args([])
    assert "admin_port" not in vars(args) and EngineConfig.from_cli_args(args).admin_port is None
