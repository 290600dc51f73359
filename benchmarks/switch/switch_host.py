"""The host's part of a switch with many requests in flight: the EP -> TP request list grows with every live
request, so the time from decision to transfer launch (`requests_ms`: request metadata, capacity, page tables, KV
index vectors, staging agreement) is timed here with N requests decoding, switching back and forth. Runs on the CPU
(builtin model, gloo) or on GPUs (any preset with --load-format dummy). On the CPU the transfers themselves are
synchronous and land in `enqueue_ms`; on GPUs `enqueue_ms` is only their launch.

    python benchmarks/switch/switch_host.py --num-requests 128 --prompt-len 512 --output switch_host.json

Recorded: benchmarks/results/cpu-switch-host.json (one row per switch).
"""

from __future__ import annotations

import argparse
import json
import random
import time

from moebius.bench.results import gpus_used, params_of, write_result
from moebius.config import EngineConfig
from moebius.frontend.core import EngineCore
from moebius.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(prog="python benchmarks/switch/switch_host.py")
    ap.add_argument("--model", default=None, help="default: the builtin model")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--num-layers", type=int, default=None)
    ap.add_argument("--num-ranks", type=int, default=2)
    ap.add_argument("--num-requests", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--decode-steps", type=int, default=40, help="steps before the first switch")
    ap.add_argument("--switches", type=int, default=6)
    ap.add_argument("--output", default="switch_host.json")
    a = ap.parse_args()
    n = a.num_requests
    engine = EngineCore(EngineConfig.from_kwargs(
        model=a.model, load_format=a.load_format, num_layers=a.num_layers, num_ranks=a.num_ranks, mode="ep",
        max_model_len=a.prompt_len + a.decode_steps + a.switches + 64, max_running_requests=n,
        max_num_batched_tokens=8192, max_total_tokens=n * (a.prompt_len + a.decode_steps + a.switches + 80), seed=0))
    try:
        rng = random.Random(0)
        vocab = 300 if a.model is None else 1000
        for _ in range(n):
            engine.add_request([rng.randrange(vocab) for _ in range(a.prompt_len)],
                            SamplingParams(max_tokens=a.decode_steps + a.switches + 32, ignore_eos=True))
        for _ in range(a.decode_steps):
            engine.step()
        switches = []
        for i in range(a.switches):
            target = "tp" if i % 2 == 0 else "ep"
            t0 = time.perf_counter()
            out = engine.switch_mode(target)
            call_ms = (time.perf_counter() - t0) * 1e3
            assert out.done, out
            switches.append({"to": target, "call_ms": call_ms, **{k: getattr(out, k) for k in (
                "requests_ms", "list_ms", "plan_ms", "staging_ms", "prep_ms", "enqueue_ms", "host_ms")}})
            print(json.dumps(switches[-1]), flush=True)
            engine.step()
    finally:
        engine.close()
    write_result(a.output, switches, params=params_of(a), num_gpus=gpus_used(a.num_ranks),
                 note=f"switches back and forth with {n} requests decoding: call_ms (the whole switch_mode call), "
                      "requests_ms (decision to transfer launch), enqueue_ms (the transfers' launch; on the CPU the "
                      "transfers themselves), host_ms")


if __name__ == "__main__":
    main()
