"""`moebius bench throughput` end to end on the CPU (the built-in tiny model; one and two ranks; on one,
transformers' continuous batching on the same requests): every request decodes exactly its length, the step table
adds up to the run (kinds, tokens, floors), and the result is in the schema."""

from __future__ import annotations

import subprocess
import sys

import pytest

from moebius.bench.results import load_result, summary_of, table
from moebius.bench.throughput import kind
from moebius.engine.messages import StepWork


def test_kind_of_a_step() -> None:
    assert kind(StepWork()) == "idle"
    assert kind(StepWork(tokens=4, decode_tokens=4, sequences=4)) == "decode"
    assert kind(StepWork(tokens=40, sequences=2)) == "prefill"
    assert kind(StepWork(tokens=40, decode_tokens=3, sequences=5)) == "mixed"


@pytest.mark.parametrize("ranks,mode", [(1, "tp"), (2, "tp"), (2, "ep")])
def test_throughput_runs_on_cpu(tmp_path, ranks: int, mode: str) -> None:
    """Two ranks: a TP step is counted once (every rank runs it), EP ranks' steps are summed."""
    out = tmp_path / "tp.json"
    cmd = [sys.executable, "-m", "moebius.entrypoints.cli", "bench", "throughput", "--device", "cpu",
           "--num-ranks", str(ranks), "--mode", mode,
           "--num-prompts", "8", "--prompt-len-dist", "uniform", "--prompt-len-range", "8,32",
           "--output-len-dist", "uniform", "--output-len-range", "4,8", "--max-num-batched-tokens", "64",
           "--output", str(out)] + (["--hf-baseline"] if ranks == 1 else [])
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "req/s" in r.stdout and "the floor" in r.stdout
    result = load_result(out)
    s, steps = summary_of(result), table(result, "step")
    assert result["command"].startswith("moebius bench throughput") and result["num_gpus"] == 0
    assert s["requests"] == 8 and 8 * 8 <= s["input_tokens"] <= 8 * 32 and 8 * 4 <= s["output_tokens"] <= 8 * 8
    # every prompt token is prefilled once, and every output token but each request's first is a decode
    assert sum(st["tokens"] - st["decode_tokens"] for st in steps) == s["input_tokens"]
    assert sum(st["decode_tokens"] for st in steps) == s["output_tokens"] - s["requests"]
    assert max(st["tokens"] for st in steps) <= 64 * (ranks if mode == "ep" else 1)  # each rank's budget held
    assert {st["kind"] for st in steps} >= {"prefill", "decode"}
    assert s["floor_s"] > 0 and abs(s["ratio_to_floor"] - s["wall_s"] / s["floor_s"]) < 1e-9 * s["ratio_to_floor"]
    assert abs(sum(s[f"{k}_floor_s"] for k in ("prefill", "mixed", "decode")) - s["floor_s"]) < 1e-9
    assert 0 < s["first_ttft_s"] <= s["wall_s"] and s["steps"] == len(steps)
    assert abs(s["output_tokens_per_s"] - s["output_tokens"] / s["wall_s"]) < 1e-6 * s["output_tokens_per_s"]
    if ranks == 1:  # transformers' continuous batching served the same requests to the same lengths
        assert "hf_error" not in s, s.get("hf_error")
        assert s["hf_output_tokens"] == s["output_tokens"]
        assert abs(s["speedup_vs_hf"] - s["hf_wall_s"] / s["wall_s"]) < 1e-9 * s["speedup_vs_hf"]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib is not installed" in r.stderr
    else:
        assert (tmp_path / "tp.png").exists()
