"""The scheduler's host time a decode step (no model: pages and tables only): `requests` running requests of a
1000-token prompt each decoding one token a step, the median of `--steps` schedules, for every KV-group setting
given (none: one group without a window; a window: GPT-OSS's full + sliding groups). Works on trees from before KV
groups too (a BlockAllocator in place of KVPages), for an A/B.

    python benchmarks/steps/schedule_host.py --requests 256 --output benchmarks/results/cpu-schedule-host.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from moebius.bench.results import params_of, save_result
from moebius.link.request import Request, RequestSpec
from moebius.sampling_params import SamplingParams
from moebius.worker.scheduler import Scheduler


def _pages(window: int | None) -> Any:
    try:
        from moebius.memory.kv_pool import KVPages
    except ImportError:  # a tree from before KV groups
        from moebius.memory.kv_pool import BlockAllocator

        if window is not None:
            raise SystemExit("this tree has no KV groups: no window setting") from None
        return BlockAllocator(40000, 16)
    return KVPages(40000, 16, (None,) if window is None else (None, window))


def schedule_ms(requests: int, window: int | None, steps: int) -> float:
    s = Scheduler(_pages(window), max_running=requests, max_batched_tokens=65536, prefix_caching=False)
    for i in range(requests):
        s.add(Request(RequestSpec(f"r{i}", list(range(1000)), SamplingParams(max_tokens=100_000), 0, 200_000)))
    times = []
    for _ in range(steps + 1):  # the first schedules the prompts
        t = time.perf_counter()
        batch = s.schedule()
        times.append(time.perf_counter() - t)
        for c in batch:
            c.req.num_computed = c.start + c.num_tokens
            c.req.output_token_ids.append(1)
    return statistics.median(times[1:]) * 1e3


def plot(result: dict[str, Any], png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(5, 3))
    ax.bar([str(r["window"] or "no window") for r in rows], [r["schedule_ms"] for r in rows])
    ax.set_ylabel(f"ms a schedule, {rows[0]['requests']} decoding requests")
    fig.tight_layout()
    fig.savefig(png)


def main() -> None:
    ap = argparse.ArgumentParser(prog="python benchmarks/steps/schedule_host.py")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--windows", type=lambda s: [None if w == "none" else int(w) for w in s.split(",")],
                    default=[None, 128], help="comma-separated: none, or a sliding window in tokens")
    ap.add_argument("--output", default=None, help="JSON path, its plot (PNG) beside it")
    a = ap.parse_args()
    rows = [{"window": w, "requests": a.requests, "schedule_ms": schedule_ms(a.requests, w, a.steps)}
            for w in a.windows]
    result = save_result(a.output, plot, rows=rows, params=params_of(a), num_gpus=0,
                         note="the scheduler alone: pages and tables of running decodes, no model")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
