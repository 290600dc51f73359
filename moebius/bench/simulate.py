"""`moebius bench simulate rollout|bursty`: the workload benchmarks' traces through a discrete-event model of the
engine, for static TP, static EP and auto mode (the engine's own policy code), driven by a calibration profile:
a measured one (`moebius calibrate`, `--profile FILE`), or one made from the floor model for a model, rank count
and GPU that are not at hand (`--floor-model PRESET --floor-ranks P`, step floors times `--efficiency`, the switch
floor times `--switch-efficiency`). `--validate RESULT.json` compares the simulated completion times with a real
run of the same trace (`moebius bench rollout|bursty` with the same workload flags).

The model: each step runs the running requests' next token and prefill chunks under the token budget (admission up
to `--max-running-requests`, first come first served, no preemption); a step of T tokens takes the layout's
calibrated decode step at batch T, or, where it holds a prompt chunk and the profile measured mixed steps (as the
engine runs them), the calibrated mixed step of T tokens; a switch takes the profile's switch time (nothing in flight)
plus the running requests' KV over the link (the floor model's KV term times `--switch-efficiency`). Where the
profile knows each layout's KV capacity (the floor model's does: TP's is 1/P of EP's for MLA's latent cache), the
KV the running requests hold stays within the layout's as the engine's scheduler keeps it (admission while a chunk
fits, preemption by recompute of the newest when a step does not), and auto mode switches only where the live KV
fits the target.

    moebius bench simulate rollout --floor-model qwen3-235b-a22b --floor-ranks 8 --requests 2048 \\
        --output benchmarks/results/sim-235b-p8-rollout.json
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import json
import statistics
from dataclasses import dataclass, field
from typing import Any

from moebius.bench import bursty, rollout
from moebius.bench.floor import decode_step_floor_ms, floor_kv_capacity, switch_floor_ms
from moebius.bench.results import load_result, params_of, save_result, table
from moebius.bench.workload import SYSTEMS, Job
from moebius.config import DEFAULT_TOKEN_BUDGET, PRESETS, EngineConfig, ModelConfig
from moebius.kernels.rows import FORMATS
from moebius.models.registry import model_config
from moebius.parallel.layout import MODES, check_quantized_layouts
from moebius.switch.auto import AutoMode
from moebius.switch.auto import build as build_auto
from moebius.switch.calibration import Calibration, CalibrationKey, weights_label
from moebius.switch.policy import StepCurve

FLOOR_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


@dataclass
class SimRun:
    system: str
    wall_s: float = 0.0
    seconds: dict[str, float] = field(default_factory=lambda: {"tp": 0.0, "ep": 0.0})
    switches: list[dict[str, Any]] = field(default_factory=list)
    ttft: list[tuple[float, float]] = field(default_factory=list)  # (arrival s, TTFT s)
    steps: list[tuple[float, float, int]] = field(default_factory=list)  # (end s, step s, decode tokens)
    most_kv: dict[str, int] = field(default_factory=lambda: {"tp": 0, "ep": 0})  # the most KV held, a layout
    preemptions: int = 0  # running requests sent back for want of KV (capacity)


def simulate(jobs: list[Job], curves: dict[str, StepCurve], switch_ms: dict[str, float], start: str,
             auto: AutoMode | None, budget: int, max_running: int, system: str,
             mixed: dict[str, StepCurve] | None = None, kv_ms_per_token: float = 0.0,
             capacity: dict[str, int] | None = None) -> SimRun:
    """One system's run of the jobs in the model above (auto None: the layout stays `start`). mixed: the step time
    by tokens of a step that holds a prompt chunk (None: as a decode step of as many tokens). kv_ms_per_token: what
    a switch adds for each token of KV the running requests hold (switch_ms is a switch with nothing in flight).
    capacity: tokens of KV each layout holds engine-wide (`Calibration.kv_tokens`; None: no limit), in tokens as
    the engine's scheduler keeps pages: a running request's next chunk or token needs room, else the most recently
    admitted one is preempted (it recomputes its prompt and output so far when admitted again), and nothing is
    admitted in a step that preempted; auto mode's switch is refused (`AutoMode.observe`) while the KV held exceeds
    the target's capacity."""
    run = SimRun(system)
    arrivals = sorted(range(len(jobs)), key=lambda i: jobs[i].arrival)
    pending = [(jobs[i].arrival, i) for i in arrivals]
    heapq.heapify(pending)
    waiting: list[int] = []
    running: dict[int, list[int]] = {}  # job -> [prompt tokens left, output tokens made], in admission order
    made_before: dict[int, int] = {}  # a preempted job's outputs: recomputed with its prompt when admitted again
    held: dict[int, int] = {}  # KV tokens a running job holds
    t, mode, left, used = 0.0, start, len(jobs), 0
    if capacity:
        for i, job in enumerate(jobs):
            if len(job.prompt) + job.output_len > min(capacity.values()):  # the engine refuses it at admission
                raise ValueError(f"job {i} needs {len(job.prompt) + job.output_len} tokens of KV, more than the "
                                 f"{min(capacity.values())} the smaller layout holds ({capacity})")

    def preempt(i: int) -> None:
        nonlocal used
        made_before[i] = running.pop(i)[1]
        used -= held.pop(i)
        waiting.insert(0, i)
        run.preemptions += 1

    while left:
        while pending and pending[0][0] <= t:
            waiting.append(heapq.heappop(pending)[1])
        if not running and not waiting:
            t = pending[0][0]
            continue
        cap = capacity[mode] if capacity else float("inf")
        tokens, decoding, chunks, preempted = budget, set(), {}, False
        for i in list(running):  # each running job's next token or prompt chunk, in admission order
            if not tokens:
                break
            if i not in running:
                continue
            st = running[i]
            n = 1 if st[0] == 0 else min(st[0], tokens)
            while used + n > cap:  # no room: the most recently admitted goes back to the queue's head
                victim = next(reversed(running))
                preempt(victim)
                preempted = True
                if victim == i:
                    break
            if i not in running:
                continue
            if st[0] == 0:
                decoding.add(i)
            else:
                chunks[i] = n
            tokens, used, held[i] = tokens - n, used + n, held[i] + n
        while waiting and tokens and not preempted and len(running) < max_running:
            i = waiting[0]
            made = made_before.get(i, 0)
            n = min(len(jobs[i].prompt) + made, tokens)
            if used + n > cap:
                break
            waiting.pop(0)
            running[i] = [len(jobs[i].prompt) + made, made]
            chunks[i] = n
            tokens, used, held[i] = tokens - n, used + n, n
        run.most_kv[mode] = max(run.most_kv[mode], used)
        step = float((mixed if mixed and chunks else curves)[mode].at(budget - tokens)) / 1e3
        t += step
        run.seconds[mode] += step
        run.steps.append((t, step, len(decoding)))
        for i, st in list(running.items()):
            if i in chunks:
                st[0] -= chunks[i]
                if st[0]:
                    continue  # a chunk that did not reach the prompt's end samples nothing
            elif i not in decoding:
                continue  # no room in this step's budget
            st[1] += 1
            if st[1] == 1:
                run.ttft.append((jobs[i].arrival, t - jobs[i].arrival))
            if st[1] >= jobs[i].output_len:
                del running[i]
                used -= held.pop(i)
                left -= 1
        if auto is not None:
            d = auto.observe(t, mode, len(running) + len(waiting),
                             lambda: [jobs[i].output_len - st[1] for i, st in running.items()],
                             (lambda kv=used: kv) if capacity else None)
            if d is not None:
                kv = sum(len(jobs[i].prompt) - st[0] + st[1] for i, st in running.items())
                cost = (switch_ms[d.target] + kv * kv_ms_per_token) / 1e3
                run.switches.append({"t": t, "source": mode, "target": d.target, "reason": d.reason, "ms": cost * 1e3})
                t += cost
                mode = d.target
                auto.switched(t)
    run.wall_s = t
    return run


