"""`moebius bench sweep`: steady-state decode step latency of TP and EP over global batch sizes, against the floor.

One dual-mode engine serves both layouts (it switches between them, so the sweep also times the weight-only
switch). Each point times decode steps of `batch` requests holding `context` cached tokens through the real runner
(CUDA graph when the per-rank batch has one, else eager), without prefill. Optionally a Hugging Face transformers
baseline runs the same shape (moebius/bench/hf_baseline.py). Results: JSON in the schema of moebius/bench/results.py
(`rows`, each tagged with its table: "decode", one point per mode and batch; "switch", each measured switch;
"memory", a rank's memory in one layout; "skipped", a point that could not run; "prefill" (with --prefill-chunks),
a step of one prompt chunk per rank against its floor; and one "summary" row: the switch
overhead's median and max per target layout, the crossover batch, dual_over_static_ep, wall_s) and a PNG plot next
to it.

    moebius bench sweep --model qwen3-30b-a3b --num-ranks 2 --context-len 512 --output sweep.json

Recorded: benchmarks/results/h200x2-*-sweep.json (+ .png), h200x2-qwen3-30b-a3b-switch-*.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import statistics
import time
from typing import Any

import torch

from moebius.bench.floor import decode_step_floor_ms, hardware_of, prefill_work, step_floor_ms
from moebius.bench.hf_baseline import BaselineSpec, point, run_one_gpu, run_tensor_parallel
from moebius.bench.results import command_line, flatten, gpu_name, gpus_used, params_of, save_result, summary_of, table
from moebius.config import PRESETS, EngineConfig, ModelConfig
from moebius.frontend.core import EngineCore
from moebius.kernels.rows import FORMATS
from moebius.link.messages import DecodeProbe, PrefillProbe, StepWork
from moebius.models.registry import model_config
from moebius.sampling_params import SamplingParams
from moebius.switch.policy import ep_ahead_from

log = logging.getLogger("moebius")


def run_engine_sweep(args: argparse.Namespace, cfg: ModelConfig) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(points, the rest: switches, memory ({mode: a record per rank}), skipped, switch_overhead_median_ms / _max_ms
    ({target mode: ms}))."""
    top, chunk, hw = max(args.batches), max(args.prefill_chunks, default=0), hardware_of(gpu_name())
    engine = EngineCore(EngineConfig.from_kwargs(
        model=args.model, load_format=args.load_format, num_layers=args.num_layers, num_ranks=args.num_ranks,
        mode=args.modes[0],
        max_running_requests=max(top, args.prefill_sequences + args.prefill_decodes if chunk else 1),
        max_num_batched_tokens=max(top, 2048, chunk + args.prefill_decodes),
        max_model_len=max(args.context_len + 64, args.prefill_prefix + chunk + 1, args.prefill_decode_context + 2),
        mem_fraction=args.mem_fraction, cuda_graph_max_bs=args.cuda_graph_max_bs,
        disable_cuda_graph=args.disable_cuda_graph, moe_kernel=args.moe_kernel, mixed_attention=args.mixed_attention,
        prefill_attention=args.prefill_attention, switch_overlap=args.switch_overlap,
        switch_transport=args.switch_transport, quantization=args.quantization,
        fp8_activations=args.fp8_activations, quantization_scope=args.quantization_scope,
        disable_shared_experts_stream=args.disable_shared_experts_stream))
    points: list[dict[str, Any]] = []
    out: dict[str, Any] = {"switches": [], "memory": {}, "skipped": [], "prefill": [],
                           "flash_prefill": bool(engine.query("kernels")[0]["flash_prefill"])}
    try:
        for mode in args.modes:
            if engine.mode != mode:
                res = measure_switch(engine, mode, args.context_len, min(args.switch_batch, top))
                out["switches"].append(res)
                log.info("switch to %s: %s", mode, res)
            out["memory"][mode] = engine.query("memory")
            for b in args.batches:
                res = engine.probe(DecodeProbe(batch=b, context=args.context_len, steps=args.steps,
                                               warmup=args.warmup, graphs=True))
                if any("error" in r for r in res):
                    out["skipped"].append({"mode": mode, "batch": b, "why": [r.get("error") for r in res]})
                    log.warning("%s batch %d skipped: %s", mode, b, "; ".join(str(r["error"]) for r in res
                                                                              if "error" in r))
                    continue
                step = max(r["step_ms"] for r in res)  # lockstep ranks: the step ends when the slowest does
                extra: dict[str, Any] = {}
                if all(r.get("replay_ms") for r in res):  # the graph alone: step_ms minus this is host work
                    extra["graph_replay_ms"] = max(r["replay_ms"] for r in res)
                extra["host_metadata_ms"] = max(r["metadata_ms"] for r in res)
                # the engine's default overlaps each step's host work with the step before; resolving every step
                # first (--disable-overlap-schedule) puts the host work on the critical path
                extra["overlap_schedule"] = not engine.config.disable_overlap_schedule
                extra["step_ms_no_overlap"] = max(r["step_ms_no_overlap"] for r in res)
                if b <= args.eager_up_to:
                    eager = engine.probe(DecodeProbe(batch=b, context=args.context_len, steps=args.steps,
                                                     warmup=args.warmup, graphs=False))
                    extra["eager_step_ms"] = max(r["step_ms"] for r in eager)
                    extra["graph_speedup"] = extra["eager_step_ms"] / step
                floor = decode_step_floor_ms(cfg, args.num_ranks, mode, b, args.context_len, hw=hw)
                p = point(mode, b, args.context_len, step, floor, all(r["cuda_graph"] for r in res), **extra)
                points.append(p)
                log.info("%s batch %d: %.3f ms (floor %.3f, x%.2f)%s", mode, b, step, floor, step / floor,
                         f" eager {extra['eager_step_ms']:.3f} ms" if "eager_step_ms" in extra else "")
            out["prefill"] += prefill_points(engine, args, cfg, mode)
        if len(set(args.modes)) == 2:  # more switches back and forth: one switch is one noisy sample
            for _ in range(args.switch_repeats):
                res = measure_switch(engine, "tp" if engine.mode == "ep" else "ep", args.context_len,
                                     min(args.switch_batch, top))
                out["switches"].append(res)
                log.info("switch to %s: %s", res.get("to"), res)
            done = [r for r in out["switches"] if r.get("done")]
            out["switch_overhead_median_ms"] = {to: statistics.median(r["overhead_ms"] for r in done if r["to"] == to)
                                                for to in {r["to"] for r in done}}
            # the target bounds every switch, not the median: the worst one (so far the run's first) next to it
            out["switch_overhead_max_ms"] = {to: max(r["overhead_ms"] for r in done if r["to"] == to)
                                             for to in {r["to"] for r in done}}
    finally:
        engine.close()
    return points, out


