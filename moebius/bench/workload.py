"""What the workload benchmarks (`moebius bench rollout`, `moebius bench bursty`) share: seeded length
distributions, one engine that runs the same requests as static TP, static EP and auto mode in turn, the timed
driver, and what each run's mode timeline says.
"""

from __future__ import annotations

import argparse
import gc
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from moebius.config import DEFAULT_TOKEN_BUDGET, EngineConfig
from moebius.frontend.core import EngineCore
from moebius.outputs import RequestOutput
from moebius.sampling_params import SamplingParams

SYSTEMS = ("tp", "ep", "auto")


@dataclass(frozen=True)
class Job:
    arrival: float  # seconds after the run starts
    prompt: list[int]
    output_len: int  # decoded exactly (EOS ignored), so every system does the same work


def lognormal(rng: random.Random, n: int, median: float, p99: float, lo: int, hi: int) -> list[int]:
    """n lengths from the log-normal with this median and 99th percentile, clipped to [lo, hi]."""
    sigma = max(math.log(max(p99, median) / median) / 2.3263, 1e-9)
    return [min(hi, max(lo, round(rng.lognormvariate(math.log(median), sigma)))) for _ in range(n)]


def prompts_of(rng: random.Random, lengths: Sequence[int], vocab: int) -> list[list[int]]:
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def add_engine_shape_args(g: argparse._ArgumentGroup, num_ranks: int) -> None:
    """The engine flags every in-process benchmark takes: model, ranks, device, limits, memory, graphs."""
    g.add_argument("--model", default=None, help="preset name or model directory (default: the built-in model)")
    g.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    g.add_argument("--num-layers", type=int, default=None)
    g.add_argument("--num-ranks", type=int, default=num_ranks)
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    g.add_argument("--max-running-requests", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=DEFAULT_TOKEN_BUDGET)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--mem-fraction", type=float, default=0.85)
    g.add_argument("--cuda-graph-max-bs", type=int, default=256)
    g.add_argument("--disable-prefix-caching", action="store_true",
                   help="compute every prompt in full (each measured run starts with an empty prefix cache either way)")
    g.add_argument("--prefill-attention", default="auto", choices=["auto", "flash", "triton"],
                   help="the engine's --prefill-attention (the summary's flash_prefill says what ran)")


