"""The float32 router's launch (kernels/fused.py `_router_f32`: DeepSeek's and GLM-4.5's router logits from bf16
hidden states and float32 weights, split-K partials that the routing launch sums) on one GPU: µs per call inside a
CUDA graph of each launch (tiles, split-K target, dot precision, warps) beside cuBLAS's float32 GEMM after the
upcast copy it replaced, at DeepSeek-V2-Lite's router (64 experts of 2048) and DeepSeek-V3's (256 of 7168). A profile
put the first (IEEE) launch at 24 us a layer at batch 1024, where the copy and cuBLAS took 23
(benchmarks/results/h100-p1-decode-profile-deepseek-1024.json).

    python benchmarks/kernels/router_tune.py router_tune.json
"""

from __future__ import annotations

import dataclasses
import itertools
import sys

import torch
import torch.nn.functional as F

from moebius.bench.graph_timing import graph_time_us
from moebius.bench.results import write_result
from moebius.kernels import fused

SHAPES = (("deepseek-v2-lite", 64, 2048), ("deepseek-v3", 256, 7168))
BATCHES = (1, 64, 256, 1024)


def tune(name: str, E: int, D: int, T: int, dev: torch.device) -> list[dict]:
    x = torch.randn(T, D, device=dev, dtype=torch.bfloat16)
    gate = torch.randn(E, D, device=dev, dtype=torch.float32) * D ** -0.5
    want = F.linear(x.float(), gate)
    base = dict(shape=name, experts=E, hidden=D, batch=T)
    rows = [dict(base, kernel="cublas", us=graph_time_us(lambda: F.linear(x.float(), gate)))]
    for BT, BK, programs, prec, warps in itertools.product((16, 64, 128), (64, 128), (128, 256),
                                                            ("ieee", "tf32x3"), (4,)):
        if BT > max(16, T):
            continue
        launch = dataclasses.replace(fused.ROUTER_F32, BT=BT, BK=BK, programs=programs, precision=prec,
                                     num_warps=warps)
        try:
            us = graph_time_us(lambda launch=launch: fused.router_partials_f32(x, gate, launch=launch))
            err = (fused.router_partials_f32(x, gate, launch=launch).sum(0) - want).abs().max().item()
        except Exception as e:  # noqa: BLE001 - launches beyond shared memory fail to compile: skip them
            print(name, T, launch, "failed:", str(e)[:100])
            continue
        rows.append(dict(base, kernel="triton", BT=BT, BK=BK, programs=programs, precision=prec, warps=warps, us=us,
                         err=err, default=launch == fused.ROUTER_F32))
    best = min((r for r in rows if r["kernel"] == "triton"), key=lambda r: r["us"])
    print(f"{name} T={T}: cublas {rows[0]['us']:.1f} us; default "
          f"{[round(r['us'], 1) for r in rows if r.get('default')]}; best {best}", flush=True)
    return rows


def main() -> None:
    dev = torch.device("cuda")
    out = []
    for (name, E, D), T in itertools.product(SHAPES, BATCHES):
        out += tune(name, E, D, T, dev)
    path = sys.argv[1] if len(sys.argv) > 1 else "router_tune.json"
    write_result(path, out, params=dict(output=path, shapes=[dict(shape=n, experts=e, hidden=d) for n, e, d in SHAPES],
                                        batches=list(BATCHES)),
                 note="float32 router logits per call inside a CUDA graph (us): cublas = F.linear(x.float(), w) (the "
                      "upcast copy and cuBLAS's float32 GEMM), triton = router_partials_f32 by launch (its partials "
                      "not summed: the routing launch sums them); err: max abs difference of the summed partials to "
                      "cublas; default: fused.ROUTER_F32")


if __name__ == "__main__":
    main()
