"""`moebius bench serve`, the load generator: its percentile / bin / summary helpers on hand-made numbers, then runs
against a real `moebius serve` (built-in model, CPU) at a tiny scale (Poisson, the bursty trace, a replay file) and
against a bare fake server (text chunks only, no /admin/status, a failing request)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

from conftest import free_port  # noqa: E402
from fastapi import FastAPI, Request  # noqa: E402  (module level: the app's annotations are resolved here)
from fastapi.responses import JSONResponse, StreamingResponse  # noqa: E402

from moebius.bench import bursty  # noqa: E402
from moebius.bench.results import load_result, summary_of, table  # noqa: E402
from moebius.bench.serve_stats import (  # noqa: E402
    Rec,
    align,
    bins_of,
    layout_changes,
    layouts_in,
    percentile,
    stats,
    step_intervals,
    step_ms,
    summarize,
    token_gaps,
)
from moebius.entrypoints.cli import build_parser, main  # noqa: E402

KEY = "bench-key"
LATENCIES = ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")


# ---- helpers on hand-made numbers ----

def test_percentile_interpolates_like_numpy() -> None:
    xs = [4.0, 1.0, 3.0, 2.0]
    assert percentile(xs, 0) == 1 and percentile(xs, 100) == 4 and percentile(xs, 50) == 2.5
    assert percentile(xs, 90) == pytest.approx(3.7) and percentile(xs, 99) == pytest.approx(3.97)
    assert percentile([7.0], 99) == 7 and percentile([], 50) is None
    assert stats([1.0, 2.0, 3.0]) == {"mean": 2.0, "p50": 2.0, "p90": pytest.approx(2.8), "p99": pytest.approx(2.98)}
    assert stats([]) == {"mean": None, "p50": None, "p90": None, "p99": None}


def _rec(i: int, sent: float, chunks: list[float], tokens: list[int], status: int = 200) -> Rec:
    r = Rec(i, sent, [1, 2], 2, sum(tokens), sent_s=sent, first_s=chunks[0] if chunks else None,
            end_s=(chunks or [sent])[-1], chunk_s=chunks, chunk_tokens=tokens, output_tokens=sum(tokens),
            status=status)
    r.error = None if status == 200 else f"HTTP {status}"
    return r


def test_summary_and_bins_by_hand() -> None:
    a = _rec(0, 0.0, [0.1, 0.2, 0.4], [1, 1, 2])  # TTFT 100 ms, TPOT (0.4 - 0.1) / 3 = 100 ms
    b = _rec(1, 0.5, [0.8, 1.2], [1, 1])  # TTFT 300 ms, TPOT 400 ms
    bad = _rec(2, 0.9, [], [], status=500)
    assert token_gaps(a) == [(0.2, pytest.approx(100)), (0.4, pytest.approx(100)), (0.4, pytest.approx(100))]
    assert a.tpot_ms() == pytest.approx(100) and b.ttft_ms() == pytest.approx(300)
    s = summarize([a, b, bad], duration=2.0, slo={"ttft": 200})
    assert (s["completed"], s["failed"], s["errors"]) == (2, 1, ["1 x HTTP 500"])
    assert s["output_tokens"] == 6 and s["input_tokens"] == 4 and s["request_throughput"] == 1.0
    assert s["goodput"] == 0.5  # only a meets TTFT <= 200 ms
    assert s["ttft_ms"]["mean"] == pytest.approx(200) and s["tpot_ms"]["p50"] == pytest.approx(250)
    assert sorted(s["itl_ms"][k] for k in ("p50", "p90", "p99")) == [s["itl_ms"][k] for k in ("p50", "p90", "p99")]
    assert summarize([a], 1.0, {})["goodput"] is None
    changes = layout_changes([{"run_t_s": -1.0, "mode": "tp"}, {"run_t_s": 0.7, "mode": "tp"}],
                             [{"run_t_s": 0.6, "target": "ep", "done": True}, {"run_t_s": 0.65, "done": False,
                                                                               "target": "tp"}])
    assert changes == [(-1.0, "tp"), (0.6, "ep"), (0.7, "tp")]
    assert layouts_in(changes, 0.0, 0.5) == ["tp"] and layouts_in(changes, 0.5, 1.0) == ["ep", "tp"]
    bins = bins_of([a, b, bad], bin_s=0.5, duration=1.3, changes=changes)
    assert [x["bin_start_s"] for x in bins] == [0.0, 0.5, 1.0]
    assert [x["arrivals"] for x in bins] == [1, 2, 0] and [x["completed"] for x in bins] == [1, 0, 1]
    assert [x["output_tokens"] for x in bins] == [4, 1, 1]
    assert bins[0]["ttft_ms.mean"] == pytest.approx(100) and bins[1]["ttft_ms.mean"] == pytest.approx(300)
    assert bins[0]["tpot_ms.mean"] == pytest.approx(100) and bins[1]["tpot_ms.mean"] is None
    assert bins[2]["tpot_ms.p99"] == pytest.approx(400) and bins[0]["itl_ms.p50"] == pytest.approx(150)
    assert bins[2]["modes"] == ["tp"]
    # the server's step time: the seconds between samples over the steps run between them (none while idle)
    samples = [{"run_t_s": -1.0, "steps": 10}, {"run_t_s": 0.1, "steps": 20}, {"run_t_s": 0.3, "steps": 30},
               {"run_t_s": 0.6, "steps": 30}, {"run_t_s": 0.9, "steps": 36}, {"run_t_s": None, "steps": 40}]
    assert step_intervals(samples) == [(0.1, pytest.approx(1.1), 10), (0.3, pytest.approx(0.2), 10),
                                       (0.9, pytest.approx(0.3), 6)]
    bins = bins_of([a, b, bad], bin_s=0.5, duration=1.3, changes=changes, samples=samples)
    assert [x["step_ms"] for x in bins] == [pytest.approx(1e3 * 1.3 / 20), pytest.approx(50), None]
    assert step_ms(step_intervals(samples), 0.0, 1.3) == pytest.approx(1e3 * 1.6 / 26)


def test_align_puts_the_first_busy_sample_at_the_first_send() -> None:
    samples = [{"t": 5.0, "running": 3, "waiting": 0}, {"t": 9.0, "running": 0, "waiting": 0},
               {"t": 10.5, "running": 1, "waiting": 0}, {"t": 11.0, "running": 2, "waiting": 1}]
    switches = [{"t": 10.75}]
    assert align(samples, switches, before_t=5.0, first_sent=0.5) == 10.0
    assert [s["run_t_s"] for s in samples] == [-5.0, -1.0, 0.5, 1.0] and switches[0]["run_t_s"] == 0.75
    assert align(samples, [], before_t=20.0, first_sent=0.5) is None and samples[0]["run_t_s"] is None


# ---- against a real server ----

@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`moebius serve` on the CPU (built-in model) in a subprocess; its base URL once /health answers."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path_factory.mktemp("serve") / "serve.log", "w+")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "moebius.entrypoints.cli", "serve", "--device", "cpu", "--port",
                             str(port), "--api-key", KEY], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "server did not start"
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _bench(url: str, out: str, *flags: str) -> dict[str, Any]:
    assert main(["bench", "serve", "--base-url", url, "--api-key", KEY, "--status-every", "0.2", "--output", out,
                 "--save-chunks", *flags]) == 0
    result = load_result(out)
    assert result["gpu"] == "cpu" and result["num_gpus"] == 0
    for r in table(result, "request"):
        assert r["status"] == 200 and r["error"] is None, r
        assert r["output_tokens"] == r["output_len"] == sum(r["chunk_tokens"]), r
        assert r["tokens_from"] == "token_ids" and r["ttft_ms"] > 0 and r["first_s"] <= r["end_s"]
    s = summary_of(result)
    assert s["failed"] == 0 and s["completed"] == s["requests"] == len(table(result, "request"))
    for key in LATENCIES:
        assert s[f"{key}.p50"] <= s[f"{key}.p90"] <= s[f"{key}.p99"], key
    bins = table(result, "bin")
    assert bins[0]["bin_start_s"] == 0 and bins[-1]["bin_end_s"] >= s["duration_s"]
    assert all(x["bin_end_s"] == pytest.approx(y["bin_start_s"]) for x, y in zip(bins, bins[1:], strict=False))
    assert sum(x["arrivals"] for x in bins) == sum(x["completed"] for x in bins) == s["requests"]
    assert sum(x["output_tokens"] for x in bins) == s["output_tokens"]
    timeline = table(result, "timeline")
    assert s["status_available"] and timeline and all(x["mode"] == "tp" for x in timeline)
    assert any(x["run_t_s"] is not None and 0 <= x["run_t_s"] <= s["duration_s"] for x in timeline)
    assert len({x["t"] for x in timeline}) == len(timeline)  # de-duplicated
    steps = [x["steps"] for x in sorted(timeline, key=lambda x: x["t"])]
    assert steps == sorted(steps) and s["step_ms"] > 0  # the server's step count, hence its step time
    # rank 0's times a step (its own process under serve): host work, no device to wait on, and its plan's wait
    assert s["rank_host_ms"] > 0 and s["rank_sync_ms"] >= 0 and s["rank_wait_ms"] >= 0
    # the server's CPU a step, of which its engine thread's is a part
    assert 0 < s["engine_cpu_ms"] <= s["server_cpu_ms"]
    assert s["http_cpu_ms"] > 0  # the HTTP process's own (the engine runs in a process of its own)
    png = os.path.splitext(out)[0] + ".png"
    try:
        import matplotlib  # noqa: F401

        assert os.path.exists(png)
    except ImportError:
        assert not os.path.exists(png)
    return result


def test_poisson_run(server: str, tmp_path: Any) -> None:
    result = _bench(server, f"{tmp_path}/poisson.json", "--num-prompts", "12", "--request-rate", "20",
                    "--prompt-len-dist", "uniform", "--prompt-len-range", "4,32", "--output-len-dist", "uniform",
                    "--output-len-range", "4,16", "--bin-s", "0.25", "--goodput", "ttft:60000,tpot:60000")
    rows, s = table(result, "request"), summary_of(result)
    assert len(rows) == 12 and {r["output_len"] for r in rows} <= set(range(4, 17))
    assert all(4 <= r["prompt_len"] <= 32 for r in rows) and s["input_tokens"] == sum(r["prompt_len"] for r in rows)
    assert s["goodput"] == pytest.approx(s["request_throughput"])  # SLOs of a minute: every request meets them
    assert result["params"]["model"] == "moebius-demo" and len(table(result, "bin")) >= 2


def test_bursty_trace(server: str, tmp_path: Any) -> None:
    trace = ["--trace", "bursty", "--burst1-rate", "30", "--burst1-s", "0.3", "--quiet-s", "0.6", "--quiet-rate-min",
             "2", "--quiet-rate-max", "4", "--burst2-rate", "30", "--burst2-s", "0.3", "--scale", "0.01",
             "--bin-s", "0.5"]
    result = _bench(server, f"{tmp_path}/bursty.json", *trace)
    jobs = bursty.jobs_of(build_parser().parse_args(["bench", "serve", *trace]), 256)
    rows = table(result, "request")
    assert [(r["scheduled_s"], r["output_len"], r["prompt_len"]) for r in rows] == \
        [(j.arrival, j.output_len, len(j.prompt)) for j in jobs]


def test_replay_file(server: str, tmp_path: Any) -> None:
    path = tmp_path / "trace.jsonl"
    lines = [{"arrival_s": 0.2, "prompt": "Hello there", "output_len": 5},
             {"arrival_s": 0.0, "prompt_len": 6, "output_len": 3},
             {"arrival_s": 0.1, "prompt_token_ids": [1, 2, 3, 4], "output_len": 7}]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    rows = table(_bench(server, f"{tmp_path}/replay.json", "--replay", str(path)), "request")
    assert [(r["scheduled_s"], r["output_len"]) for r in rows] == [(0.0, 3), (0.1, 7), (0.2, 5)]
    assert rows[0]["prompt_len"] == 6 and rows[1]["prompt_len"] == 4 and rows[2]["prompt_len"] > 0  # from usage


# ---- against a bare server: no token ids, no /admin/status, a failure ----

def test_bare_server_without_token_ids_or_status(tmp_path: Any) -> None:
    app = FastAPI()

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        return {"data": [{"id": "bare"}]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        body = await request.json()
        n = body["max_tokens"]
        if n == 2:
            return JSONResponse({"error": {"message": "no"}}, status_code=500)

        def events() -> Iterator[str]:
            for _ in range(n):
                yield f"data: {json.dumps({'choices': [{'index': 0, 'text': 'x'}]})}\n\n"
            usage = {"prompt_tokens": 9, "completion_tokens": n, "total_tokens": 9 + n}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not srv.started:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        path = tmp_path / "trace.jsonl"
        path.write_text("".join(json.dumps({"arrival_s": i * 0.05, "prompt_len": 3, "output_len": n}) + "\n"
                                for i, n in enumerate((4, 2, 6))))
        out = f"{tmp_path}/bare.json"
        assert main(["bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--replay", str(path),
                     "--no-token-ids", "--output", out]) == 0
    finally:
        srv.should_exit = True
        thread.join(30)
    result = load_result(out)
    rows, s = table(result, "request"), summary_of(result)
    assert [(r["status"], r["output_tokens"], r["tokens_from"]) for r in rows] == \
        [(200, 4, "usage"), (500, 0, "chunks"), (200, 6, "usage")]
    assert rows[0]["prompt_len"] == 9 and "chunk_tokens" not in rows[0]  # no --save-chunks
    assert s["failed"] == 1 and s["errors"][0].startswith("1 x HTTP 500") and s["completed"] == 2
    assert not s["status_available"] and table(result, "timeline") == [] and table(result, "switch") == []
    assert s["rank_host_ms"] is None and s["server_cpu_ms"] is None and s["http_cpu_ms"] is None
    assert s["step_ms"] is None


def test_no_server_is_a_clear_error(capsys: Any) -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    assert main(["bench", "serve", "--base-url", url, "--num-prompts", "1"]) == 2
    err = capsys.readouterr().err
    assert f"GET {url}/v1/models" in err and "is the server up?" in err
