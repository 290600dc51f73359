"""The benchmark results schema (moebius/bench/results.py): the helper writes it, every recorded result in
benchmarks/results has it; the `moebius bench` commands and their helpers live in the package and import on the CPU
without the entrypoints, the one-off tools live under benchmarks/ and import (and run as scripts) on the CPU."""

from __future__ import annotations

import ast
import glob
import importlib
import json
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import import_tool

import moebius.bench
from moebius.bench import results

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
BENCH = ROOT / "moebius" / "bench"
TOOLS = ROOT / "benchmarks"
COMMANDS = {"sweep", "throughput", "rollout", "bursty", "simulate", "serve_load"}  # `moebius bench <command>` modules
KEYS = set(results.SCHEMA_KEYS)


def test_schema_is_the_asked_one() -> None:
    assert KEYS == {"commit", "gpu", "num_gpus", "command", "params", "rows", "note"}
    assert not hasattr(results, "EXTRA_KEYS") and "other_results" not in results.__doc__
    for key in KEYS:  # the docstring describes every key, and the rule for several tables
        assert f'"{key}"' in results.__doc__
    assert '"table"' in results.__doc__ and '"summary"' in results.__doc__


def test_write_result_writes_the_schema(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("MOEBIUS_COMMIT", raising=False)
    rows = [{"mode": "tp", "batch": 1, "step_ms": 2.5, "cuda_graph": True, "tma": [False, True]},
            {"mode": "ep", "batch": 1, "step_ms": 3.0, "cuda_graph": True, "tma": [False, True]}]
    path = tmp_path / "sub" / "r.json"
    written = results.write_result(path, rows, params={"batches": [1], "model": "x"}, note="a test")
    got = json.loads(path.read_text())
    assert got == written and set(got) == KEYS
    assert got["rows"] == rows and got["params"] == {"batches": [1], "model": "x"} and got["note"] == "a test"
    assert got["gpu"] == results.gpu_name() and isinstance(got["num_gpus"], int)
    assert isinstance(got["command"], str) and got["command"]
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    if head.returncode == 0:  # a checkout: its HEAD, marked dirty when tracked files differ
        assert got["commit"].removesuffix("-dirty") == head.stdout.strip()
    else:
        assert got["commit"] == "unknown"
    assert results.load_result(path) == got
    # one table: untagged rows, read back whole whatever the name
    assert results.table(got, "decode") == rows and results.table_names(got) == [] and results.summary_of(got) == {}


def test_several_tables_are_tagged_rows_and_a_summary_row(tmp_path) -> None:
    decode = [{"mode": "tp", "batch": 1, "step_ms": 2.5}, {"mode": "ep", "batch": 1, "step_ms": 3.0}]
    switch = [{"to": "ep", "overhead_ms": 4.0}]
    path = tmp_path / "multi.json"
    written = results.write_result(path, tables={"decode": decode, "switch": switch, "skipped": []},
                                   summary={"crossover_batch": 1, "switch_overhead_median_ms": {"ep": 4.0},
                                            "wall_s": 1.5}, params={"batches": [1]}, note="t")
    got = results.load_result(path)
    assert got == written and set(got) == KEYS and set(json.loads(path.read_text())) == KEYS
    assert [r["table"] for r in got["rows"]] == ["decode", "decode", "switch", "summary"]  # an empty table: no rows
    assert results.table_names(got) == ["decode", "switch", "summary"]
    assert results.table(got, "decode") == decode and results.table(got, "switch") == switch
    assert results.table(got, "skipped") == []
    # the summary: one row, nested names joined with dots
    assert results.summary_of(got) == {"crossover_batch": 1, "switch_overhead_median_ms.ep": 4.0, "wall_s": 1.5}
    assert got["params"] == {"batches": [1]}  # inputs only
    with pytest.raises(ValueError, match="not both"):
        results.make_result(decode, tables={"switch": switch})
    with pytest.raises(ValueError, match="already holds"):
        results.make_result(tables={"decode": [{"table": "x", "a": 1}]})
    with pytest.raises(ValueError, match="other than"):
        results.make_result(tables={"summary": decode})
    with pytest.raises(ValueError, match="not flat"):  # tables' rows are checked like rows (flatten them first)
        results.make_result(tables={"switch": [{"to": "ep", "ranks": {"0": 1.0}}]})
    # a file mixing tagged and untagged rows, or with two summaries, is not in the schema
    with pytest.raises(ValueError, match="names no table"):
        results.check_result({**got, "rows": got["rows"] + [{"a": 1}]})
    with pytest.raises(ValueError, match="more than one"):
        results.check_result({**got, "rows": got["rows"] + [{"table": "summary", "a": 1}]})
    with pytest.raises(ValueError, match="non-empty string"):
        results.check_result({**got, "rows": got["rows"] + [{"table": 3, "a": 1}]})


def test_commit_from_the_environment_or_unknown(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("MOEBIUS_COMMIT", "abc123")
    assert results.current_commit() == "abc123"
    assert results.make_result([{"a": 1}], params={})["commit"] == "abc123"
    monkeypatch.delenv("MOEBIUS_COMMIT")
    if subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True).returncode != 0:
        assert results.current_commit(cwd=tmp_path) == "unknown"  # a copy of the tree that is no checkout


def test_command_line_forms() -> None:
    moe_tune = str(TOOLS / "kernels" / "moe_tune.py")  # a tool: its path from the checkout's root, wherever run
    assert results.command_line([moe_tune, "--ranks", "2"]) == "python benchmarks/kernels/moe_tune.py --ranks 2"
    comm = str(TOOLS / "comm" / "comm_bench.py")
    assert (results.command_line([comm, "--output", "c.json"], prefix="torchrun --nproc-per-node 2")
            == "torchrun --nproc-per-node 2 benchmarks/comm/comm_bench.py --output c.json")
    baseline = str(BENCH / "hf_baseline.py")  # a module of the package: run with -m
    assert results.command_line([baseline, "s.json"]) == "python -m moebius.bench.hf_baseline s.json"
    cli = str(ROOT / "moebius" / "entrypoints" / "cli.py")
    assert results.command_line([cli, "bench", "sweep", "--num-ranks", "2"]) == "moebius bench sweep --num-ranks 2"
    assert results.command_line(["/usr/bin/moebius", "bench", "sweep"]) == "moebius bench sweep"
    assert results.command_line(["other.py", "a b"]) == "other.py 'a b'"


def test_rows_must_be_flat_dicts_and_keys_in_the_schema(tmp_path) -> None:
    with pytest.raises(ValueError, match="not flat"):
        results.write_result(tmp_path / "x.json", [{"best": {"BN": 64}}])
    with pytest.raises(ValueError, match="not a dict"):
        results.write_result(tmp_path / "x.json", [[1, 2]])
    assert results.flatten({"best": {"gate_up": {"BN": 64}}, "us": 1.0}) == {"best.gate_up.BN": 64, "us": 1.0}
    good = results.make_result([{"a": 1}], params={}, note="")
    with pytest.raises(ValueError, match="outside the schema"):
        results.check_result({**good, "points": []})
    with pytest.raises(ValueError, match="outside the schema"):  # no eighth key, not even an optional one
        results.check_result({**good, "other_results": {"wall_s": 1.0}})
    with pytest.raises(ValueError, match="non-empty"):
        results.check_result({**good, "rows": []})
    assert results.params_of(argparse_namespace(x=1, func=print)) == {"x": 1}


def argparse_namespace(**kw: object) -> object:
    import argparse

    return argparse.Namespace(**kw)


RECORDED = sorted(glob.glob(str(RESULTS / "*.json")))


def test_results_are_recorded() -> None:
    assert len(RECORDED) >= 33


@pytest.mark.parametrize("path", RECORDED, ids=[os.path.basename(p) for p in RECORDED])
def test_every_recorded_result_has_the_schema(path: str) -> None:
    with open(path) as f:
        raw = json.load(f)
    assert isinstance(raw, dict) and set(raw) == KEYS, set(raw) ^ KEYS  # exactly the seven keys
    result = results.load_result(path)  # also: rows a non-empty list of flat dicts, types of the other keys
    rows = result["rows"]
    assert rows and all(isinstance(r, dict) and r for r in rows)
    assert all(not isinstance(v, dict) for r in rows for v in r.values())  # flat
    tagged = ["table" in r for r in rows]
    assert all(tagged) or not any(tagged), "where any row names its table, every row does"
    if any(tagged):
        names = results.table_names(result)
        assert len(names) > 1 and all(isinstance(n, str) and n for n in names)  # tags only where several tables
        assert sum(r["table"] == "summary" for r in rows) <= 1
        assert sum(len(results.table(result, n)) for n in names) == len(rows)
    assert result["commit"] == "unknown" or len(result["commit"].removesuffix("-dirty")) == 40
    assert result["gpu"] and result["note"]


def _bench_modules() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(moebius.bench.__path__))