def kv_switch_ms_per_token(cfg: ModelConfig, P: int, switch_efficiency: float) -> float:
    """A switch's time for each live token of KV: the floor model's KV term over the link, times the switch's
    measured distance from its floor."""
    n = 1 << 20
    return (switch_floor_ms(cfg, P, n) - switch_floor_ms(cfg, P, 0)) / n * switch_efficiency


def profile_model(key: CalibrationKey) -> ModelConfig | None:
    """The model a profile was measured on, where it is a preset (a checkpoint path may not be at hand)."""
    if key.model not in PRESETS:
        return None
    return model_config(PRESETS[key.model], num_layers=key.num_layers)


def floor_profile(preset: str, P: int, context: int, efficiency: float, switch_efficiency: float,
                  num_layers: int | None = None, mem_fraction: float = 0.85, quantization: str | None = None
                  ) -> Calibration:
    """A profile made from the floor model: each layout's step floor times `efficiency`, the weights' switch floor
    times `switch_efficiency`, and each layout's KV capacity on an H200 (`floor_kv_capacity`: `mem_fraction` of it
    less a rank's weights; TP's is 1/P of EP's for a latent cache); `quantization`: the engine's --quantization (its
    rows' bytes in the weights, the steps and the switch). ConfigError where TP cannot cut its quantized experts
    (auto mode needs both layouts)."""
    cfg = dataclasses.replace(model_config(PRESETS[preset], num_layers=num_layers), quantization=quantization or "")
    check_quantized_layouts(cfg, P, MODES)
    ms = {m: [decode_step_floor_ms(cfg, P, m, b, context) * efficiency for b in FLOOR_BATCHES] for m in ("tp", "ep")}
    switch = switch_floor_ms(cfg, P, 0) * switch_efficiency
    key = CalibrationKey(preset, cfg.num_layers, P, "floor model", weights_label("bfloat16", quantization))
    return Calibration(key, context, list(FLOOR_BATCHES), ms["tp"], ms["ep"], {"tp": switch, "ep": switch},
                       kv_tokens=floor_kv_capacity(cfg, P, mem_fraction))


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("simulate", help="the workload benchmarks through a model of the engine (projections)",
                       description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    kinds = p.add_subparsers(dest="workload", required=True)
    for name, module in (("rollout", rollout), ("bursty", bursty)):
        w = kinds.add_parser(name, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        module.add_workload_args(w)
        src = w.add_argument_group("profile (one of)")
        src.add_argument("--profile", help="a calibration JSON (moebius calibrate)")
        src.add_argument("--floor-model", choices=sorted(PRESETS), help="a profile from the floor model")
        src.add_argument("--floor-ranks", type=int, default=8)
        src.add_argument("--floor-layers", type=int, default=None,
                         help="cut the preset to its first N layers (default: all; DeepSeek-V3 and Kimi K2 do not "
                         "fit 8 H200s in bf16 whole: DeepSeek-V3 does in FP8, --floor-quantization fp8)")
        src.add_argument("--floor-context", type=int, default=1024, help="cached tokens a request in the floor")
        src.add_argument("--floor-quantization", default=None, choices=sorted(FORMATS),
                         help="the engine's --quantization: the floor counts its rows' bytes (weights, steps, switch)")
        src.add_argument("--efficiency", type=float, default=1.4,
                         help="step time / floor (as the sweep measured it from batch 16 on: ratio_to_floor in "
                         "benchmarks/results/h200x2-qwen3-30b-a3b-sweep.json)")
        src.add_argument("--switch-efficiency", type=float, default=2.0,
                         help="switch time / floor (as the sweep measured it: its switches' transfer_ms in "
                         "benchmarks/results/h200x2-qwen3-30b-a3b-sweep.json against floor.switch_floor_ms)")
        eng = w.add_argument_group("engine")
        eng.add_argument("--max-num-batched-tokens", type=int, default=DEFAULT_TOKEN_BUDGET)
        eng.add_argument("--max-running-requests", type=int, default=2048, help="requests running at once, all ranks")
        eng.add_argument("--switch-policy", default="threshold", choices=["threshold", "cost"])
        eng.add_argument("--switch-profile", default="rollout" if name == "rollout" else "interactive",
                         choices=["interactive", "rollout"])
        eng.add_argument("--switch-high", type=float, default=None, help="T_h (default: the profile's crossover)")
        eng.add_argument("--switch-low", type=float, default=None)
        eng.add_argument("--switch-window", type=int, default=None)
        eng.add_argument("--switch-cooldown", type=float, default=None)
        w.add_argument("--validate", help="a result JSON of the same trace (bench rollout|bursty): compare")
        w.add_argument("--output", default=None, help="JSON path (default: the results are printed, no file written)")
        w.set_defaults(func=main)


def main(a: argparse.Namespace) -> int:
    if bool(a.profile) == bool(a.floor_model):
        raise ValueError("give --profile FILE or --floor-model PRESET")
    if a.profile:
        with open(a.profile) as f:
            cal = Calibration.from_json(json.load(f))
    else:
        cal = floor_profile(a.floor_model, a.floor_ranks, a.floor_context, a.efficiency, a.switch_efficiency,
                            a.floor_layers, quantization=a.floor_quantization)
    tp, ep = cal.curves()
    curves = {"tp": tp, "ep": ep}
    mixed = dict(zip(("tp", "ep"), cal.mixed_curves(), strict=True)) if cal.mixed_curves() else None
    model = profile_model(cal.key)
    kv_ms = kv_switch_ms_per_token(model, cal.key.num_ranks, a.switch_efficiency) if model else 0.0
    if model is None:
        print(f"the profile's model {cal.key.model!r} is not a preset: switches cost no more with KV in flight")
    module = rollout if a.workload == "rollout" else bursty
    jobs = module.jobs_of(a, vocab=1)
    ecfg = EngineConfig.from_kwargs(mode="auto", switch_policy=a.switch_policy, switch_profile=a.switch_profile,
                                    switch_high=a.switch_high, switch_low=a.switch_low,
                                    switch_window=a.switch_window, switch_cooldown=a.switch_cooldown)
    start = "ep" if a.switch_profile == "rollout" else "tp"
    runs = []
    for system in SYSTEMS:
        auto = build_auto(ecfg, cal) if system == "auto" else None
        runs.append(simulate(jobs, curves, cal.switch_ms, start if auto else system, auto,
                             a.max_num_batched_tokens, a.max_running_requests, system, mixed, kv_ms,
                             cal.kv_tokens or None))
    rows = []
    for r in runs:
        decode = sum(n for _, _, n in r.steps)
        tpot = sum(s * n for _, s, n in r.steps) / decode if decode else None
        rows.append({"system": r.system, "completion_s": r.wall_s, "tp_s": r.seconds["tp"], "ep_s": r.seconds["ep"],
                     "switches": len(r.switches), "most_kv_tp": r.most_kv["tp"], "most_kv_ep": r.most_kv["ep"],
                     "preemptions": r.preemptions,
                     "ttft_p50_s": statistics.median(x for _, x in r.ttft),
                     "tpot_mean_ms": tpot * 1e3 if tpot else None})
    by = {r["system"]: r for r in rows}
    better = min(by["tp"]["completion_s"], by["ep"]["completion_s"])
    worse = max(by["tp"]["completion_s"], by["ep"]["completion_s"])
    summary: dict[str, Any] = {"speedup_over_better_static": better / by["auto"]["completion_s"],
                               "speedup_over_worse_static": worse / by["auto"]["completion_s"],
                               "crossover": cal.crossover() if cal.crossover() is not None else -1}
    if a.validate:  # rollout: completion time; bursty (its end is the trace's): the mean TPOT
        metric = "completion_s" if a.workload == "rollout" else "tpot_mean_ms"
        real = {r["system"]: r for r in table(load_result(a.validate), "system" if a.workload == "rollout"
                                               else "phase") if r.get("phase", "all") == "all"}
        for r in rows:
            if r["system"] in real and real[r["system"]].get(metric) and r[metric]:
                r[f"real_{metric}"] = real[r["system"]][metric]
                r["sim_over_real"] = r[metric] / r[f"real_{metric}"]
    save_result(a.output, tables={"system": rows, "switch": [{"system": r.system, **s} for r in runs
                                                             for s in r.switches]},
                summary=summary, params=params_of(a, profile_key=str(cal.key)), num_gpus=0, gpu="simulated",
                note=f"a discrete-event model of the engine over the {a.workload} trace, driven by "
                      f"{'the calibration ' + a.profile if a.profile else 'the floor model'} ({cal.summary()})")
    for r in rows:
        extra = f"  sim/real {r['sim_over_real']:.3f}" if "sim_over_real" in r else ""
        print(f"{r['system']:>5}: {r['completion_s']:9.2f} s  TP {r['tp_s']:.1f} s  EP {r['ep_s']:.1f} s  "
              f"switches {r['switches']}{extra}")
    print(f"auto: {summary['speedup_over_better_static']:.3f}x the better static layout, "
          f"{summary['speedup_over_worse_static']:.3f}x the worse")
    return 0