def prefill_points(engine: EngineCore, args: argparse.Namespace, cfg: ModelConfig, mode: str
                   ) -> list[dict[str, Any]]:
    """The prefill table: a step of one prompt chunk of each --prefill-chunks size per rank (after --prefill-prefix
    cached tokens) against its floor; in EP every rank prefills its own chunk, so the step's work is P chunks."""
    rows, hw = [], hardware_of(gpu_name())
    mixed = dict(decodes=args.prefill_decodes, decode_context=args.prefill_decode_context)
    for n in args.prefill_chunks:
        S = args.prefill_sequences
        res = engine.probe(PrefillProbe(tokens=n, context=args.prefill_prefix, steps=args.steps,
                                        warmup=args.warmup, sequences=S, **mixed))
        if any("error" in r for r in res):
            rows.append({"mode": mode, "tokens": n, "error": [r.get("error") for r in res]})
            continue
        work = prefill_work(n, args.prefill_prefix, S, **mixed, window=cfg.largest_window)
        work = sum([work] * (len(res) if mode == "ep" else 1), StepWork())
        step, floor = max(r["step_ms"] for r in res), step_floor_ms(cfg, args.num_ranks, mode, work, hw=hw)
        row = {"mode": mode, "tokens": n, "sequences": S, "prefix": args.prefill_prefix, **mixed,
               "mixed_attention": args.mixed_attention, "step_tokens": work.tokens,
               "step_ms": step, "floor_ms": floor, "ratio_to_floor": step / floor,
               "tokens_per_s": work.tokens / step * 1e3, "cuda_graph": all(r["pieces"] for r in res)}
        if args.prefill_idle > 0:  # the same step alone, the device idle before it (clocks off the power cap)
            alone = engine.probe(PrefillProbe(tokens=n, context=args.prefill_prefix, steps=args.steps, warmup=0,
                                              sequences=S, idle_s=args.prefill_idle, **mixed))
            row["step_ms_isolated"] = max(r["step_ms"] for r in alone)
            row["ratio_isolated"] = row["step_ms_isolated"] / floor
        if row["cuda_graph"]:  # the same step eagerly, for comparison
            eager = engine.probe(PrefillProbe(tokens=n, context=args.prefill_prefix, steps=args.steps,
                                              warmup=args.warmup, graphs=False, sequences=S, **mixed))
            row["eager_ms"] = max(r["step_ms"] for r in eager)
        rows.append(row)
        log.info("%s prefill %d: %.3f ms (floor %.3f, x%.2f)", mode, n, step, floor, step / floor)
    return rows


