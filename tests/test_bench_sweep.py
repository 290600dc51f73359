"""`moebius bench sweep` end to end on the CPU (the built-in tiny model's shapes, two gloo ranks, dummy weights, and
transformers' baselines on the same shapes, one process and tensor-parallel), and
the recorded sweeps in benchmarks/results: both in the results schema (moebius/bench/results.py) with the sweep's
rows in the form the GPU issue asks for (one per (mode, batch), with the step, its floor and their ratio; params
holding the preset, the summary row the crossover batch; read through results.table / summary_of)."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from typing import Any

import pytest

from moebius.bench.results import check_result, load_result, summary_of, table
from moebius.models.builtin import builtin_hf_config

POINT_FIELDS = {"mode", "batch", "context_len", "step_ms", "floor_ms", "ratio_to_floor", "tokens_per_s", "cuda_graph"}
RESULTS = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results")


def check_sweep(result: dict[str, Any], modes: set[str]) -> None:
    check_result(result)  # exactly commit, gpu, num_gpus, command, params, rows, note
    assert "preset" in result["params"] and "crossover_batch" in summary_of(result)
    assert all("table" in r for r in result["rows"])  # several tables: every row tagged
    timed = [p for p in table(result, "decode") if "error" not in p]
    for p in timed:
        assert POINT_FIELDS <= p.keys(), (p["mode"], p["batch"], POINT_FIELDS - p.keys())
        assert p["step_ms"] > 0 and p["floor_ms"] > 0
        assert abs(p["ratio_to_floor"] - p["step_ms"] / p["floor_ms"]) < 1e-9 * p["ratio_to_floor"]
        assert abs(p["tokens_per_s"] - p["batch"] / p["step_ms"] * 1e3) < 1e-6 * p["tokens_per_s"]
    assert modes <= {p["mode"] for p in timed}
    for mode in ("tp", "ep"):
        batches = [p["batch"] for p in timed if p["mode"] == mode]
        assert len(batches) == len(set(batches)), f"{mode}: a batch measured twice"


def test_sweep_runs_on_cpu_and_writes_the_asked_form(tmp_path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(builtin_hf_config()))
    out = tmp_path / "sweep.json"
    cmd = [sys.executable, "-m", "moebius.entrypoints.cli", "bench", "sweep", "--model", str(model), "--num-ranks",
           "2", "--batches", "1,2,4,100000", "--context-len", "16", "--steps", "2", "--warmup", "1",
           "--eager-up-to", "2",
           "--switch-repeats", "1", "--switch-batch", "3", "--switch-overlap", "--switch-transport", "peer",
           "--hf-baseline", "--hf-batches", "2", "--prefill-chunks", "8,40", "--prefill-prefix", "4",
           "--prefill-decodes", "2", "--prefill-decode-context", "12", "--prefill-idle", "0.01",
           "--output", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    result = load_result(out)
    check_sweep(result, {"tp", "ep"})
    params, summary, decode = result["params"], summary_of(result), table(result, "decode")
    switches = table(result, "switch")
    assert result["num_gpus"] == 0 and result["gpu"] == "cpu" and params["num_ranks"] == 2
    assert result["command"].startswith("moebius bench sweep --model"), result["command"]
    assert params["switch_transport"] == "peer" and switches
    assert all(s["transport"] == "peer" and s["peer_exchanges"] > 0 for s in switches), switches
    assert sorted((p["mode"], p["batch"]) for p in decode if not p["mode"].startswith("hf")) == sorted(
        (m, b) for m in ("tp", "ep") for b in (1, 2, 4))
    memory = table(result, "memory")  # a record per layout and rank
    assert sorted((m["mode"], m["rank"]) for m in memory) == [("ep", 0), ("ep", 1), ("tp", 0), ("tp", 1)]
    # a batch past the KV pages: skipped in each layout, the reason in the table and on stdout
    skipped = table(result, "skipped")
    assert sorted((p["mode"], p["batch"]) for p in skipped) == [("ep", 100000), ("tp", 100000)], skipped
    assert all(w.startswith("needs ") and "KV pages" in w for p in skipped for w in p["why"]), skipped
    assert r.stdout.count("100000 skipped: ") == 2 and "wall_s" in summary, r.stdout[-2000:]
    # transformers on the same shapes (here on the CPU): eager decode steps and its continuous batching, in one
    # process and with its tensor-parallel plan over the two ranks (two gloo processes here)
    hf = {p["mode"]: p for p in decode if p["mode"].startswith("hf")}
    assert set(hf) == {"hf-eager-1gpu", "hf-cb-1gpu", "hf-eager-tp2", "hf-cb-tp2"}
    assert all(p["batch"] == 2 and "error" not in p for p in hf.values()), hf
    assert hf["hf-cb-1gpu"]["method"] in ("token timestamps", "two output lengths")
    assert hf["hf-cb-tp2"]["method"] in ("token timestamps", "two output lengths")
    assert hf["hf-eager-tp2"]["floor_ms"] < hf["hf-eager-1gpu"]["floor_ms"]  # the floor of two GPUs
    assert all("eager_step_ms" in p for p in decode if p["batch"] <= 2 and p["mode"] in ("tp", "ep"))
    # the switches after the sweep, each measured against its transfer
    done = [s for s in switches if s.get("done")]
    assert {s["to"] for s in done} == {"tp", "ep"} and all(s["overhead_ms"] == s["overhead_ms"] for s in done)
    assert all(s["batch"] == 3 for s in switches)  # --switch-batch requests decoding during each
    assert params["switch_overlap"] and all(s["pipelined"] for s in done)  # --switch-overlap: the pipelined pass
    assert summary["flash_prefill"] is False  # which attention served its prompt chunks (CPU: the reference)
    # the summary row: per target layout, flat keys (switch_overhead_median_ms.tp, ...)
    for to in ("tp", "ep"):
        worst = summary[f"switch_overhead_max_ms.{to}"]
        assert worst == max(s["overhead_ms"] for s in done if s["to"] == to)
        assert worst >= summary[f"switch_overhead_median_ms.{to}"]
    # prefill steps of one chunk a rank beside 2 decoding requests, each against the floor of its work (EP: a
    # chunk and the decodes on every rank)
    prefill = {(p["mode"], p["tokens"]): p for p in table(result, "prefill")}
    assert set(prefill) == {(m, n) for m in ("tp", "ep") for n in (8, 40)}, prefill
    for (mode, n), p in prefill.items():
        assert p["prefix"] == 4 and p["decodes"] == 2 and p["step_tokens"] == (n + 2) * (2 if mode == "ep" else 1)
        assert p["step_ms"] > 0 and p["floor_ms"] > 0 and abs(p["ratio_to_floor"] - p["step_ms"] / p["floor_ms"]) < 1e-9
        # the same step alone (the device idle before it): its own time against the same floor
        assert p["step_ms_isolated"] > 0 and p["ratio_isolated"] == p["step_ms_isolated"] / p["floor_ms"]
    assert prefill[("tp", 40)]["floor_ms"] > prefill[("tp", 8)]["floor_ms"]
    assert os.path.exists(tmp_path / "sweep.png") or not _has_matplotlib()  # the plot next to the JSON


def _has_matplotlib() -> bool:
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def test_recorded_sweeps_have_the_asked_form() -> None:
    paths = sorted(glob.glob(os.path.join(RESULTS, "*sweep*.json")))
    assert paths, "no sweep recorded in benchmarks/results"
    for path in paths:
        result = load_result(path)
        check_sweep(result, set(result["params"].get("modes") or ("tp", "ep")))  # every layout it asked for
        assert result["command"].startswith("moebius bench sweep"), path
        assert result["gpu"] != "cpu", path  # the recorded ones come from the GPU machine


def test_hf_tensor_parallel_run_past_its_timeout_ends_its_ranks() -> None:
    """A transformers tensor-parallel run that outlasts --hf-tp-timeout becomes error points, and none of its rank
    processes outlives it (torchrun starts them in sessions of their own, so killing torchrun alone leaves them)."""
    import time

    import psutil

    from moebius.bench.hf_baseline import BaselineSpec, run_tensor_parallel

    spec = BaselineSpec(cfg_dict=builtin_hf_config(), num_layers=2, batches=[2], context_len=16, steps=2, warmup=1)
    points = run_tensor_parallel(spec, 2, timeout_s=2.0)
    assert [(p["mode"], p["batch"]) for p in points] == [("hf-eager-tp2", 2), ("hf-cb-tp2", 2)]
    assert all(p["error"].startswith("no result in 2 s") for p in points), points
    time.sleep(1.0)
    left = [p.info["pid"] for p in psutil.process_iter(["pid", "cmdline"])
            if "moebius.bench.hf_baseline" in " ".join(p.info["cmdline"] or [])]
    assert not left, f"rank processes left running: {left}"


@pytest.mark.parametrize("transport", ["collective", "peer"])
def test_switch_phases_benchmark_splits_each_switch_on_every_rank(tmp_path: Any, transport: str) -> None:
    """python benchmarks/switch/switch_phases.py on the CPU (tiny model, two gloo ranks), over either switch transport:
    every rank reports each switch's permute and exchange times, which lie inside the pass's weight time."""
    root = os.path.join(os.path.dirname(__file__), "..")
    out = tmp_path / "phases.json"
    env = dict(os.environ, PYTHONPATH=os.path.abspath(root) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    script = os.path.join(root, "benchmarks", "switch", "switch_phases.py")
    r = subprocess.run([sys.executable, script, "--model", "builtin",
                        "--device", "cpu", "--switches", "2", "--switch-transport", transport, "--output", str(out)],
                       env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = load_result(out)
    assert res["gpu"] == "cpu" and res["num_gpus"] == 0 and res["params"]["switch_transport"] == transport
    assert res["command"].startswith("python benchmarks/switch/switch_phases.py --model builtin"), res["command"]
    switches = table(res, "switch")
    assert [s["to"] for s in switches] == ["ep", "tp"] and all(s["done"] for s in switches)
    assert all(s["transport"] == transport and (s["peer_exchanges"] > 0) == (transport == "peer")
               for s in switches), switches
    rows = table(res, "phases")
    assert sorted((p["rank"], p["to"]) for p in rows) == [(0, "ep"), (0, "tp"), (1, "ep"), (1, "tp")]
    for p in rows:
        local = p["unpack_ms"] if p["to"] == "ep" else p["pack_ms"]
        parts = [local, p["exchange_w13_ms"], p["exchange_w2_ms"]]
        assert all(x >= 0 for x in parts) and sum(parts) <= p["weights_ms"] + 1e-6, p


def test_tp_rank_model_holds_what_one_tp_rank_holds() -> None:
    """benchmarks/steps/tp_rank_model.py: the cut model on one rank has the local shapes of one rank of TP over P
    (heads, KV heads, expert intermediate, dense intermediate, experts), so timing it on one GPU times a TP rank's
    kernels."""
    from conftest import import_tool

    from moebius.config import PRESETS, read_hf_config
    from moebius.models.registry import model_config
    from moebius.parallel.layout import Layout

    tool = import_tool("steps/tp_rank_model.py")
    tp_rank_model_dir = tool.tp_rank_model_dir
    cut_presets = [p for p in sorted(PRESETS) if set(PRESETS[p]["architectures"]) & set(tool.CUT_FAMILIES)]
    assert "qwen3-30b-a3b" in cut_presets and "deepseek-v2-lite" in cut_presets
    for preset in sorted(set(PRESETS) - set(cut_presets)):  # another family's preset: refused, naming it
        with pytest.raises(ValueError, match=f"{preset}: its architecture"):
            tp_rank_model_dir(preset, 2)
    for preset in cut_presets:
        full = model_config(PRESETS[preset])
        cut = model_config(read_hf_config(tp_rank_model_dir(preset, 2)))
        rank, alone = Layout(full, "tp", 1, 2), Layout(cut, "tp", 0, 1)
        got = [(lay.num_heads, lay.num_kv_heads, lay.moe_inter, lay.dense_inter, lay.num_local_experts)
               for lay in (rank, alone)]
        assert got[0] == got[1], (preset, got)
        assert cut.vocab_size * 2 == full.vocab_size and cut.hidden_size == full.hidden_size


def test_bench_prefill_splits_a_step_over_several_prompts() -> None:
    """`bench_prefill` with `sequences`: one step of that many prompts (a burst's); a split it cannot make is an
    error naming its numbers; with `decodes`, running requests beside them (a mixed step)."""
    from moebius import LLM
    from moebius.link.messages import PrefillProbe

    with LLM() as llm:
        res = llm.engine.probe(PrefillProbe(tokens=40, context=4, steps=2, warmup=1, sequences=3))
        assert all(r["chunk_tokens"] == [14, 13, 13] and r["step_ms"] > 0 for r in res), res
        bad = llm.engine.probe(PrefillProbe(tokens=4, context=0, steps=1, warmup=0, sequences=5))
        assert all("sequences" in r["error"] and "5" in r["error"] for r in bad), bad
        # a mixed step: 6 requests decoding after 30 cached tokens come first, then the prompts
        res = llm.engine.probe(PrefillProbe(tokens=40, context=4, steps=1, warmup=0, sequences=3, decodes=6,
                                            decode_context=30))
        assert all(r["chunk_tokens"] == [14, 13, 13] and r["decodes"] == 6 and r["step_ms"] > 0 for r in res), res
        # the decodes are requests of the step: 3 prompts and 254 decodes do not fit 256 running requests
        bad = llm.engine.probe(PrefillProbe(tokens=40, context=4, steps=1, warmup=0, sequences=3, decodes=254,
                                            decode_context=30))
        assert all("room for 257 requests" in r["error"] for r in bad), bad
        bad = llm.engine.probe(PrefillProbe(tokens=40, context=4, steps=1, warmup=0, idle_s=-1.0))
        assert all("idle_s >= 0" in r["error"] and "-1.0" in r["error"] for r in bad), bad
