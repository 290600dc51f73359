"""Where a prefill step's and an eager decode step's GPU time goes (P = 1, in-process): the kernels of one step,
by total device time, from torch.profiler; printed (no JSON). For finding what keeps a step off its floor.

    python benchmarks/steps/profile_steps.py --prefill 2048 8192 --decode 1024 --context 1024
    python benchmarks/steps/profile_steps.py --prefill 8192 --prompts 28 --decode   # a burst's step of short prompts
    python benchmarks/steps/profile_steps.py --prefill 512 --beside 255 --decode --mixed-attention apart  # mixed
    python benchmarks/steps/profile_steps.py --prefill --decode 512 1024 --pieces  # decode batches in step pieces
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from functools import partial

import torch
from torch.profiler import ProfilerActivity, profile

from moebius.config import EngineConfig
from moebius.frontend.core import EngineCore
from moebius.link.messages import DecodeProbe, PrefillProbe, Probe


def table(prof: profile, layers: int, rows: int) -> str:
    """The top kernels by device time, per step. The steps are counted from the kernels, not from what was asked:
    `bench_decode` launches more steps than it times (a first one, then with and without overlap); a step runs its
    per-layer kernels `layers` times each, so the fewest multiples of `layers` any kernel ran is the step count."""
    events = [e for e in prof.key_averages() if e.device_time_total > 0 and e.device_type.name == "CUDA"]
    events.sort(key=lambda e: e.device_time_total, reverse=True)
    steps = min((e.count // layers for e in events if e.count >= layers and e.count % layers == 0), default=1)
    total = sum(e.device_time_total for e in events) / steps / 1e3
    lines = [f"  {steps} steps profiled; device time per step {total:.2f} ms"]
    for e in events[:rows]:
        ms = e.device_time_total / steps / 1e3
        lines.append(f"  {ms:8.3f} ms {100 * ms / total:5.1f}%  x{e.count // steps:<4d} {e.key[:110]}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(prog="python benchmarks/steps/profile_steps.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-30b-a3b", help="preset (dummy weights); 'builtin': the demo model")
    ap.add_argument("--num-layers", type=int, default=None)
    ap.add_argument("--prefill", type=int, nargs="*", default=[2048, 8192], help="prompt chunk sizes")
    ap.add_argument("--prompts", type=int, default=1, help="split each prefill step over this many prompts")
    ap.add_argument("--beside", type=int, default=0,
                    help="requests decoding beside each prefill step's prompts, each after --context cached tokens "
                    "(a mixed step)")
    ap.add_argument("--mixed-attention", default="shared", choices=["shared", "apart"],
                    help="how those decodes attend (the engine's --mixed-attention)")
    ap.add_argument("--decode", type=int, nargs="*", default=[1024], help="decode batches (eager, no graphs)")
    ap.add_argument("--pieces", action="store_true", help="the decode batches as the engine runs those past its decode "
                    "graphs: in step pieces (up to --cuda-graph-max-tokens, 2048), not eagerly")
    ap.add_argument("--context", type=int, default=1024, help="cached tokens per decoding request")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rows", type=int, default=15)
    a = ap.parse_args()
    budget = max([*(n + a.beside for n in a.prefill), *a.decode, 2048])
    engine = EngineCore(EngineConfig.from_kwargs(
        model=None if a.model == "builtin" else a.model, load_format="dummy", num_layers=a.num_layers,
        max_model_len=max(budget, a.context) + 64,
        max_running_requests=max([*a.decode, a.prompts + a.beside]), max_num_batched_tokens=budget, mem_fraction=0.8,
        cuda_graph_max_bs=1, warmup="full", mixed_attention=a.mixed_attention))
    try:
        points: list[tuple[str, int, Callable[..., Probe]]] = [
            ("prefill", n, partial(PrefillProbe, tokens=n, context=0, sequences=a.prompts, decodes=a.beside,
                                   decode_context=a.context)) for n in a.prefill]
        points += [("decode", b, partial(DecodeProbe, batch=b, context=a.context, graphs=a.pieces)) for b in a.decode]
        for kind, n, probe in points:
            engine.probe(probe(steps=1, warmup=1))  # compiled and allocated before the profile
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                res = engine.probe(probe(steps=a.steps, warmup=0))[0]
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
            print(f"{kind} {n}: {res}\n{table(prof, engine.model_config.num_layers, a.rows)}", flush=True)
    finally:
        engine.close()


if __name__ == "__main__":
    main()