def measure_switch(engine: EngineCore, target: str, context_len: int, batch: int = 8) -> dict[str, Any]:
    """Switch with `batch` requests decoding, the way a serving loop does it: the decision rides on the next step's
    plan (engine.request_switch), so one round trip to the ranks carries the switch and the first step in the new
    layout. Reports that round trip (decision -> first step's tokens back), the transfer (weights_ms + kv_ms), the
    steady step time in the new layout at the same batch, and what is left over: the switch's own overhead."""
    sp = SamplingParams(temperature=0.0, max_tokens=max(16, context_len - 64), ignore_eos=True)
    ids = [engine.add_request([(i * 7919 + j * 31) % 251 + 1 for j in range(64)], sp) for i in range(batch)]
    for _ in range(3):  # prefill, then decoding
        engine.step()
    t = time.perf_counter()
    engine.request_switch(target)
    engine.step()
    if not engine.config.disable_overlap_schedule:
        engine.step()  # overlap: the first new-layout step's tokens come back when the next step is launched
    first = (time.perf_counter() - t) * 1e3
    steps = []
    for _ in range(5):
        t = time.perf_counter()
        engine.step()
        steps.append((time.perf_counter() - t) * 1e3)
    # the outcome, with its device times (they come with the step after the switch)
    res = engine.last_switch.to_json() if engine.last_switch is not None else {}
    for rid in ids:
        engine.abort(rid)
    engine.step()
    # overhead: what is left after the step that was in flight at the decision (drain_ms), the transfer (the
    # device time moving weights and KV) and one step in the new layout; so the switch's host work (planning,
    # agreeing, launching the pass) counts as overhead, not as transfer
    transfer = res.get("weights_ms", 0.0) + res.get("kv_ms", 0.0)
    res.update(batch=batch, switch_to_first_step_ms=first, next_step_ms=statistics.median(steps),
               transfer_ms=transfer,
               overhead_ms=first - res.get("drain_ms", 0.0) - transfer - statistics.median(steps))
    return res


def static_memory(args: argparse.Namespace, mode: str) -> list[dict[str, Any]]:
    """Peak memory per rank of an engine holding only `mode` (no switching), at the dual engine's KV capacity."""
    top = max(args.batches)
    engine = EngineCore(EngineConfig.from_kwargs(
        model=args.model, load_format=args.load_format, num_layers=args.num_layers, num_ranks=args.num_ranks,
        mode=mode, static_layout=True, max_running_requests=top, max_num_batched_tokens=max(top, 2048),
        max_model_len=args.context_len + 64, max_total_tokens=args.static_kv_tokens,
        cuda_graph_max_bs=args.cuda_graph_max_bs, disable_cuda_graph=args.disable_cuda_graph,
        moe_kernel=args.moe_kernel))
    try:
        engine.probe(DecodeProbe(batch=min(top, 256), context=args.context_len, steps=2, warmup=1, graphs=True))
        return engine.query("memory")
    finally:
        engine.close()