def engine_shape_kwargs(a: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig keywords of `add_engine_shape_args`'s flags."""
    return dict(model=a.model, load_format=a.load_format, num_layers=a.num_layers, num_ranks=a.num_ranks,
                device=a.device, max_running_requests=a.max_running_requests,
                max_num_batched_tokens=a.max_num_batched_tokens, max_model_len=a.max_model_len,
                mem_fraction=a.mem_fraction, cuda_graph_max_bs=a.cuda_graph_max_bs,
                disable_prefix_caching=a.disable_prefix_caching, prefill_attention=a.prefill_attention)


def add_engine_args(p: argparse.ArgumentParser, profile: str) -> None:
    g = p.add_argument_group("engine (each system runs on the same engine, one after the other)")
    add_engine_shape_args(g, num_ranks=2)
    g.add_argument("--switch-policy", default="threshold", choices=["threshold", "cost"])
    g.add_argument("--switch-profile", default=profile, choices=["interactive", "rollout"])
    g.add_argument("--switch-high", type=float, default=None, help="T_h (default: calibrated)")
    g.add_argument("--switch-low", type=float, default=None)
    g.add_argument("--switch-window", type=int, default=None)
    g.add_argument("--switch-cooldown", type=float, default=None)
    g.add_argument("--calibration-dir", default=None)
    g.add_argument("--systems", default=",".join(SYSTEMS), help="which of tp, ep, auto to run, in this order")
    g.add_argument("--no-warmup", action="store_true",
                   help="skip the unmeasured first run of the whole workload (it compiles the kernels for every "
                   "step shape the workload meets, which would otherwise stall the first system's run)")


def engine_config(a: argparse.Namespace) -> EngineConfig:
    return EngineConfig.from_kwargs(
        **engine_shape_kwargs(a), mode="auto" if a.num_ranks > 1 else "tp", switch_policy=a.switch_policy,
        switch_profile=a.switch_profile, switch_high=a.switch_high, switch_low=a.switch_low,
        switch_window=a.switch_window, switch_cooldown=a.switch_cooldown, calibration_dir=a.calibration_dir)


@dataclass
class Run:
    """One system's run of the jobs."""

    system: str
    wall_s: float
    outputs: list[RequestOutput]  # job order
    samples: list[dict[str, Any]]  # the mode timeline's samples (t from the run's start)
    switches: list[dict[str, Any]] = field(default_factory=list)

    def seconds_in(self, mode: str) -> float:
        """Time spent in `mode`, from the timeline's samples (each holds until the next)."""
        s = self.samples
        ends = [x["t"] for x in s[1:]] + [self.wall_s]
        return sum(max(0.0, e - x["t"]) for x, e in zip(s, ends, strict=True) if x["mode"] == mode)

    @property
    def output_tokens(self) -> int:
        return sum(o.num_output_tokens for o in self.outputs)


def drive(engine: EngineCore, jobs: Sequence[Job]) -> tuple[list[RequestOutput], float, float]:
    """Add each job at its arrival time (seconds after the start), step until all are done; (outputs in job order,
    the start's clock, wall seconds)."""
    order = sorted(range(len(jobs)), key=lambda i: jobs[i].arrival)
    ids: dict[str, int] = {}
    done: dict[int, RequestOutput] = {}
    t0 = time.perf_counter()
    nxt = 0
    while len(done) < len(jobs):
        now = time.perf_counter() - t0
        while nxt < len(order) and jobs[order[nxt]].arrival <= now:
            j = jobs[order[nxt]]
            sp = SamplingParams(temperature=0.0, max_tokens=j.output_len, ignore_eos=True)
            ids[engine.add_request(j.prompt, sp)] = order[nxt]
            nxt += 1
        if not engine.has_unfinished():
            if nxt < len(order):  # idle until the next arrival
                time.sleep(max(0.0, jobs[order[nxt]].arrival - (time.perf_counter() - t0)))
            continue
        for out in engine.step():
            if out.finished and out.request_id in ids:
                done[ids[out.request_id]] = out
    return [done[i] for i in range(len(jobs))], t0, time.perf_counter() - t0


def run_systems(engine: EngineCore, jobs: Sequence[Job], systems: Sequence[str], auto_start: str,
                warmup: bool = True) -> list[Run]:
    """The jobs on each system in turn: static TP, static EP (the engine pinned to a layout, policy off) and auto
    (the policy on, from `auto_start`). warmup: the jobs once first, unmeasured, in every layout the systems use
    (arrivals at once: the kernels of every step shape are compiled before any run is timed)."""
    auto = engine.auto
    if "auto" in systems and auto is None:
        raise ValueError("auto needs an engine of several ranks in --mode auto")
    engine.set_auto(None)
    if warmup:
        for layout in dict.fromkeys(auto_start if s == "auto" else s for s in systems):
            if engine.mode != layout:
                engine.switch_mode(layout, reason="bench: warm-up")
            drive(engine, [replace(j, arrival=0.0) for j in jobs])
    runs = []
    for system in systems:
        layout = auto_start if system == "auto" else system
        if engine.mode != layout:
            out = engine.switch_mode(layout, reason=f"bench: {system} run")
            if not out.done:
                raise RuntimeError(f"could not start the {system} run in {layout}: {out.reason}")
        if system == "auto":
            auto.reset()
            engine.set_auto(auto)
        # what the warm-up and earlier runs left is collected now and kept out of later collections, so that no run
        # pays for another's garbage: without it the first timed run was slower than the same layout timed second
        # (docs/performance-history.md, "Auto mode"; the rollout run of benchmarks/results/h200-p1-rollout.json)
        gc.collect()
        gc.freeze()
        engine.reset_prefix_cache()  # every run computes the same prompts: none finds the warm-up's or another's
        outputs, t0, wall = drive(engine, jobs)
        engine.set_auto(None)
        since = t0 - engine.timeline.start
        tl = engine.timeline.to_json(since=since)
        for x in tl["samples"] + tl["switches"]:
            x["t"] -= since
        samples = tl["samples"] or [{"t": 0.0, "mode": layout, "running": 0, "waiting": 0, "kv_used": 0.0}]
        if samples[0]["t"] > 0:  # the layout from the start of the run to its first sample
            samples.insert(0, {**samples[0], "t": 0.0, "mode": layout})
        runs.append(Run(system, wall, outputs, samples, tl["switches"]))
    return runs


def compare(runs: Sequence[Run]) -> dict[str, Any]:
    """Auto against the better and the worse static layout (by wall time), where all three ran."""
    by = {r.system: r for r in runs}
    if not {"tp", "ep", "auto"} <= set(by):
        return {}
    better, worse = sorted((by["tp"], by["ep"]), key=lambda r: r.wall_s)
    return {"better_static": better.system, "speedup_over_better_static": better.wall_s / by["auto"].wall_s,
            "speedup_over_worse_static": worse.wall_s / by["auto"].wall_s}


def with_model_len(cfg: EngineConfig, need: int) -> EngineConfig:
    """The config with max_model_len raised to hold the longest job, where it was left to the model."""
    return cfg if cfg.max_model_len is not None else replace(cfg, max_model_len=need)


def plot_timelines(runs: Sequence[Run], path: str, title: str, extra: Any = None) -> None:
    """Running requests over time per system, the layout shaded (EP darker); `extra(ax_list)` may add panels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(runs) + (1 if extra else 0)
    fig, axes = plt.subplots(n, 1, figsize=(9, 2.4 * n), squeeze=False)
    for ax, r in zip(axes[:, 0], runs, strict=False):
        t = [x["t"] for x in r.samples]
        ax.step(t, [x["running"] for x in r.samples], where="post", label="running")
        ends = t[1:] + [r.wall_s]
        for x, e in zip(r.samples, ends, strict=True):
            if x["mode"] == "ep":
                ax.axvspan(x["t"], e, color="tab:orange", alpha=0.15, lw=0)
        ax.set_title(f"{r.system}: {r.wall_s:.1f} s (shaded: EP)")
        ax.set_ylabel("running")
    if extra:
        extra(axes[len(runs):, 0])
    axes[-1, 0].set_xlabel("seconds")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
