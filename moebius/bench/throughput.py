"""`moebius bench throughput`: offline end-to-end speed, as `vllm bench throughput` measures it. N requests (prompt
and output lengths fixed, uniform, log-normal, or from a JSONL of lengths; EOS ignored, so each decodes exactly its
length) are added at once and served to the end through the engine's own loop. Reports requests/s, input and output
tokens/s, the time spent in prefill, mixed and decode steps, the first request's TTFT, and the ratio to an
end-to-end floor: the sum over the steps the engine ran of each step's floor (`bench/floor.py` `step_floor_ms`: the
larger of its FLOPs at the dense bf16 rate and its weight / KV bytes at HBM speed). JSON + a plot of step time
against its floor.

    moebius bench throughput --model qwen3-30b-a3b --load-format dummy --num-ranks 1 --num-prompts 256 \\
        --prompt-len-dist uniform --prompt-len-range 64,512 --output-len 128 --output benchmarks/results/tp.json
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import time
from typing import Any

from moebius.bench.floor import hardware_of, step_floor_ms
from moebius.bench.hf_baseline import run_throughput
from moebius.bench.results import gpu_name, gpus_used, params_of, save_result
from moebius.bench.workload import add_engine_shape_args, engine_shape_kwargs, lognormal
from moebius.config import EngineConfig
from moebius.frontend.core import EngineCore
from moebius.kernels.rows import FORMATS
from moebius.link.messages import StepWork
from moebius.models.registry import model_config
from moebius.models.source import hf_config_of
from moebius.sampling_params import SamplingParams

log = logging.getLogger("moebius")


def _lengths(rng: random.Random, n: int, dist: str, fixed: int, span: str | None, what: str) -> list[int]:
    if dist == "fixed":
        return [fixed] * n
    if span is None:
        raise ValueError(f"--{what}-len-dist {dist} needs --{what}-len-range A,B")
    lo, hi = (int(x) for x in span.split(","))
    if not 1 <= lo <= hi:
        raise ValueError(f"--{what}-len-range must be A,B with 1 <= A <= B, got {span!r}")
    if dist == "lognormal":  # long-tailed (RL rollouts): median --X-len, 99th percentile at B, clipped to [A, B]
        return lognormal(rng, n, fixed, hi, lo, hi)
    return [rng.randint(lo, hi) for _ in range(n)]


def workload(a: argparse.Namespace, vocab: int) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) per request: each prompt --samples-per-prompt times in a row (a GRPO
    group), each of those requests with its own output length."""
    rng = random.Random(a.seed)
    k = a.samples_per_prompt
    if k < 1:
        raise ValueError(f"--samples-per-prompt must be at least 1, got {k}")
    if a.lengths:
        with open(a.lengths) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        prompt_lens = [int(r["prompt_len"]) for r in rows]
        outputs = [int(r["output_len"]) for r in rows for _ in range(k)]
    else:
        prompt_lens = _lengths(rng, a.num_prompts, a.prompt_len_dist, a.prompt_len, a.prompt_len_range, "prompt")
        outputs = _lengths(rng, a.num_prompts * k, a.output_len_dist, a.output_len, a.output_len_range, "output")
    prompts = [[rng.randrange(vocab) for _ in range(p)] for p in prompt_lens]
    return [(prompts[i // k], o) for i, o in enumerate(outputs)]


def kind(w: StepWork) -> str:
    """prefill (no decode), decode (only decodes) or mixed; idle when the call launched nothing."""
    if not w.tokens:
        return "idle"
    return "decode" if w.decode_tokens == w.tokens else "prefill" if not w.decode_tokens else "mixed"


def run(engine: EngineCore, jobs: list[tuple[list[int], int]]) -> tuple[list[Any], list[dict[str, Any]], float]:
    """Add every request at once, step to the end; (outputs in job order, a row per step call, wall seconds)."""
    P, cfg = engine.world_size, engine.model_config
    t0 = time.perf_counter()
    ids = {engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)): i
           for i, (p, n) in enumerate(jobs)}
    done: dict[int, Any] = {}
    steps, hw = [], hardware_of(gpu_name())
    while len(done) < len(jobs):
        t = time.perf_counter()
        outs = engine.step()
        w, rt = engine.last_work, engine.last_times
        steps.append({"t_s": t - t0, "wall_ms": (time.perf_counter() - t) * 1e3, "kind": kind(w), "mode": engine.mode,
                      "tokens": w.tokens, "decode_tokens": w.decode_tokens, "sequences": w.sequences,
                      "preempted": w.preempted,
                      "floor_ms": step_floor_ms(cfg, P, engine.mode, w, hw=hw) if w.tokens else 0.0,
                      "host_ms": rt.host_ms, "sync_ms": rt.sync_ms, "wait_ms": rt.wait_ms})
        done.update({ids[o.request_id]: o for o in outs if o.finished and o.request_id in ids})
    return [done[i] for i in range(len(jobs))], steps, time.perf_counter() - t0


def probe(engine: EngineCore, jobs: list[tuple[list[int], int]], n: int) -> list[dict[str, Any]]:
    """Serve the first `n` jobs one after another; a row per request with its lengths, latency and TTFT."""
    rows = []
    for i, (prompt, out) in enumerate(jobs[:n]):
        t = time.perf_counter()
        (o,), _, _ = run(engine, [(prompt, out)])
        rows.append({"request": i, "prompt_len": len(prompt), "output_len": out,
                     "latency_s": time.perf_counter() - t, "ttft_s": o.ttft})
    return rows


def long_prompt(engine: EngineCore, vocab: int, n: int, decoders: int, seed: int
                ) -> tuple[list[dict[str, Any]], float]:
    """What a long prompt arriving does to requests already decoding: `decoders` requests decode (16 steps once all
    decode), then one prompt of `n` tokens arrives; a row per step call from then until its first token (phase
    "during"), after 16 of "before": the step's wall time is the inter-token gap every decoder sees. Returns the
    rows and the long prompt's TTFT (s)."""
    rng = random.Random(seed)
    keep = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)  # aborted once the prompt is in
    ids = [engine.add_request([rng.randrange(vocab) for _ in range(64)], keep) for _ in range(decoders)]
    rows: list[dict[str, Any]] = []
    first: dict[str, int] = {}
    long_id, before = None, 0
    while long_id is None or long_id not in first:
        t = time.perf_counter()
        outs = engine.step()
        wall, w = (time.perf_counter() - t) * 1e3, engine.last_work
        for o in outs:
            first.setdefault(o.request_id, len(rows))
        if long_id is not None or len(first) == decoders:
            rows.append({"phase": "during" if long_id is not None else "before", "wall_ms": wall, "kind": kind(w),
                         "tokens": w.tokens, "decode_tokens": w.decode_tokens})
            before += long_id is None
        if long_id is None and before == 16:
            long_id = engine.add_request([rng.randrange(vocab) for _ in range(n)],
                                         SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
            t_long = time.perf_counter()
    ttft = time.perf_counter() - t_long
    for i in ids:
        engine.abort(i)
    while engine.has_unfinished():
        engine.step()
    return rows, ttft


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("throughput", help="offline end-to-end speed of N requests against an end-to-end floor",
                       description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    e = p.add_argument_group("engine")
    add_engine_shape_args(e, num_ranks=1)
    e.add_argument("--mode", default="tp", choices=["tp", "ep"])
    e.add_argument("--warmup", default="auto", choices=["auto", "full", "none"],
                   help="the engine's start-up kernel warm-up (start-up time is reported: run with a fresh "
                   "TRITON_CACHE_DIR for a cold cache)")
    e.add_argument("--quantization", default=None, choices=sorted(FORMATS),
                   help="the engine's --quantization (each step's floor counts the quantized rows' bytes)")
    e.add_argument("--fp8-activations", action="store_true",
                   help="the engine's --fp8-activations (FP8 rows' GEMMs in W8A8)")
    e.add_argument("--quantization-scope", default="all", choices=["all", "experts"],
                   help="the engine's --quantization-scope (experts: the dense weights in the dtype; each step's "
                   "floor still counts them as quantized rows)")
    w = p.add_argument_group("workload")
    w.add_argument("--num-prompts", type=int, default=256)
    for what, length in (("prompt", 256), ("output", 128)):
        w.add_argument(f"--{what}-len-dist", default="fixed", choices=["fixed", "uniform", "lognormal"])
        w.add_argument(f"--{what}-len", type=int, default=length, help="the length (fixed), the median (lognormal)")
        w.add_argument(f"--{what}-len-range", default=None,
                       help="A,B: uniform on [A, B]; lognormal: clipped to [A, B], its 99th percentile at B")
    w.add_argument("--lengths", default=None, help='a JSONL of {"prompt_len": ..., "output_len": ...} per request')
    w.add_argument("--samples-per-prompt", type=int, default=1,
                   help="send each prompt this many times in a row, each with its own output length (the requests "
                   "--num-prompts x this): a GRPO rollout's groups, whose prompts the prefix cache computes once")
    w.add_argument("--seed", type=int, default=0)
    p.add_argument("--hf-baseline", action="store_true",
                   help="also serve the same requests through transformers' continuous batching (random weights of "
                   "the same shapes; before the engine starts), or where that fails its generate() in padded "
                   "batches of 64 (the result says which)")
    w.add_argument("--probe-requests", type=int, default=0,
                   help="before the workload, serve its first N requests one at a time right after start-up and "
                   "report each one's latency and TTFT (table probe): with fixed lengths, the first against the last "
                   "shows what start-up left to compile; with --lengths, TTFT against prompt length")
    w.add_argument("--long-prompt", type=int, default=0, metavar="N",
                   help="before the workload, with --long-prompt-decoders requests decoding, add one prompt of N "
                   "tokens: the decoders' inter-token gap before and while it is prefilled, and its TTFT (table "
                   "long_prompt): what the token budget per step costs running requests")
    w.add_argument("--long-prompt-decoders", type=int, default=64)
    w.add_argument("--warmup-requests", type=int, default=0,
                   help="serve this many of the requests first, unmeasured (default none: the first request after "
                   "start-up is part of what is measured)")
    p.add_argument("--output", default=None,
                    help="JSON path, its plot (PNG) beside it (default: the results are printed, no file written)")
    p.set_defaults(func=main)


def main(a: argparse.Namespace) -> int:
    cfg = EngineConfig.from_kwargs(**engine_shape_kwargs(a), mode=a.mode, warmup=a.warmup,
                                quantization=a.quantization, fp8_activations=a.fp8_activations,
                                quantization_scope=a.quantization_scope)
    hf_cfg = hf_config_of(a.model)
    model_cfg = model_config(hf_cfg, a.num_layers)
    vocab = model_cfg.vocab_size
    jobs = workload(a, vocab)
    # transformers first, on a free GPU (its model is freed before the engine takes its share of the memory)
    hf = run_throughput(hf_cfg, model_cfg.num_layers, jobs) if a.hf_baseline else {}
    t0 = time.perf_counter()
    with EngineCore(cfg) as engine:
        startup = time.perf_counter() - t0
        flash = bool(engine.query("kernels")[0]["flash_prefill"])
        probes = probe(engine, jobs, a.probe_requests)
        interference, long_ttft = (long_prompt(engine, vocab, a.long_prompt, a.long_prompt_decoders, a.seed)
                                   if a.long_prompt else ([], 0.0))
        if a.warmup_requests:
            run(engine, jobs[: a.warmup_requests])
        engine.reset_prefix_cache()  # the probes' and warm-up's prompts are the workload's: not found cached
        outs, steps, wall = run(engine, jobs)
    inp, out = sum(len(p) for p, _ in jobs), sum(o.num_output_tokens for o in outs)
    decodes = [s for s in steps if s["kind"] == "decode"]
    floor = sum(s["floor_ms"] for s in steps) / 1e3
    summary: dict[str, Any] = {
        "startup_s": startup, "requests": len(jobs), "wall_s": wall, "requests_per_s": len(jobs) / wall,
        "input_tokens": inp, "cached_tokens": sum(o.num_cached_tokens for o in outs),
        "output_tokens": out, "input_tokens_per_s": inp / wall, "output_tokens_per_s": out / wall,
        "first_ttft_s": outs[0].ttft, "flash_prefill": flash, "steps": len(steps),
        "preemptions": sum(s["preempted"] for s in steps),
        "floor_s": floor, "ratio_to_floor": wall / floor,
        **{f"{k}_s": sum(s["wall_ms"] for s in steps if s["kind"] == k) / 1e3 for k in ("prefill", "mixed", "decode")},
        **{f"{k}_floor_s": sum(s["floor_ms"] for s in steps if s["kind"] == k) / 1e3
           for k in ("prefill", "mixed", "decode")},
        # rank 0's median host and device-sync time of a decode step (link/messages.py RankTimes): sync ~0 is a
        # step whose device waits on the host
        **{f"decode_{x}_ms_p50": statistics.median(s[f"{x}_ms"] for s in decodes) if decodes else None
           for x in ("host", "sync")}}
    if a.hf_baseline:
        summary.update({f"hf_{k}": v for k, v in hf.items()})
        if "wall_s" in hf:
            summary["speedup_vs_hf"] = hf["wall_s"] / wall
    if probes:
        summary.update(first_probe_s=probes[0]["latency_s"], last_probe_s=probes[-1]["latency_s"],
                       first_over_last_probe=probes[0]["latency_s"] / probes[-1]["latency_s"])
    if interference:
        gaps = {ph: [r["wall_ms"] for r in interference if r["phase"] == ph] for ph in ("before", "during")}
        summary.update(long_prompt_ttft_s=long_ttft,
                       long_prompt_steps=len(gaps["during"]), itl_before_ms=statistics.median(gaps["before"]),
                       itl_during_mean_ms=statistics.fmean(gaps["during"]), itl_during_max_ms=max(gaps["during"]))
    title = f"{len(jobs)} requests: {wall:.2f} s, {wall / floor:.2f}x the floor"
    save_result(a.output, lambda _, png: plot(steps, png, title),
                tables={"step": steps, "probe": probes, "long_prompt": interference}, summary=summary,
                params=params_of(a), num_gpus=gpus_used(a.num_ranks, a.device),
                note="offline end-to-end: every request added at once and served to the end (EOS ignored); a step "
                     "row is one engine step() call (what it launched: its kind, tokens and floor; its wall time, "
                     "which with overlap scheduling is mostly the step before; host_ms / sync_ms / wait_ms: rank "
                     "0's host work, its wait on the device for tokens and its wait for the plan during the call); "
                     "ratio_to_floor = wall / the sum of the steps' floors; probe: --probe-requests requests served "
                     "one at a time right after start-up, before the workload (is the first as fast as the last?); "
                     "long_prompt: --long-prompt's steps, before and while the long prompt is prefilled (a step's "
                     "wall time: each decoder's gap)")
    if probes:
        print(f"probe requests one at a time: first {probes[0]['latency_s']:.3f} s, last "
              f"{probes[-1]['latency_s']:.3f} s")
    if interference:
        print(f"a {a.long_prompt}-token prompt among {a.long_prompt_decoders} decoding requests: TTFT "
              f"{summary['long_prompt_ttft_s']:.3f} s; their inter-token gap {summary['itl_before_ms']:.1f} ms "
              f"before, {summary['itl_during_mean_ms']:.1f} ms mean and {summary['itl_during_max_ms']:.1f} ms max "
              f"over its {summary['long_prompt_steps']} steps")
    if "hf_wall_s" in summary:
        print(f"transformers ({summary['hf_method']}): {summary['hf_wall_s']:.2f} s; moebius "
              f"{summary['speedup_vs_hf']:.1f}x faster")
    elif a.hf_baseline:
        print(f"transformers failed: {summary['hf_error']}")
    cached = f" ({summary['cached_tokens'] / inp:.0%} of them found cached)" if summary["cached_tokens"] else ""
    print(f"{len(jobs)} requests in {wall:.2f} s: {len(jobs) / wall:.2f} req/s, {inp / wall:.0f} input{cached} and "
          f"{out / wall:.0f} output tok/s; first TTFT {outs[0].ttft:.3f} s; prefill {summary['prefill_s']:.2f} s, "
          f"mixed {summary['mixed_s']:.2f} s, decode {summary['decode_s']:.2f} s; {wall / floor:.2f}x the floor "
          f"({floor:.2f} s); start-up {startup:.1f} s")
    return 0


def plot(steps: list[dict[str, Any]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    for k, color in (("prefill", "tab:red"), ("mixed", "tab:orange"), ("decode", "tab:blue")):
        pts = [s for s in steps if s["kind"] == k]
        ax.scatter([s["t_s"] for s in pts], [s["wall_ms"] for s in pts], s=6, color=color, label=f"{k} step")
        ax.scatter([s["t_s"] for s in pts], [s["floor_ms"] for s in pts], s=3, color=color, marker="_", alpha=0.6)
    ax.set_yscale("log")
    ax.set_xlabel("seconds")
    ax.set_ylabel("step (ms; dashes: its floor)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