def crossover(points: list[dict[str, Any]]) -> int | None:
    """Smallest batch from which EP's step is faster than TP's at every larger measured batch."""
    tp = {p["batch"]: p["step_ms"] for p in points if p["mode"] == "tp"}
    ep = {p["batch"]: p["step_ms"] for p in points if p["mode"] == "ep"}
    common = sorted(set(tp) & set(ep))
    first = ep_ahead_from([tp[b] for b in common], [ep[b] for b in common])
    return None if first is None else common[first]


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    rows, params = table(result, "decode"), result["params"]
    modes = sorted({p["mode"] for p in rows if "step_ms" in p})
    for mode in modes:
        pts = sorted((p for p in rows if p["mode"] == mode and "step_ms" in p), key=lambda p: p["batch"])
        ax.plot([p["batch"] for p in pts], [p["step_ms"] for p in pts], marker="o", label=mode)
        if mode in ("tp", "ep"):
            ax.plot([p["batch"] for p in pts], [p["floor_ms"] for p in pts], linestyle="--", alpha=0.6,
                    label=f"{mode} floor")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("global decode batch")
    ax.set_ylabel("decode step (ms)")
    ax.set_title(f"{params['preset']} on {params['num_ranks']}x {result['gpu']}, context {params['context_len']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sweep", help="TP vs EP decode-step sweep over batch sizes against the floor",
                       description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="qwen3-30b-a3b", help="preset name or model directory")
    p.add_argument("--load-format", default="dummy", choices=["dummy", "auto"])
    p.add_argument("--num-layers", type=int, default=None, help="cut the model to its first N layers")
    p.add_argument("--num-ranks", type=int, default=max(1, torch.cuda.device_count()), help="GPUs")
    p.add_argument("--modes", nargs="+", default=["tp", "ep"], choices=["tp", "ep"])
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")],
                   default=[2 ** i for i in range(12)], help="global batch sizes, comma-separated")
    p.add_argument("--context-len", type=int, default=1024, help="cached tokens per request")
    p.add_argument("--steps", type=int, default=10, help="timed decode steps per point (median)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--prefill-chunks", type=lambda s: [int(x) for x in s.split(",")], default=[],
                   help="also time prefill steps of one prompt chunk of these sizes per rank, comma-separated "
                   "(e.g. 512,1024,2048,4096,8192,16384; table prefill)")
    p.add_argument("--prefill-prefix", type=int, default=0, help="cached tokens before each prefill chunk")
    p.add_argument("--prefill-sequences", type=int, default=1,
                   help="split each prefill step's tokens evenly over this many prompts (a burst's step)")
    p.add_argument("--prefill-decodes", type=int, default=0,
                   help="running requests decoding a token each beside each prefill step's prompts (a mixed step)")
    p.add_argument("--prefill-decode-context", type=int, default=1024,
                   help="cached tokens of each --prefill-decodes request")
    p.add_argument("--prefill-idle", type=float, default=0.5,
                   help="also time each prefill step after the device idled this many seconds (step_ms_isolated: a "
                   "lone prompt's step; 0: not timed). step_ms runs the steps back to back, which on an H200 holds "
                   "long steps at the card's power cap with its clocks lowered")
    p.add_argument("--quantization", default=None, choices=sorted(FORMATS),
                   help="the engine's --quantization (the floor counts the quantized rows' bytes)")
    p.add_argument("--fp8-activations", action="store_true",
                   help="the engine's --fp8-activations (FP8 rows' GEMMs in W8A8)")
    p.add_argument("--quantization-scope", default="all", choices=["all", "experts"],
                   help="the engine's --quantization-scope (experts: the dense weights in the dtype; the floor still "
                   "counts them as quantized rows)")
    p.add_argument("--disable-shared-experts-stream", action="store_true",
                   help="the engine's --disable-shared-experts-stream (shared experts after the routed ones)")
    p.add_argument("--mixed-attention", default="shared", choices=["shared", "apart"],
                   help="how the decodes of a step with prompt chunks attend (the engine's --mixed-attention)")
    p.add_argument("--prefill-attention", default="auto", choices=["auto", "flash", "triton"],
                   help="the engine's --prefill-attention (the summary's flash_prefill says what ran)")
    p.add_argument("--eager-up-to", type=int, default=8, help="also time eager steps up to this batch")
    p.add_argument("--mem-fraction", type=float, default=0.88)
    p.add_argument("--cuda-graph-max-bs", type=int, default=256)
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--moe-kernel", default="triton", choices=["triton", "grouped_mm"])
    p.add_argument("--compare-static", action="store_true",
                   help="also start an EP-only engine with the same KV capacity and compare peak memory")
    p.add_argument("--switch-batch", type=int, default=8,
                   help="requests decoding while the switches are timed (the EP -> TP request list grows with them)")
    p.add_argument("--switch-repeats", type=int, default=4,
                   help="switches back and forth after the sweep (with --switch-batch requests decoding) for the "
                   "switch overhead")
    p.add_argument("--switch-overlap", action="store_true",
                   help="the engine's --switch-overlap: the double-buffered switch pass")
    p.add_argument("--switch-transport", default="collective", choices=["collective", "peer"],
                   help="the engine's --switch-transport: how the switch's expert shards travel")
    p.add_argument("--hf-baseline", action="store_true",
                   help="also time transformers' own model (eager, and its continuous batching) on one GPU and, with "
                   "--num-ranks > 1, with its tensor-parallel plan over those GPUs (moebius/bench/hf_baseline.py)")
    p.add_argument("--hf-batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 64, 256])
    p.add_argument("--hf-tp-timeout", type=float, default=900.0,
                   help="seconds for transformers' tensor-parallel run; past it, its points are errors")
    p.add_argument("--output", default=None,
                    help="JSON path, its plot (PNG) beside it (default: the results are printed, no file written)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    if args.model in PRESETS:
        cfg_dict = PRESETS[args.model]
    else:
        with open(os.path.join(args.model, "config.json")) as f:
            cfg_dict = json.load(f)
    cfg = dataclasses.replace(model_config(cfg_dict, args.num_layers), quantization=args.quantization or "")
    t0 = time.perf_counter()
    points, other = run_engine_sweep(args, cfg)
    memory = other["memory"]
    if args.compare_static:
        # the same KV capacity as the dual-layout engine, so the difference is what holding both layouts costs
        args.static_kv_tokens = min(m["kv_tokens"] for m in memory["ep"])
        memory["static_ep"] = static_memory(args, "ep")
        dual = max(m["peak_reserved"] for m in memory["ep"])
        static = max(m["peak_reserved"] for m in memory["static_ep"])
        other["dual_over_static_ep"] = dual / static
    if args.hf_baseline:
        spec = BaselineSpec(cfg_dict=cfg_dict, num_layers=cfg.num_layers, batches=args.hf_batches,
                            context_len=args.context_len, steps=args.steps, warmup=args.warmup)
        points += run_one_gpu(spec)
        if args.num_ranks > 1:
            points += run_tensor_parallel(spec, args.num_ranks, args.hf_tp_timeout)
    other["crossover_batch"] = crossover(points)
    other["wall_s"] = time.perf_counter() - t0
    # params: the arguments (without the CLI's own plumbing), the model by name and its layer count as run
    params = params_of(args, preset=args.model, num_layers=cfg.num_layers)
    for plumbing in ("command", "bench", "static_kv_tokens"):
        params.pop(plumbing, None)
    tables = {"decode": points, "switch": [flatten(s) for s in other["switches"]],
              "memory": [{"mode": mode, "rank": rank, **flatten(rec)} for mode, recs in memory.items()
                         for rank, rec in enumerate(recs)],
              "skipped": other["skipped"], "prefill": other["prefill"]}
    summary = {k: other[k] for k in ("crossover_batch", "switch_overhead_median_ms", "switch_overhead_max_ms",
                                     "dual_over_static_ep", "flash_prefill", "wall_s") if k in other}
    result = save_result(args.output, plot, tables=tables, summary=summary, params=params,
                          num_gpus=gpus_used(args.num_ranks), command=command_line(),
                          note="decode step (ms) per mode and global batch against the floor (table decode); "
                               "switch: each switch with --switch-batch requests decoding; memory: per layout and "
                               "rank; prefill: a step of one prompt chunk per rank against its floor (bench/floor.py "
                               "step_floor_ms), step_ms back to back, step_ms_isolated each after the device idled "
                               "--prefill-idle s; summary: the switch overhead per target layout, the crossover batch")
    print(json.dumps({**{k: v for k, v in result.items() if k != "rows"}, "summary": summary_of(result)}, indent=1))
    for p in points:
        if "step_ms" in p:
            print(f"{p['mode']:>14} {p['batch']:>5} {p['step_ms']:9.3f} ms  floor {p['floor_ms']:8.3f}  "
                  f"x{p['ratio_to_floor']:.2f}  {p['tokens_per_s']:10.0f} tok/s  graph={p['cuda_graph']}"
                  + (f"  eager {p['eager_step_ms']:.3f} ms ({p['graph_speedup']:.1f}x)" if "eager_step_ms" in p
                     else ""))
    for p in other["skipped"]:  # (a batch past the KV pages: in the table, said here too)
        print(f"{p['mode']:>14} {p['batch']:>5} skipped: {'; '.join(str(w) for w in p['why'] if w)}")
    for p in other["prefill"]:
        if "step_ms" in p:
            print(f"{p['mode']:>14} prefill {p['tokens']:>6} {p['step_ms']:9.3f} ms  floor {p['floor_ms']:8.3f}  "
                  f"x{p['ratio_to_floor']:.2f}  {p['tokens_per_s']:10.0f} tok/s  graph={p['cuda_graph']}"
                  + (f"  eager {p['eager_ms']:.3f} ms" if "eager_ms" in p else "")
                  + (f"  alone {p['step_ms_isolated']:.3f} ms (x{p['ratio_isolated']:.2f})"
                     if "step_ms_isolated" in p else ""))
    return 0
