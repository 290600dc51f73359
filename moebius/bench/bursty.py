"""`moebius bench bursty`: online serving under a timed arrival trace, in process: a burst, a quiet period, a second
burst (Poisson arrivals; by default the shape of the paper's trace scaled down: bursts at 80 and 120 requests/s,
quiet at 1-5 requests/s, prompts 300-700 tokens, outputs U(800, 1200); rates, durations and lengths are flags).
Static TP, static EP and auto mode (interactive profile) serve the same trace. Reports TTFT (over arrivals) and TPOT
(over tokens emitted) in time bins and their p50 / p99 per system and per phase, with the mode timeline; JSON + plot.

    moebius bench bursty --model qwen3-30b-a3b --load-format dummy --num-ranks 2 --output benchmarks/results/bursty.json
"""

from __future__ import annotations

import argparse
import logging
import random
import statistics
from typing import Any

from moebius.bench.results import gpus_used, params_of, save_result
from moebius.bench.workload import Job, Run, add_engine_args, engine_config, plot_timelines, prompts_of, run_systems
from moebius.bench.workload import with_model_len as model_len_for
from moebius.frontend.core import EngineCore

log = logging.getLogger("moebius")


def phases(a: argparse.Namespace) -> list[tuple[str, float, float, float, float]]:
    """(name, start s, end s, lowest rate, highest rate) of the trace's phases."""
    b1, q, b2 = a.burst1_s, a.quiet_s, a.burst2_s
    return [("burst1", 0.0, b1, a.burst1_rate, a.burst1_rate),
            ("quiet", b1, b1 + q, a.quiet_rate_min, a.quiet_rate_max),
            ("burst2", b1 + q, b1 + q + b2, a.burst2_rate, a.burst2_rate)]


def jobs_of(a: argparse.Namespace, vocab: int) -> list[Job]:
    """Poisson arrivals per phase (the quiet phase's rate drawn anew every second between its bounds)."""
    rng = random.Random(a.seed)
    times: list[float] = []
    for _, start, end, lo, hi in phases(a):
        t = start
        while True:
            rate = rng.uniform(lo, hi)
            t += rng.expovariate(rate) if rate > 0 else end - t + 1
            if t >= end:
                break
            times.append(t)
    s = a.scale
    plens = [max(1, round(rng.uniform(a.prompt_min, a.prompt_max) * s)) for _ in times]
    olens = [max(1, round(rng.uniform(a.output_min, a.output_max) * s)) for _ in times]
    return [Job(t, p, n) for t, p, n in zip(times, prompts_of(rng, plens, vocab), olens, strict=True)]


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def latencies(run: Run, jobs: list[Job], t0: float) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """(arrival s, TTFT s) per request and (emission s, gap s) per output token after a request's first, with times
    from the run's start (t0: the first arrival's clock)."""
    ttft, tpot = [], []
    for out in run.outputs:
        start = out.arrival_time
        if out.ttft is not None:
            ttft.append((start - t0, out.ttft))
        times = out.outputs[0].token_times
        tpot += [(b - t0, b - a) for a, b in zip(times, times[1:], strict=False)]
    return ttft, tpot


def add_workload_args(p: argparse.ArgumentParser) -> None:
    w = p.add_argument_group("workload")
    w.add_argument("--burst1-rate", type=float, default=80.0)
    w.add_argument("--burst1-s", type=float, default=3.0)
    w.add_argument("--quiet-rate-min", type=float, default=1.0)
    w.add_argument("--quiet-rate-max", type=float, default=5.0)
    w.add_argument("--quiet-s", type=float, default=60.0)
    w.add_argument("--burst2-rate", type=float, default=120.0)
    w.add_argument("--burst2-s", type=float, default=3.0)
    w.add_argument("--prompt-min", type=int, default=300)
    w.add_argument("--prompt-max", type=int, default=700)
    w.add_argument("--output-min", type=int, default=800)
    w.add_argument("--output-max", type=int, default=1200)
    w.add_argument("--scale", type=float, default=1.0, help="multiply every length (small runs)")
    w.add_argument("--bin-s", type=float, default=10.0, help="width of the reporting bins")
    w.add_argument("--seed", type=int, default=0)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bursty", help="a bursty arrival trace: static TP vs static EP vs auto (interactive profile)",
                       description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_workload_args(p)
    add_engine_args(p, profile="interactive")
    p.add_argument("--output", default=None,
                    help="JSON path, its plot (PNG) beside it (default: the results are printed, no file written)")
    p.set_defaults(func=main)


