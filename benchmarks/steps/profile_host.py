"""Where a decode step's host time goes (P = 1, in-process): metadata, graph launch, wait, sampling; printed (a
cProfile table per batch, no JSON). Reaches into the engine's rank internals (`engine.ranks.rank.runner`).

    python benchmarks/steps/profile_host.py --num-layers 48 --batch 1 64 1024
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from moebius.config import EngineConfig
from moebius.frontend.core import EngineCore
from moebius.link.messages import DecodeProbe


def main() -> None:
    ap = argparse.ArgumentParser(prog="python benchmarks/steps/profile_host.py")
    ap.add_argument("--model", default="qwen3-30b-a3b")
    ap.add_argument("--num-layers", type=int, default=48)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64, 1024])
    ap.add_argument("--context", type=int, default=512)
    a = ap.parse_args()
    top = max(a.batch)
    engine = EngineCore(EngineConfig.from_kwargs(
        model=a.model, load_format="dummy", num_layers=a.num_layers, max_model_len=a.context + 64,
        max_running_requests=top, max_num_batched_tokens=max(top, 2048), mem_fraction=0.8, cuda_graph_max_bs=top))
    runner = engine.ranks.rank.runner
    for b in a.batch:
        r = engine.probe(DecodeProbe(batch=b, context=a.context, steps=5, warmup=2, graphs=True))[0]
        bucket = runner.graphs.bucket_for(b)
        g = runner.graphs
        # single launches (as in a step) against back-to-back ones
        t_launch, t_total = [], []
        for _ in range(5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            g.replay(bucket)
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t_launch.append(t1 - t0)
            t_total.append(time.perf_counter() - t0)
        print(f"batch {b}: step {r['step_ms']:.3f} ms, replay back-to-back {r['replay_ms']:.3f} ms, "
              f"single replay launch {min(t_launch) * 1e3:.3f} ms, launch+wait {min(t_total) * 1e3:.3f} ms",
              flush=True)
        # cProfile one set of steps through the runner
        orig = runner.launch
        prof = cProfile.Profile()

        def profiled(*args, prof=prof, orig=orig, **kw):
            prof.enable()
            try:
                step = orig(*args, **kw)
                step.result()  # the step resolved inside the profile
                return step
            finally:
                prof.disable()

        runner.launch = profiled
        engine.probe(DecodeProbe(batch=b, context=a.context, steps=5, warmup=0, graphs=True))
        runner.launch = orig
        pstats.Stats(prof).sort_stats("cumulative").print_stats(18)
    engine.close()


if __name__ == "__main__":
    main()