def _tools() -> list[str]:
    """Every tool file under benchmarks/, as `<sub>/<name>.py`."""
    return sorted(p.relative_to(TOOLS).as_posix() for p in TOOLS.glob("**/*.py"))


def _imports(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            out += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return out


def test_the_package_holds_the_commands_and_benchmarks_the_tools() -> None:
    """moebius/bench: the `moebius bench` commands, what they import, graph_timing (the timer the tools share) and sm90
    (kernels compiled for Hopper without a GPU: a tool's and tests/test_kernels_sm90.py's);
    benchmarks/<sub>/: every one-off tool (kernel tuners, A/Bs, profiles, switch and communication benchmarks), none
    at the folder's top and none imported by the package."""
    modules = set(_bench_modules())
    assert COMMANDS <= modules
    needed, todo = set(), list(COMMANDS)
    while todo:  # what the commands import, transitively
        name = todo.pop()
        needed.add(name)
        todo += [m.split(".")[2] for m in _imports(BENCH / f"{name}.py")
                 if m.startswith("moebius.bench.") and m.split(".")[2] in modules and m.split(".")[2] not in needed]
    assert modules - needed == {"graph_timing", "sm90"}, modules - needed
    tools = _tools()
    assert all(any(m.startswith("moebius.bench.graph_timing") for m in _imports(TOOLS / t)) for t in
               ("kernels/moe_tune.py", "switch/reshard_copy.py", "comm/comm_bench.py"))
    assert not glob.glob(str(TOOLS / "*.py")), "a tool goes into a topical folder of benchmarks/"
    assert {"kernels/moe_tune.py", "kernels/kernel_ab.py", "switch/switch_phases.py", "steps/decode_ab.py",
            "steps/tp_rank_model.py", "comm/comm_bench.py", "rl/weight_update.py"} <= set(tools)
    names = {Path(t).stem for t in tools}
    assert len(names) == len(tools) and not names & modules  # one name, one file
    for path in sorted(BENCH.glob("*.py")):
        assert not [m for m in _imports(path) if m.split(".")[0] in names], path.name


@pytest.mark.parametrize("name", _bench_modules())
def test_bench_module_imports_on_the_cpu_and_says_how_to_run_it(name: str) -> None:
    mod = importlib.import_module(f"moebius.bench.{name}")
    assert mod.__doc__ and mod.__doc__.strip(), name
    source = (BENCH / f"{name}.py").read_text()
    if '__name__ == "__main__"' in source:  # runnable: its docstring gives the command
        assert f"-m moebius.bench.{name}" in mod.__doc__, name
    assert "sys.path" not in source, name


@pytest.mark.parametrize("path", _tools())
def test_bench_tool_imports_on_the_cpu_and_says_how_to_run_it(path: str) -> None:
    """Each tool imports on the CPU (GPU work only inside its main); a runnable one names its command (the script's
    path from the checkout's root) in its docstring and in its usage line; none edits sys.path."""
    mod = import_tool(path)
    assert mod.__doc__ and mod.__doc__.strip(), path
    source = (TOOLS / path).read_text()
    if '__name__ == "__main__"' in source:
        assert f"benchmarks/{path}" in mod.__doc__, path
        assert "ArgumentParser(" not in source or f'benchmarks/{path}"' in source, path  # its prog
    else:  # a helper: a sibling tool imports it
        assert any(Path(path).stem in _imports(other) for other in (TOOLS / path).parent.glob("*.py")), path
    assert "sys.path" not in source, path


def test_bench_never_imports_the_entrypoints() -> None:
    """Not at the top, not inside functions, not for type checking: moebius.entrypoints.cli imports moebius.bench."""
    for path in sorted(BENCH.glob("*.py")):
        bad = [m for m in _imports(path) if m.startswith("moebius.entrypoints") or m in ("moebius.LLM",)]
        assert not bad, (path.name, bad)


def test_a_bench_tool_runs_as_a_script(tmp_path) -> None:
    """From any directory, with moebius installed: the script's usage names its command; a tool importing its
    sibling (steps/decode_ab.py: tp_rank_model.py) finds it."""
    r = subprocess.run([sys.executable, str(TOOLS / "kernels" / "kernel_ab.py")], cwd=tmp_path, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode != 0 and "usage: python benchmarks/kernels/kernel_ab.py" in r.stderr, r.stderr[-2000:]
    r = subprocess.run([sys.executable, str(TOOLS / "steps" / "decode_ab.py"), "--help"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.startswith("usage: python benchmarks/steps/decode_ab.py"), r.stderr[-2000:]
    assert "--tp-rank-of" in r.stdout


def test_a_bench_run_writes_a_file_only_when_asked(tmp_path, monkeypatch) -> None:
    """save_result: without a path the result is only returned (a run records nothing unless given --output);
    with one it is written and plotted beside it. Every `moebius bench` command leaves --output unset by default."""
    from moebius.entrypoints.cli import build_parser

    monkeypatch.chdir(tmp_path)
    drawn: list[str] = []
    kw = dict(rows=[{"batch": 1, "step_ms": 2.0}], params={"x": 1}, note="a test")
    result = results.save_result(None, lambda r, png: drawn.append(png), **kw)
    assert result["rows"] == [{"batch": 1, "step_ms": 2.0}] and not drawn and not list(tmp_path.iterdir())
    path = tmp_path / "run.json"
    assert results.save_result(str(path), lambda r, png: drawn.append(png), **kw)["rows"] == result["rows"]
    assert results.load_result(path)["rows"] == result["rows"] and drawn == [str(tmp_path / "run.png")]
    for command in ("sweep", "throughput", "serve", "bursty", "rollout", "simulate"):
        extra = ["rollout"] if command == "simulate" else []  # its workload sub-command
        args = build_parser().parse_args(["bench", command, *extra])
        assert args.output is None, command
