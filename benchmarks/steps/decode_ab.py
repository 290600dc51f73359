"""Steady-state decode step (CUDA graph replay, overlapped host work) of a preset on this host's GPUs at a few
batches and layouts, for A/B runs of one code change: run once per variant of the code and compare the rows.

    python benchmarks/steps/decode_ab.py --num-ranks 2 --num-layers 48 --batches 1,2,4,8 --modes tp,ep --output ab.json
    python benchmarks/steps/decode_ab.py --tp-rank-of 2 --num-ranks 1 --batches 1,2 --modes tp  (one TP-2 rank's work)

The small-batch A/B files in benchmarks/results (h200x2-linear-pdl.json, h200-tp-rank-*.json, ...) hold its rows.
"""

from __future__ import annotations

import argparse
import json

# its sibling in benchmarks/steps: a script's own folder is where Python looks first
from tp_rank_model import tp_rank_model_dir

from moebius.bench.results import gpus_used, params_of, write_result
from moebius.config import EngineConfig
from moebius.frontend.core import EngineCore
from moebius.link.messages import DecodeProbe


def main() -> None:
    ap = argparse.ArgumentParser(prog="python benchmarks/steps/decode_ab.py")
    ap.add_argument("--model", default="qwen3-30b-a3b")
    ap.add_argument("--num-ranks", type=int, default=2)
    ap.add_argument("--num-layers", type=int, default=48)
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--modes", default="tp,ep")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--output", default="decode_ab.json")
    ap.add_argument("--tp-rank-of", type=int, default=0,
                    help="time one rank of TP over this many GPUs on one GPU (benchmarks/steps/tp_rank_model.py)")
    a = ap.parse_args()
    batches = [int(v) for v in a.batches.split(",")]
    model = tp_rank_model_dir(a.model, a.tp_rank_of) if a.tp_rank_of else a.model
    engine = EngineCore(EngineConfig.from_kwargs(
        model=model, load_format="dummy", num_layers=a.num_layers, num_ranks=a.num_ranks, mode="tp",
        max_model_len=a.context + 64, max_running_requests=max(batches),
        max_num_batched_tokens=max(2048, max(batches)), mem_fraction=0.6, cuda_graph_max_bs=max(batches)))
    out = []
    try:
        for mode in a.modes.split(","):
            if engine.mode != mode:
                engine.switch_mode(mode)
            for b in batches:
                r = engine.probe(DecodeProbe(batch=b, context=a.context, steps=8, warmup=3, graphs=True))
                # the slowest rank's median: the step waits for it
                out.append(dict(mode=mode, batch=b, step_ms=max(x["step_ms"] for x in r),
                                replay_ms=max(x["replay_ms"] or 0 for x in r)))
                print(json.dumps(out[-1]), flush=True)
    finally:
        engine.close()
    write_result(a.output, out, params=params_of(a), num_gpus=gpus_used(a.num_ranks),
                 note="median decode step (ms) of the slowest rank, CUDA graph replay (replay_ms: the replay alone)")


if __name__ == "__main__":
    main()
