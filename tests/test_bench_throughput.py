"""`moebius bench throughput` end to end on the CPU (the built-in tiny model; one and two ranks; on one,
transformers' continuous batching on the same requests): every request decodes exactly its length, the step table
adds up to the run (kinds, tokens, floors), and the result is in the schema."""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys

import pytest

from moebius.bench.results import load_result, summary_of, table
from moebius.bench.throughput import _lengths, kind, workload
from moebius.link.messages import StepWork


def test_kind_of_a_step() -> None:
    assert kind(StepWork()) == "idle"
    assert kind(StepWork(tokens=4, decode_tokens=4, sequences=4)) == "decode"
    assert kind(StepWork(tokens=40, sequences=2)) == "prefill"
    assert kind(StepWork(tokens=40, decode_tokens=3, sequences=5)) == "mixed"


def test_length_distributions(tmp_path) -> None:
    rng = random.Random(0)
    assert _lengths(rng, 3, "fixed", 7, None, "output") == [7, 7, 7]
    assert all(4 <= n <= 9 for n in _lengths(rng, 100, "uniform", 0, "4,9", "output"))
    tail = _lengths(rng, 2000, "lognormal", 300, "1,2048", "output")  # median 300, 99th percentile at the cap
    assert 1 <= min(tail) and max(tail) == 2048 and 250 < statistics.median(tail) < 350
    assert 0.002 < sum(n == 2048 for n in tail) / len(tail) < 0.03
    with pytest.raises(ValueError, match="--prompt-len-range"):
        _lengths(rng, 3, "uniform", 0, None, "prompt")
    path = tmp_path / "lengths.jsonl"
    path.write_text("\n".join(json.dumps({"prompt_len": p, "output_len": o}) for p, o in ((3, 5), (10, 1))) + "\n")
    jobs = workload(argparse.Namespace(seed=0, lengths=str(path), samples_per_prompt=1), vocab=50)
    assert [(len(p), o) for p, o in jobs] == [(3, 5), (10, 1)] and all(0 <= t < 50 for p, _ in jobs for t in p)
    groups = workload(argparse.Namespace(seed=0, lengths=str(path), samples_per_prompt=3), vocab=50)
    assert [(len(p), o) for p, o in groups] == [(3, 5)] * 3 + [(10, 1)] * 3  # a prompt's samples in a row
    assert groups[0][0] == groups[2][0] != groups[3][0]


@pytest.mark.parametrize("command,argv", [("throughput", ["--device", "cpu", "--num-prompts", "2"]),
                                          ("sweep", ["--batches", "1"])])
def test_bench_commands_hand_the_fp8_flags_to_the_engine(monkeypatch, command: str, argv: list[str]) -> None:
    """--quantization, --fp8-activations and --quantization-scope reach the engine's config of `bench throughput`
    and `bench sweep` (FP8's W8A8 beside W8A16; its dense weights in the dtype beside FP8 rows)."""
    import importlib

    from moebius.entrypoints.cli import build_parser

    module = importlib.import_module(f"moebius.bench.{command}")
    seen = []

    def engine(cfg):  # the engine's config, then stop before starting one
        seen.append(cfg)
        raise RuntimeError("stop")

    monkeypatch.setattr(module, "EngineCore", engine)
    a = build_parser().parse_args(["bench", command, *argv, "--quantization", "fp8", "--fp8-activations",
                                   "--quantization-scope", "experts"])
    with pytest.raises(RuntimeError, match="stop"):
        module.main(a)
    assert seen[0].quantization == "fp8" and seen[0].fp8_activations and seen[0].quantization_scope == "experts"


