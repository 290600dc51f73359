"""The workload benchmarks run end to end on the CPU at a tiny scale (so they do not rot): every system serves
every request with exactly its asked-for length, auto switches, and the results are in the common schema."""

from __future__ import annotations

from typing import Any

from moebius.bench.results import load_result, summary_of, table
from moebius.entrypoints.cli import main

ENGINE = ["--num-ranks", "2", "--device", "cpu", "--max-running-requests", "32", "--switch-high", "6",
          "--switch-cooldown", "0"]


def test_bench_rollout_end_to_end(tmp_path: Any) -> None:
    out = f"{tmp_path}/rollout.json"
    assert main(["bench", "rollout", "--requests", "20", "--scale", "0.02", *ENGINE, "--output", out]) == 0
    result = load_result(out)
    systems = {r["system"]: r for r in table(result, "system")}
    assert set(systems) == {"tp", "ep", "auto"}
    tokens = {r["output_tokens"] for r in systems.values()}
    assert len(tokens) == 1  # the same work for every system
    assert systems["tp"]["ep_s"] == 0 and systems["ep"]["tp_s"] == 0 and systems["tp"]["switches"] == 0
    auto = systems["auto"]
    assert auto["switches"] >= 1 and auto["ep_s"] > 0 and auto["tp_s"] > 0  # starts in EP, drains into TP
    switches = [s for s in table(result, "switch") if s["system"] == "auto" and s["done"]]
    assert [(s["source"], s["target"]) for s in switches][:1] == [("ep", "tp")]
    summary = summary_of(result)
    assert summary["requests"] == 20 and summary["speedup_over_better_static"] > 0


def test_bench_bursty_end_to_end(tmp_path: Any) -> None:
    out = f"{tmp_path}/bursty.json"
    trace = ["--burst1-rate", "30", "--burst1-s", "0.4", "--quiet-s", "1.5", "--quiet-rate-min", "1",
             "--quiet-rate-max", "2", "--burst2-rate", "30", "--burst2-s", "0.4", "--scale", "0.02", "--bin-s", "0.5"]
    assert main(["bench", "bursty", *trace, *ENGINE, "--no-warmup", "--output", out]) == 0
    result = load_result(out)
    phases = table(result, "phase")
    n = summary_of(result)["requests"]
    for system in ("tp", "ep", "auto"):
        whole = next(r for r in phases if r["system"] == system and r["phase"] == "all")
        assert whole["requests"] == n and whole["ttft_p50_s"] > 0 and whole["tpot_p50_ms"] > 0
    assert any(b["arrivals"] for b in table(result, "bin"))
    modes = {s["mode"] for s in table(result, "timeline") if s["system"] == "auto"}
    assert "tp" in modes
