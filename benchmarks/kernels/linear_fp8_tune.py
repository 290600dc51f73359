"""The dense projection on FP8 rows (`kernels/linear._linear_fp8`) over its launch shapes on one GPU: weight rows a
program (BM), token rows a program (BT), warps, K splits (float32 partials summed by `_sum_splits`), which operand
the dot's rows are (token_rows), W8A16 (and W8A8 with --w8a8), at Qwen3-30B-A3B's q|k|v (5120 x 2048) and o (2048 x
4096) projections; µs per call inside a CUDA graph (the partials' sum included) and the weight bandwidth reached,
beside the bf16 projection of the same shape as the engine runs it (`layers.linear.linear`). `linear.FP8_LAUNCHES`
comes from this search (benchmarks/results/h100-p1-linear-fp8-tune.json); "default" marks its launch. At one or two
rows the engine runs `linear_fp8_rows` (kernel "rows"), and W8A16 past `UNPACK_ROWS` the weight unpacked and
multiplied by cuBLAS (kernel "unpack"), timed beside the searched shapes.

    python benchmarks/kernels/linear_fp8_tune.py linear_fp8_tune.json --rows 8 64 256 [--w8a8] [--table-only]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools

import torch
import triton

from moebius.bench.floor import hardware_of
from moebius.bench.graph_timing import graph_time_us
from moebius.bench.results import write_result
from moebius.kernels import DEFAULT_KERNELS, LATE, KernelConfig
from moebius.kernels import linear as L
from moebius.kernels.fp8_rows import pack_rows, unpack_rows
from moebius.layers.linear import linear as dense_linear

SHAPES = (("qkv", 5120, 2048), ("o", 2048, 4096))
STAGES = (4,)  # (one depth: the search's other axes, splits and token rows, doubled it past a device call)
ROWS = (1, 8, 64, 256, 2048)  # (2048: a prompt chunk's rows, where the GEMM is compute-bound)


def tune(name: str, N: int, K: int, T: int, dev: torch.device, hbm_bytes_s: float, forms: tuple[bool, ...],
         table_only: bool = False) -> list[dict]:
    """Every launch shape's row at one projection and row count (shapes that fail to compile are left out); with
    table_only the table's launch alone (`linear.fp8_launch`), with either operand as the dot's rows."""
    w = torch.randn(N, K, device=dev, dtype=torch.bfloat16) * K ** -0.5
    rows = pack_rows(w)
    x = torch.randn(T, K, device=dev, dtype=torch.bfloat16)
    kc = dataclasses.replace(DEFAULT_KERNELS, release=LATE)  # (the order decode steps of few rows run in)
    bf16_us = graph_time_us(lambda: dense_linear(x, w, kc=kc))
    nbytes = rows.numel()
    out = []
    bts = sorted({min(bt, max(16, triton.next_power_of_2(T))) for bt in (16, 64, 128)})
    wants = {act8: L.linear_fp8(x, rows, kc=dataclasses.replace(DEFAULT_KERNELS, fp8_activations=act8))
             for act8 in forms}  # (each launch's err: against the engine's own launch)
    launches = itertools.product(forms, (16, 32, 64, 128), (4, 8), STAGES, bts, (1, 2, 4, 8), (True, False))
    if table_only:
        launches = [(act8, BM, nw, st, BT, sp, tr) for act8 in forms for BM, BT, nw, st, sp, _ in
                    [L.fp8_launch(T, K, act8)] for tr in (True, False)]
    for act8, BM, nw, st, BT, sp, tr in launches:
        if not table_only and ((sp > 1 and T > 256) or (nw == 8 and BM * BT < 64 * 64)):  # (prompt sizes fill the
            continue  # SMs with whole-K programs; 8 warps on a small tile sit idle)
        o = torch.empty(T, N, device=dev, dtype=torch.bfloat16)
        kc8 = dataclasses.replace(DEFAULT_KERNELS, fp8_activations=act8)

        def fn(BM: int = BM, nw: int = nw, st: int = st, BT: int = BT, sp: int = sp, tr: bool = tr,
               o: torch.Tensor = o, kc8: KernelConfig = kc8) -> None:
            L.launch_fp8(x, rows, None, o, BM, BT, nw, st, sp, tr, kc=kc8)

        try:
            us = graph_time_us(fn)
        except Exception as e:  # noqa: BLE001 - shapes beyond shared memory fail to compile: skip them
            print(name, T, act8, BM, nw, st, sp, tr, "failed:", str(e)[:100])
            continue
        want = wants[act8]
        out.append(dict(proj=name, N=N, K=K, rows=T, kernel="mma", act8=act8, BM=BM, BT=BT, warps=nw, stages=st,
                        splits=sp, token_rows=tr, us=us, gbps=nbytes / us / 1e3,
                        floor_us=nbytes / hbm_bytes_s * 1e6, bf16_us=bf16_us,
                        err=(o.float() - want.float()).abs().max().item(),
                        default=(T > L.MAX_ROWS and (act8 or T <= L.UNPACK_ROWS)
                                 and (BM, BT, nw, st, sp, tr) == L.fp8_launch(T, K, act8))))
    if T > L.UNPACK_ROWS and False in forms:  # the engine's W8A16 at prompt sizes: the weight unpacked, then cuBLAS
        us = graph_time_us(lambda: L.linear_fp8(x, rows))
        ref = torch.nn.functional.linear(x, unpack_rows(rows, K, x.dtype))
        out.append(dict(proj=name, N=N, K=K, rows=T, kernel="unpack", act8=False, us=us, gbps=nbytes / us / 1e3,
                        floor_us=nbytes / hbm_bytes_s * 1e6, bf16_us=bf16_us, default=True,
                        err=(L.linear_fp8(x, rows).float() - ref.float()).abs().max().item()))
    if T <= L.MAX_ROWS:  # the engine's kernel for a row or two in the LATE order (`linear_fp8_rows`)
        for act8 in forms:
            kc8 = dataclasses.replace(kc, fp8_activations=act8)
            us = graph_time_us(lambda kc8=kc8: L.linear_fp8_rows(x, rows, kc=kc8))
            out.append(dict(proj=name, N=N, K=K, rows=T, kernel="rows", act8=act8, us=us, gbps=nbytes / us / 1e3,
                            floor_us=nbytes / hbm_bytes_s * 1e6, bf16_us=bf16_us, default=True,
                            err=(L.linear_fp8_rows(x, rows, kc=kc8).float()
                                 - L.linear_fp8(x, rows, kc=kc8).float()).abs().max().item()))
    for act8 in forms:
        mine = [r for r in out if r["act8"] == act8]
        if mine:
            best = min(mine, key=lambda r: r["us"])
            print(f"{name} T={T} act8={act8}: floor {nbytes / hbm_bytes_s * 1e6:.1f} us, bf16 {bf16_us:.1f} us; "
                  f"default {[round(r['us'], 1) for r in mine if r['default']]}; best {best}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(prog="python benchmarks/kernels/linear_fp8_tune.py")
    ap.add_argument("output", nargs="?", default="linear_fp8_tune.json")
    ap.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    ap.add_argument("--w8a8", action="store_true", help="search W8A8's launches too")
    ap.add_argument("--table-only", action="store_true", help="only the table's launch for each row count, with "
                    "either operand as the dot's rows")
    args = ap.parse_args()
    forms = (False, True) if args.w8a8 else (False,)
    dev = torch.device("cuda")
    hbm = hardware_of(torch.cuda.get_device_name()).hbm_bytes_per_s
    out = []
    for T in args.rows:
        for name, N, K in SHAPES:
            out += tune(name, N, K, T, dev, hbm, forms, args.table_only)
            # (written after each shape: a run cut at a device call's limit keeps what it searched)
            write_result(args.output, out, params=dict(output=args.output, rows=args.rows, w8a8=args.w8a8,
                                                       table_only=args.table_only,
                                                       shapes=[dict(proj=n, N=N, K=K) for n, N, K in SHAPES]),
                         note="the FP8-rows projection per call inside a CUDA graph (us), the weight bandwidth reached "
                              "(gbps), its bytes' HBM time (floor_us) and the bf16 projection's time (bf16_us); err: "
                              "max abs difference to linear_fp8's own launch; default: its launch shape")


if __name__ == "__main__":
    main()
