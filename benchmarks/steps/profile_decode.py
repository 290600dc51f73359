"""Profile one decode step (graph replay and eager) of a preset on one GPU: the top CUDA kernels by time, printed
(and, with --output, written as a result: each step's top kernels, their calls and CUDA time). `--tp-rank-of P`
profiles one TP-P rank's kernels (benchmarks/steps/tp_rank_model.py).

    python benchmarks/steps/profile_decode.py --num-layers 4 --batch 1 --context 512
"""

from __future__ import annotations

import argparse
from typing import Any

from torch.profiler import ProfilerActivity, profile

# its sibling in benchmarks/steps: a script's own folder is where Python looks first
from tp_rank_model import tp_rank_model_dir

from moebius.bench.results import write_result
from moebius.config import EngineConfig
from moebius.frontend.core import EngineCore
from moebius.link.messages import DecodeProbe


def main() -> None:
    ap = argparse.ArgumentParser(prog="python benchmarks/steps/profile_decode.py")
    ap.add_argument("--model", default="qwen3-30b-a3b")
    ap.add_argument("--num-layers", type=int, default=4)
    ap.add_argument("--batch", type=int, nargs="+", default=[1])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--mode", default="tp")
    ap.add_argument("--quantization", default=None, help="as the engine's --quantization (fp8, mxfp4)")
    ap.add_argument("--fp8-activations", action="store_true", help="FP8 rows' GEMMs in W8A8")
    ap.add_argument("--graphs-only", action="store_true", help="profile graph replay alone (no eager step)")
    ap.add_argument("--output", help="a result JSON of the top kernels of each profiled step")
    ap.add_argument("--disable-pdl", action="store_true", help="launch without programmatic dependent launch: each "
                    "kernel's time its own (with PDL a kernel's includes its wait for the one before)")
    ap.add_argument("--top", type=int, default=25, help="kernels recorded a step")
    ap.add_argument("--tp-rank-of", type=int, default=0,
                    help="profile one rank of TP over this many GPUs on one GPU (benchmarks/steps/tp_rank_model.py)")
    a = ap.parse_args()
    model = tp_rank_model_dir(a.model, a.tp_rank_of) if a.tp_rank_of else a.model
    engine = EngineCore(EngineConfig.from_kwargs(
        model=model, load_format="dummy", num_layers=a.num_layers, max_model_len=a.context + 64,
        max_running_requests=max(a.batch), mem_fraction=0.5, cuda_graph_max_bs=max(a.batch), mode=a.mode,
        quantization=a.quantization, disable_pdl=a.disable_pdl, fp8_activations=a.fp8_activations))
    rows: list[dict[str, Any]] = []
    try:
        for b in a.batch:
            for graphs in (True,) if a.graphs_only else (True, False):
                engine.probe(DecodeProbe(batch=b, context=a.context, steps=3, warmup=2, graphs=graphs))
                with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                    r = engine.probe(DecodeProbe(batch=b, context=a.context, steps=5, warmup=0, graphs=graphs))
                print(f"=== batch {b} graphs={graphs} {r}")
                events = prof.key_averages()
                print(events.table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
                rows += top_kernels(events, b, graphs, r[0]["step_ms"], a.top)
    finally:
        engine.close()
    if a.output:
        write_result(a.output, rows, params=vars(a), note="per kernel: its calls in the profiled probe (a layer's "
                     "kernel's calls over the layers give the steps run), its CUDA time in all and a call; kernels "
                     "launched with PDL (unless --disable-pdl) wait inside for the one before, so a kernel after a "
                     "long one may show its wait")


def top_kernels(events: Any, batch: int, graphs: bool, step_ms: float, n: int = 25) -> list[dict[str, Any]]:
    """The n kernels of most CUDA time (device-side events only) as result rows."""
    def cuda_us(e: Any) -> float:
        return float(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0)))

    kernels = sorted((e for e in events if cuda_us(e) > 0 and not e.key.startswith("aten::")), key=cuda_us,
                     reverse=True)[:n]
    return [dict(batch=batch, graphs=graphs, step_ms=step_ms, kernel=e.key, calls=e.count, cuda_us=cuda_us(e),
                 cuda_us_per_call=cuda_us(e) / max(1, e.count)) for e in kernels]


if __name__ == "__main__":
    main()
