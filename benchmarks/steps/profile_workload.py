"""Where a whole-request workload's steps spend their time (P = 1, in-process, under torch.profiler): the requests
of `moebius bench throughput` (same workload options) added at once, then each of the first --steps steps profiled
alone and the device waited for after it. Per step: its wall time (the call), the time until the device is idle,
the device's kernel time, the launches, the host's CUDA runtime/driver calls (launching, synchronizing), and the
longest single CPU op with the API time inside it: an op that blocks far past its own calls waits on the device
(a GEMM's first launch at a row count whose cuBLAS kernel was not used before waits for the device's queue to
drain, with either CUDA_MODULE_LOADING: docs/performance.md). The synchronizing calls include this script's own wait
for the device after the step. The workload runs --reps times on one engine (the prefix cache reset between), so a
first use shows against the repeat. --trace PATH: the Chrome trace (gzipped) of the step whose longest op blocks
longest past its own CUDA calls.

    python benchmarks/steps/profile_workload.py --model qwen3-30b-a3b --output benchmarks/results/h200-p1-steps.json
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import tempfile
import time
from collections import defaultdict
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from moebius.bench import throughput
from moebius.bench.results import params_of, save_result
from moebius.config import EngineConfig
from moebius.frontend.core import EngineCore
from moebius.models.registry import model_config
from moebius.models.source import hf_config_of
from moebius.sampling_params import SamplingParams


def parse() -> argparse.Namespace:
    sub = argparse.ArgumentParser().add_subparsers()
    throughput.add_parser(sub)  # the throughput command's engine and workload options
    ap = sub.choices["throughput"]
    ap.prog = "python benchmarks/steps/profile_workload.py"
    ap.add_argument("--steps", type=int, default=12, help="steps profiled from each repetition's start")
    ap.add_argument("--reps", type=int, default=2, help="the workload's runs on one engine")
    ap.add_argument("--trace", default=None, help="a .json.gz path for the most blocked step's Chrome trace")
    return ap.parse_args()


def step_row(prof: profile, wall: float, to_idle: float) -> dict[str, Any]:
    """The step's figures from its profile (ms)."""
    api: dict[str, float] = defaultdict(float)
    launches, device = 0, 0.0
    ops, calls = [], []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            device += e.device_time_total / 1e3
            continue
        if e.name.startswith("cu") and not e.name.startswith("cudnn"):  # runtime (cuda*) and driver (cu*) calls
            api[e.name] += e.cpu_time_total / 1e3
            launches += "Launch" in e.name
            calls.append(e)
        elif e.name.startswith("aten::") and e.cpu_parent is None:
            ops.append(e)
    top = max(ops, key=lambda e: e.cpu_time_total, default=None)
    inside = sum(c.cpu_time_total for c in calls if top is not None and
                 top.time_range.start <= c.time_range.start <= top.time_range.end) / 1e3
    return {"wall_ms": wall, "to_idle_ms": to_idle, "device_ms": device, "launches": launches,
            "launch_api_ms": sum(v for k, v in api.items() if "Launch" in k),
            "sync_api_ms": sum(v for k, v in api.items() if "Synchronize" in k),
            "other_api_ms": sum(v for k, v in api.items() if "Launch" not in k and "Synchronize" not in k),
            "longest_op": top.name if top else "", "longest_op_ms": top.cpu_time_total / 1e3 if top else 0.0,
            "longest_op_api_ms": inside}


def main() -> None:
    a = parse()
    cfg = EngineConfig.from_kwargs(**throughput.engine_shape_kwargs(a), mode=a.mode, warmup=a.warmup,
                                   quantization=a.quantization, fp8_activations=a.fp8_activations,
                                   quantization_scope=a.quantization_scope)
    jobs = throughput.workload(a, model_config(hf_config_of(a.model), a.num_layers).vocab_size)
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rows, worst, tmp = [], (-1.0, ""), tempfile.mkdtemp()
    with EngineCore(cfg) as engine:
        for rep in range(a.reps):
            engine.reset_prefix_cache()
            for prompt, n in jobs:
                engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
            sync()
            for i in range(a.steps):
                with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
                    t = time.perf_counter()
                    engine.step()
                    wall = (time.perf_counter() - t) * 1e3
                    sync()
                    to_idle = (time.perf_counter() - t) * 1e3
                w, rt = engine.last_work, engine.last_times
                row = {"rep": rep, "step": i, "tokens": w.tokens, "decode_tokens": w.decode_tokens,
                       "sequences": w.sequences, "host_ms": rt.host_ms, **step_row(prof, wall, to_idle)}
                rows.append(row)
                print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
                blocked = row["longest_op_ms"] - row["longest_op_api_ms"]
                if a.trace and blocked > worst[0]:
                    worst = (blocked, os.path.join(tmp, f"rep{rep}-step{i}.json"))
                    prof.export_chrome_trace(worst[1])
            engine.abort_all()
            while engine.has_unfinished():
                engine.step()
    if a.output:
        save_result(a.output, rows=rows, params=params_of(a),
                    note="per step (ms): wall (the step call), to_idle (until the device idles after it), device "
                    "(kernels' time), launches, the host's CUDA API time launching / synchronizing / other, and the "
                    "longest CPU op with the API time inside it")
    if worst[1]:
        with open(worst[1], "rb") as src, gzip.open(a.trace, "wb") as dst:
            shutil.copyfileobj(src, dst)
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