@pytest.mark.parametrize("ranks,mode", [(1, "tp"), (2, "tp"), (2, "ep")])
def test_throughput_runs_on_cpu(tmp_path, ranks: int, mode: str) -> None:
    """Two ranks: a TP step is counted once (every rank runs it), EP ranks' steps are summed."""
    out = tmp_path / "tp.json"
    cmd = [sys.executable, "-m", "moebius.entrypoints.cli", "bench", "throughput", "--device", "cpu",
           "--num-ranks", str(ranks), "--mode", mode,
           "--num-prompts", "8", "--prompt-len-dist", "uniform", "--prompt-len-range", "8,32",
           "--output-len-dist", "uniform", "--output-len-range", "4,8", "--max-num-batched-tokens", "64",
           "--output", str(out)] + (["--hf-baseline", "--probe-requests", "3", "--long-prompt", "100",
                                     "--long-prompt-decoders", "3"] if ranks == 1 else [])
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "req/s" in r.stdout and "the floor" in r.stdout
    result = load_result(out)
    s, steps = summary_of(result), table(result, "step")
    assert result["command"].startswith("moebius bench throughput") and result["num_gpus"] == 0
    assert s["requests"] == 8 and 8 * 8 <= s["input_tokens"] <= 8 * 32 and 8 * 4 <= s["output_tokens"] <= 8 * 8
    # every prompt token is prefilled once (random prompts share no page), and every output token but each
    # request's first is a decode
    assert s["cached_tokens"] == 0
    assert sum(st["tokens"] - st["decode_tokens"] for st in steps) == s["input_tokens"]
    assert sum(st["decode_tokens"] for st in steps) == s["output_tokens"] - s["requests"]
    assert max(st["tokens"] for st in steps) <= 64 * (ranks if mode == "ep" else 1)  # each rank's budget held
    assert {st["kind"] for st in steps} >= {"prefill", "decode"}
    assert s["preemptions"] == sum(st["preempted"] for st in steps) == 0  # the KV pool holds every request
    assert s["floor_s"] > 0 and abs(s["ratio_to_floor"] - s["wall_s"] / s["floor_s"]) < 1e-9 * s["ratio_to_floor"]
    assert abs(sum(s[f"{k}_floor_s"] for k in ("prefill", "mixed", "decode")) - s["floor_s"]) < 1e-9
    assert 0 < s["first_ttft_s"] <= s["wall_s"] and s["steps"] == len(steps) and s["startup_s"] > 0
    assert s["flash_prefill"] is False  # what attended the prompt chunks: on the CPU the torch reference
    assert abs(s["output_tokens_per_s"] - s["output_tokens"] / s["wall_s"]) < 1e-6 * s["output_tokens_per_s"]
    # rank 0's times a step: host work in every step that ran one; on the CPU no device to wait on, and with ranks
    # in processes (P = 2) the plan's wait where it had requests
    assert all(st["host_ms"] > 0 for st in steps if st["kind"] != "idle") and s["decode_host_ms_p50"] > 0
    assert all(st["sync_ms"] >= 0 for st in steps) and s["decode_sync_ms_p50"] < s["decode_host_ms_p50"]
    assert all(st["wait_ms"] == 0 for st in steps) if ranks == 1 else any(st["wait_ms"] > 0 for st in steps)
    if ranks == 1:  # the probes, one at a time after start-up; transformers' continuous batching on the same work
        probes = table(result, "probe")
        assert [p["request"] for p in probes] == [0, 1, 2] and all(p["latency_s"] >= p["ttft_s"] > 0 for p in probes)
        assert s["first_over_last_probe"] == probes[0]["latency_s"] / probes[-1]["latency_s"]
        # the long prompt among 3 decoding requests: 16 decode steps, then its 100 tokens in chunks of the budget
        # beside the 3 decodes (61 + 39 tokens), until its first token
        lp = table(result, "long_prompt")
        before, during = ([r for r in lp if r["phase"] == ph] for ph in ("before", "during"))
        assert len(before) == 16 and all(r["kind"] == "decode" and r["decode_tokens"] == 3 for r in before)
        assert sum(r["tokens"] - r["decode_tokens"] for r in during) == 100
        assert all(r["decode_tokens"] == 3 and r["tokens"] <= 64 for r in during if r["kind"] != "idle")
        assert s["long_prompt_steps"] == len(during) >= 2
        assert s["itl_during_max_ms"] == max(r["wall_ms"] for r in during)
        assert 0 < s["long_prompt_ttft_s"] and "a 100-token prompt among 3 decoding requests" in r.stdout
        assert "hf_error" not in s, s.get("hf_error")
        assert s["hf_output_tokens"] == s["output_tokens"]
        assert abs(s["speedup_vs_hf"] - s["hf_wall_s"] / s["wall_s"]) < 1e-9 * s["speedup_vs_hf"]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib is not installed" in r.stderr
    else:
        assert (tmp_path / "tp.png").exists()


@pytest.mark.parametrize("caching", [True, False])
def test_throughput_of_prompt_groups(tmp_path, caching: bool) -> None:
    """--samples-per-prompt 4: with the prefix cache each group's prompt is computed once (but its last token's
    page), without it four times."""
    out = tmp_path / "groups.json"
    cmd = [sys.executable, "-m", "moebius.entrypoints.cli", "bench", "throughput", "--device", "cpu",
           "--num-prompts", "3", "--samples-per-prompt", "4", "--prompt-len", "40", "--output-len", "4",
           "--output", str(out)] + ([] if caching else ["--disable-prefix-caching"])
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    result = load_result(out)
    s, steps = summary_of(result), table(result, "step")
    assert s["requests"] == 12 and s["input_tokens"] == 12 * 40 and s["output_tokens"] == 12 * 4
    prefilled = sum(st["tokens"] - st["decode_tokens"] for st in steps)
    # 40 tokens are 2 full pages of 16 and 8 more: three samples of each group start after the 32 cached
    assert s["cached_tokens"] == (3 * 3 * 32 if caching else 0)
    assert prefilled == s["input_tokens"] - s["cached_tokens"]


def test_throughput_takes_the_engines_quantization(tmp_path) -> None:
    """--quantization fp8 reaches the engine: the same requests run, and each step's floor counts FP8 rows' bytes
    (the engine's model config), so the whole floor is below the float run's."""
    floors = {}
    for quant in ([], ["--quantization", "fp8"]):
        out = tmp_path / f"q{len(quant)}.json"
        cmd = [sys.executable, "-m", "moebius.entrypoints.cli", "bench", "throughput", "--device", "cpu",
               "--num-prompts", "4", "--prompt-len", "16", "--output-len", "4", "--output", str(out), *quant]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        result = load_result(out)
        assert summary_of(result)["output_tokens"] == 16
        floors[bool(quant)] = summary_of(result)["floor_s"]
    assert 0 < floors[True] < floors[False]
