"""One schema for every benchmark result JSON (`benchmarks/results/*.json`), written by `write_result` and read by
`load_result`: exactly these seven keys, nothing else at the top level.

    {
      "commit":   the commit measured: `git rev-parse HEAD` of the checkout holding this package, plus "-dirty" when
                  tracked files differ from it; $MOEBIUS_COMMIT when set (a device machine runs a copy of the tree
                  that is no git checkout: export the hash there); "unknown" when neither tells,
      "gpu":      torch.cuda.get_device_name(0), or "cpu",
      "num_gpus": GPUs the run used (0 on the CPU, whatever its ranks),
      "command":  the command line that wrote the file (`moebius bench sweep ...`, `python benchmarks/kernels/X.py
                  ...`); a list of strings where a file records several commands,
      "params":   the run's inputs only: its arguments (vars(args)), settings, environment knobs, scripts or patches
                  used; never a measured or derived value,
      "rows":     everything measured, one flat dict a row (values: numbers, strings, booleans, null, or lists of
                  those; no nested dicts: see `flatten`, nested keys joined with dots) holding the keys that
                  identify it (mode, batch, variant, ...),
      "note":     a short text: what the numbers are, conclusions.
    }

Tables. A file with one table (one kind of row) may leave its rows untagged. In a file with more than one table,
EVERY row carries a "table" key naming its table, e.g. the sweep's "decode" (a point per mode and batch), "switch"
(a measured switch), "memory" (a rank's memory in one layout), "skipped" (a point that could not run). The
single-valued results of a run (totals, medians, a crossover, wall time) go into ONE row of table "summary", as flat
keys (nested names joined with dots: `switch_overhead_median_ms.tp`). An empty table has no rows (so no name).

The rule, the same for every benchmark: inputs go into `params`, every measured or derived value into `rows`
(tagged by table when there are several), prose into `note`. Plots are written next to the JSON (same name, .png).

Producers: `write_result(path, rows, ...)` for one table; `write_result(path, tables={name: rows, ...},
summary={...})` for several (`tagged_rows` builds the tagged list, the summary flattened). Readers:
`table(result, name)` (one table's rows, without the tag; every row of a one-table file), `summary_of(result)`,
`table_names(result)`.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

SCHEMA_KEYS = ("commit", "gpu", "num_gpus", "command", "params", "rows", "note")  # exactly these, nothing else
TABLE = "table"  # the row key naming a row's table in a file of several tables
SUMMARY = "summary"  # the table of the one row holding a run's single-valued results

_PACKAGE_ROOT = Path(__file__).resolve().parents[1]  # .../moebius
_CHECKOUT = _PACKAGE_ROOT.parent


def current_commit(cwd: str | os.PathLike | None = None) -> str:
    """$MOEBIUS_COMMIT if set; else the checkout's HEAD (+ "-dirty" with tracked changes); else "unknown"."""
    env = os.environ.get("MOEBIUS_COMMIT", "").strip()
    if env:
        return env
    where = str(cwd or _CHECKOUT)

    def git(*args: str) -> str | None:
        try:
            r = subprocess.run(["git", *args], cwd=where, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            return None
        return r.stdout if r.returncode == 0 else None

    head = git("rev-parse", "HEAD")
    if not head or not head.strip():
        return "unknown"
    status = git("status", "--porcelain", "--untracked-files=no")
    return head.strip() + ("-dirty" if status is None or status.strip() else "")


def gpu_name() -> str:
    """torch.cuda.get_device_name(0), or "cpu" without a GPU."""
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def default_num_gpus() -> int:
    """1 with a GPU (most benchmarks time one), 0 without; multi-GPU runs pass their count to write_result."""
    import torch

    return 1 if torch.cuda.is_available() else 0


def gpus_used(ranks: int, device: str = "auto") -> int:
    """num_gpus of a run over `ranks` ranks: `ranks` on GPUs, 0 on the CPU (gloo ranks; device "cpu" or no GPU)."""
    import torch

    return 0 if device == "cpu" or not torch.cuda.is_available() else ranks


def _module_of(path: str) -> str | None:
    """`moebius.bench.x` for a file of this package (what `python -m moebius.bench.x` puts in sys.argv[0])."""
    try:
        p = Path(path).resolve()
        rel = p.relative_to(_CHECKOUT)
    except (ValueError, OSError):
        return None
    if p.suffix != ".py" or rel.parts[0] != _PACKAGE_ROOT.name:
        return None
    return ".".join(rel.with_suffix("").parts)


def _tool_of(path: str) -> str | None:
    """`benchmarks/<sub>/x.py` for a tool of this checkout (run as a script from any directory), else None."""
    try:
        p = Path(path).resolve()
        rel = p.relative_to(_CHECKOUT)
    except (ValueError, OSError):
        return None
    if p.suffix != ".py" or rel.parts[0] != "benchmarks":
        return None
    return rel.as_posix()


def command_line(argv: Sequence[str] | None = None, prefix: str = "python") -> str:
    """The command that runs this process again: `moebius bench ...` for the CLI's benchmarks, `{prefix} -m
    moebius.bench.x ...` for a module of this package, `{prefix} benchmarks/<sub>/x.py ...` for a tool of this
    checkout (prefix e.g. "torchrun --nproc-per-node 2"), else argv."""
    argv = list(sys.argv if argv is None else argv)
    if not argv:
        return ""
    rest = shlex.join(argv[1:])
    if argv[1:2] == ["bench"] and (os.path.basename(argv[0]) == "moebius"
                                   or _module_of(argv[0]) == "moebius.entrypoints.cli"):
        return f"moebius {rest}".strip()
    module = _module_of(argv[0])
    if module is not None:
        return f"{prefix} -m {module} {rest}".strip()
    tool = _tool_of(argv[0])
    if tool is not None:
        return f"{prefix} {tool} {rest}".strip()
    return shlex.join(argv)


def params_of(args: Any, **more: Any) -> dict[str, Any]:
    """A run's parameters as JSON: vars(args) (an argparse.Namespace or a dict) without what JSON cannot hold
    (e.g. argparse's `func`), plus `more`."""
    items = dict(vars(args) if not isinstance(args, Mapping) else args)
    items.update(more)
    out = {}
    for k, v in items.items():
        try:
            json.dumps(v)
        except (TypeError, ValueError):
            continue
        out[k] = v
    return out


def flatten(d: Mapping[str, Any], prefix: str = "", sep: str = ".") -> dict[str, Any]:
    """Nested dicts as one flat dict: {"best": {"gate_up": {"BN": 64}}} -> {"best.gate_up.BN": 64}."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{sep}{k}" if prefix else str(k)
        if isinstance(v, Mapping):
            out.update(flatten(v, key, sep))
        else:
            out[key] = v
    return out


def _is_flat_value(v: Any) -> bool:
    if isinstance(v, list | tuple):
        return all(not isinstance(x, Mapping | list | tuple) for x in v)
    return not isinstance(v, Mapping)


def check_result(result: Mapping[str, Any], where: str = "result", allow_empty: bool = False) -> None:
    """ValueError unless `result` has the schema above (exactly its keys, rows a non-empty list of flat dicts;
    `allow_empty`: an empty list too; where any row names its table, every row does, and one row at most is the
    summary)."""
    keys = set(result)
    missing = set(SCHEMA_KEYS) - keys
    unknown = keys - set(SCHEMA_KEYS)
    if missing or unknown:
        raise ValueError(f"{where}: missing keys {sorted(missing)}, keys outside the schema {sorted(unknown)}")
    if not isinstance(result["commit"], str) or not result["commit"]:
        raise ValueError(f"{where}: commit must be a non-empty string")
    if not isinstance(result["gpu"], str) or not isinstance(result["num_gpus"], int):
        raise ValueError(f"{where}: gpu must be a string, num_gpus an int")
    cmd = result["command"]
    if not (isinstance(cmd, str) or (isinstance(cmd, list) and all(isinstance(c, str) for c in cmd))):
        raise ValueError(f"{where}: command must be a string or a list of strings")
    if not isinstance(result["params"], Mapping) or not isinstance(result["note"], str):
        raise ValueError(f"{where}: params must be a dict, note a string")
    rows = result["rows"]
    if not isinstance(rows, list) or not (rows or allow_empty):
        raise ValueError(f"{where}: rows must be a non-empty list")
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise ValueError(f"{where}: rows[{i}] is not a dict")
        nested = [k for k, v in row.items() if not _is_flat_value(v)]
        if nested:
            raise ValueError(f"{where}: rows[{i}] is not flat (nested {nested}; see results.flatten)")
    tagged = [TABLE in row for row in rows]
    if any(tagged):
        if not all(tagged):
            raise ValueError(f"{where}: rows[{tagged.index(False)}] names no table while others do (every row of "
                             f"a file of several tables carries {TABLE!r})")
        bad = [i for i, row in enumerate(rows) if not isinstance(row[TABLE], str) or not row[TABLE]]
        if bad:
            raise ValueError(f"{where}: rows{bad}: {TABLE!r} must be a non-empty string")
        if sum(row[TABLE] == SUMMARY for row in rows) > 1:
            raise ValueError(f"{where}: more than one {SUMMARY!r} row")


def tagged_rows(tables: Mapping[str, Sequence[Mapping[str, Any]]],
                summary: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
    """Several tables as one list of rows: each row `{"table": name, **row}` (tables in their order, an empty table
    giving none), then the summary (flattened: nested names joined with dots) as one row of table "summary"."""
    out: list[dict[str, Any]] = []
    for name, rows in tables.items():
        if not isinstance(name, str) or not name or name == SUMMARY:
            raise ValueError(f"table name {name!r}: a non-empty string other than {SUMMARY!r} (see summary=)")
        for row in rows:
            if TABLE in row:
                raise ValueError(f"table {name!r}: a row already holds the key {TABLE!r}")
            out.append({TABLE: name, **row})
    if summary:
        flat = flatten(summary)
        if TABLE in flat:
            raise ValueError(f"summary: holds the key {TABLE!r}")
        out.append({TABLE: SUMMARY, **flat})
    return out


def make_result(rows: Sequence[Mapping[str, Any]] | None = None, *,
                tables: Mapping[str, Sequence[Mapping[str, Any]]] | None = None,
                summary: Mapping[str, Any] | None = None, params: Mapping[str, Any] | None = None, note: str = "",
                command: str | Sequence[str] | None = None, num_gpus: int | None = None, gpu: str | None = None,
                commit: str | None = None) -> dict[str, Any]:
    """The result dict (checked). `rows`: the one table of a one-table run; or `tables` ({name: rows}, the main
    one first) and/or `summary` (single-valued results): the rows tagged by table (`tagged_rows`). Defaults: this
    checkout's commit, this machine's GPU, sys.argv's command."""
    if tables is not None or summary is not None:
        if rows is not None:
            raise ValueError("give rows (one table) or tables / summary (several), not both")
        rows = tagged_rows(tables or {}, summary)
    elif rows is None:
        raise ValueError("no rows: give rows, or tables / summary")
    result: dict[str, Any] = {
        "commit": commit or current_commit(),
        "gpu": gpu or gpu_name(),
        "num_gpus": default_num_gpus() if num_gpus is None else int(num_gpus),
        "command": command_line() if command is None else (command if isinstance(command, str) else list(command)),
        "params": dict(params or {}),
        "rows": [dict(r) if isinstance(r, Mapping) else r for r in rows],
        "note": note,
    }
    check_result(result, allow_empty=True)  # a run that measured nothing still records why (load_result refuses it)
    return result


def write_result(path: str | os.PathLike, rows: Sequence[Mapping[str, Any]] | None = None,
                 **kw: Any) -> dict[str, Any]:
    """Write a result JSON at `path` (directories made) in the schema above and return it. `rows`, or keyword
    `tables` / `summary`, and the other keywords as `make_result`: params, note, command, num_gpus, gpu, commit."""
    result = make_result(rows, **kw)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    return result


def save_result(path: str | None, plot: Callable[[dict[str, Any], str], None] | None = None,
                **kw: Any) -> dict[str, Any]:
    """The result of a `moebius bench` command (keywords as `make_result`). With a path (--output) it is written
    there and `plot(result, png)` draws it beside it (skipped, with a warning, without matplotlib); without one it is
    only returned, for the command to print: a run writes no file unless asked to."""
    if path is None:
        return make_result(**kw)
    result = write_result(path, **kw)
    if plot is not None:
        try:
            plot(result, os.path.splitext(path)[0] + ".png")
        except ImportError:
            logging.getLogger("moebius").warning("matplotlib is not installed: no plot (pip install moebius[bench])")
    return result


def load_result(path: str | os.PathLike) -> dict[str, Any]:
    """A result JSON, checked against the schema (ValueError if it is not in it)."""
    with open(path) as f:
        result = json.load(f)
    if not isinstance(result, dict):
        raise ValueError(f"{path}: not a JSON object")
    check_result(result, str(path))
    return result


def table_names(result: Mapping[str, Any]) -> list[str]:
    """The tables of a result in the order their rows first come; [] for a one-table file (no row tagged)."""
    return list(dict.fromkeys(r[TABLE] for r in result["rows"] if TABLE in r))


def table(result: Mapping[str, Any], name: str) -> list[dict[str, Any]]:
    """The rows of table `name` (copies, without their "table" key; [] when it has none, e.g. an empty table); every
    row of a file with one table (no row tagged), whatever the name."""
    rows = result["rows"]
    if not any(TABLE in r for r in rows):
        return [dict(r) for r in rows]
    return [{k: v for k, v in r.items() if k != TABLE} for r in rows if r.get(TABLE) == name]


def summary_of(result: Mapping[str, Any]) -> dict[str, Any]:
    """The single-valued results: the "summary" row without its tag; {} when the file has none."""
    if not any(TABLE in r for r in result["rows"]):
        return {}
    found = table(result, SUMMARY)
    return found[0] if found else {}