def main(a: argparse.Namespace) -> int:
    cfg = engine_config(a)
    longest = round((a.prompt_max + a.output_max) * a.scale) + 2
    with EngineCore(model_len_for(cfg, longest)) as engine:
        jobs = jobs_of(a, engine.model_config.vocab_size)
        runs = run_systems(engine, jobs, a.systems.split(","), auto_start="tp", warmup=not a.no_warmup)
        auto_note = engine.auto.note if engine.auto is not None else "one rank: no switching"
    rows, bins, names = [], [], phases(a)
    for r in runs:
        t0 = min(o.arrival_time for o in r.outputs) - min(j.arrival for j in jobs)
        ttft, tpot = latencies(r, jobs, t0)
        for name, start, end, *_ in names + [("all", 0.0, float("inf"), 0, 0)]:
            in_ttft = [v for t, v in ttft if start <= t < end]
            in_tpot = [v for t, v in tpot if start <= t < end]
            rows.append({"system": r.system, "phase": name, "requests": len(in_ttft),
                         "ttft_mean_s": statistics.fmean(in_ttft) if in_ttft else None,
                         "ttft_p50_s": pct(in_ttft, 0.5), "ttft_p99_s": pct(in_ttft, 0.99),
                         "tpot_mean_ms": statistics.fmean(in_tpot) * 1e3 if in_tpot else None,
                         "tpot_p50_ms": (pct(in_tpot, 0.5) or 0) * 1e3, "tpot_p99_ms": (pct(in_tpot, 0.99) or 0) * 1e3})
        n_bins = int(max(r.wall_s, names[-1][2]) // a.bin_s) + 1
        for k in range(n_bins):
            lo, hi = k * a.bin_s, (k + 1) * a.bin_s
            bt = [v for t, v in ttft if lo <= t < hi]
            bp = [v for t, v in tpot if lo <= t < hi]
            bins.append({"system": r.system, "bin_start_s": lo, "arrivals": len(bt),
                         "ttft_mean_s": statistics.fmean(bt) if bt else None,
                         "tpot_mean_ms": statistics.fmean(bp) * 1e3 if bp else None})
    timeline = [{"system": r.system, **x} for r in runs for x in r.samples]
    switches = [{"system": r.system, **x} for r in runs for x in r.switches]
    summary: dict[str, Any] = {"requests": len(jobs), "trace_s": names[-1][2]}
    def panels(axes: Any) -> None:
        for r in runs:
            pts = [(b["bin_start_s"], b["tpot_mean_ms"]) for b in bins if b["system"] == r.system
                   and b["tpot_mean_ms"] is not None]
            axes[0].plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=r.system)
        axes[0].set_ylabel("TPOT (ms)")
        axes[0].legend()

    save_result(a.output, lambda _, png: plot_timelines(runs, png, f"bursty trace: {len(jobs)} requests", panels),
                tables={"phase": rows, "bin": bins, "timeline": timeline, "switch": switches},
                summary=summary, params=params_of(a), num_gpus=gpus_used(a.num_ranks, a.device),
                note=f"a bursty trace of {len(jobs)} requests served by each system on one engine; TTFT over "
                     f"arrivals, TPOT over tokens emitted, by phase and in {a.bin_s:g} s bins; auto: {auto_note}")
    for row in rows:
        if row["phase"] in ("burst1", "quiet", "burst2"):
            print(f"{row['system']:>5} {row['phase']:>7}: TTFT p50 {row['ttft_p50_s'] or 0:.3f} s p99 "
                  f"{row['ttft_p99_s'] or 0:.3f} s  TPOT p50 {row['tpot_p50_ms']:.1f} ms "
                  f"p99 {row['tpot_p99_ms']:.1f} ms")
    return 0
