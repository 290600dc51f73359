"""`moebius bench rollout`: one RL rollout step, in process. N prompts arrive at once: short, clustered prompts and
heavy-tailed output lengths (log-normal, by default the DeepMath step's shape: prompts median ~120 tokens, outputs
median ~1,510 and p99 ~10,400, capped at 32,768; `--scale` shrinks the lengths for small runs). Every system decodes
exactly the same lengths (EOS ignored, per-request max_tokens): static TP, static EP, and auto mode with the rollout
profile (starts in EP, switches to TP once the batch drains below T_h). Reports completion time, output tokens/s,
time per layout, switches, and auto's speedup over the better and the worse static layout; JSON + a plot of running
requests and layout over time.

    moebius bench rollout --model qwen3-30b-a3b --load-format dummy --num-ranks 2 --requests 2048 --scale 0.25 \\
        --output benchmarks/results/rollout.json
"""

from __future__ import annotations

import argparse
import logging
import random
from typing import Any

from moebius.bench.results import gpus_used, params_of, save_result
from moebius.bench.workload import (
    Job,
    add_engine_args,
    compare,
    engine_config,
    lognormal,
    plot_timelines,
    prompts_of,
    run_systems,
    with_model_len,
)
from moebius.frontend.core import EngineCore

log = logging.getLogger("moebius")


def jobs_of(a: argparse.Namespace, vocab: int) -> list[Job]:
    rng = random.Random(a.seed)
    s = a.scale
    prompts = lognormal(rng, a.requests, a.prompt_median * s, a.prompt_p99 * s, 1, max(1, round(a.prompt_max * s)))
    outputs = lognormal(rng, a.requests, a.output_median * s, a.output_p99 * s, 1, max(1, round(a.output_cap * s)))
    return [Job(0.0, p, n) for p, n in zip(prompts_of(rng, prompts, vocab), outputs, strict=True)]


def add_workload_args(p: argparse.ArgumentParser) -> None:
    w = p.add_argument_group("workload")
    w.add_argument("--requests", type=int, default=2048)
    w.add_argument("--prompt-median", type=float, default=120)
    w.add_argument("--prompt-p99", type=float, default=600)
    w.add_argument("--prompt-max", type=int, default=1352)
    w.add_argument("--output-median", type=float, default=1510)
    w.add_argument("--output-p99", type=float, default=10400)
    w.add_argument("--output-cap", type=int, default=32768)
    w.add_argument("--scale", type=float, default=1.0, help="multiply every length (small runs)")
    w.add_argument("--seed", type=int, default=0)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("rollout", help="an RL rollout step: static TP vs static EP vs auto (rollout profile)",
                       description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_workload_args(p)
    add_engine_args(p, profile="rollout")
    p.add_argument("--output", default=None,
                    help="JSON path, its plot (PNG) beside it (default: the results are printed, no file written)")
    p.set_defaults(func=main)


def main(a: argparse.Namespace) -> int:
    cfg = engine_config(a)
    probe = jobs_of(a, vocab=1)  # the lengths alone, to size the context
    longest = max(len(j.prompt) + j.output_len for j in probe) + 1
    with EngineCore(with_model_len(cfg, longest)) as engine:
        jobs = jobs_of(a, engine.model_config.vocab_size)
        runs = run_systems(engine, jobs, a.systems.split(","), auto_start="ep", warmup=not a.no_warmup)
        auto_note = engine.auto.note if engine.auto is not None else "one rank: no switching"
    rows = [{"system": r.system, "completion_s": r.wall_s, "output_tokens": r.output_tokens,
             "output_tokens_per_s": r.output_tokens / r.wall_s, "tp_s": r.seconds_in("tp"),
             "ep_s": r.seconds_in("ep"), "switches": sum(1 for s in r.switches if s["done"])} for r in runs]
    timeline = [{"system": r.system, **x} for r in runs for x in r.samples]
    switches = [{"system": r.system, **x} for r in runs for x in r.switches]
    summary: dict[str, Any] = compare(runs)
    out_lens = sorted(j.output_len for j in jobs)
    summary.update(requests=len(jobs), output_len_median=out_lens[len(out_lens) // 2],
                   output_len_p99=out_lens[min(len(out_lens) - 1, int(0.99 * len(out_lens)))],
                   output_len_max=out_lens[-1])
    save_result(a.output, lambda _, png: plot_timelines(runs, png, f"rollout step: {len(jobs)} requests"),
                tables={"system": rows, "timeline": timeline, "switch": switches}, summary=summary,
                params=params_of(a), num_gpus=gpus_used(a.num_ranks, a.device),
                note=f"one rollout step of {len(jobs)} requests per system on one engine (same lengths, EOS "
                     f"ignored); auto: {auto_note}")
    for r in rows:
        print(f"{r['system']:>5}: {r['completion_s']:8.2f} s  {r['output_tokens_per_s']:9.0f} tok/s  "
              f"TP {r['tp_s']:.1f} s  EP {r['ep_s']:.1f} s  switches {r['switches']}")
    if "speedup_over_better_static" in summary:
        print(f"auto: {summary['speedup_over_better_static']:.3f}x the better static layout "
              f"({summary['better_static']}), {summary['speedup_over_worse_static']:.3f}x the worse")
    return 0
