"""The switch's local permutes on one GPU: `switch/plan.py`'s pack (EP -> TP, before the exchange) and unpack
(TP -> EP, after it) of one layer of a rank's experts, torch's permuted copies against `kernels/copy.py`'s row copy
at a few program sizes. Checks the copies agree, reports each one's time and its HBM rate (bytes read + written).

    python benchmarks/switch/reshard_copy.py --model qwen3-30b-a3b --ranks 2 --output reshard_copy.json

--quantization fp8 / mxfp4: the experts as quantized rows (kernels/rows.py, uint8; FP8: each 128 values and their
scale in 144 bytes, 16-byte aligned; MXFP4: each 32 values and their scale in 17), the bytes a switch of such an
engine permutes.
Recorded: benchmarks/results/h200-reshard-copy.json.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

from moebius.bench.graph_timing import event_time_ms
from moebius.bench.results import params_of, write_result
from moebius.config import PRESETS
from moebius.kernels import copy as copy_kernel
from moebius.kernels.rows import FORMATS, row_format
from moebius.switch import plan


def main() -> None:
    ap = argparse.ArgumentParser(prog="python benchmarks/switch/reshard_copy.py")
    ap.add_argument("--model", default="qwen3-30b-a3b", choices=sorted(PRESETS))
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--elems", default="4096,8192,16384,32768")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--quantization", default=None, choices=sorted(FORMATS), help="the experts as quantized rows")
    ap.add_argument("--output", default="reshard_copy.json")
    a = ap.parse_args()
    cfg = PRESETS[a.model]
    P, D, I = a.ranks, cfg["hidden_size"], cfg["moe_intermediate_size"]
    El = cfg["num_experts"] // P
    dev = "cuda"
    fmt = row_format(a.quantization)
    if fmt is not None:  # the same permutes over bytes: a TP cut of w2 is whole chunks (`check_quantized_layouts`)
        dt, cols = torch.uint8, fmt.width
        w13 = torch.randint(0, 256, (El, 2 * I, cols(D)), device=dev, dtype=dt)
        w2 = torch.randint(0, 256, (El, D, cols(I)), device=dev, dtype=dt)
    else:
        dt, cols = torch.bfloat16, int
        w13 = torch.randn(El, 2 * I, D, device=dev, dtype=dt)
        w2 = torch.randn(El, D, I, device=dev, dtype=dt)
    s13 = torch.empty(P * El, 2 * I // P, cols(D), device=dev, dtype=dt)
    s2 = torch.empty(P * El, D, cols(I) // P, device=dev, dtype=dt)
    b13, b2 = torch.empty_like(w13), torch.empty_like(w2)
    moved = 2 * (w13.numel() + w2.numel()) * w13.element_size()  # read + write

    def pack() -> None:
        plan.ep_to_tp_pack(w13, w2, P, (s13, s2))

    def unpack() -> None:
        plan.tp_to_ep_unpack(s13, s2, P, b13, b2)

    points = []

    def run(variant: str, **kw: object) -> None:
        for name, fn in (("pack", pack), ("unpack", unpack)):
            ms = event_time_ms(fn)
            points.append(dict(variant=variant, op=name, ms=ms, hbm_tb_s=moved / ms / 1e9, **kw))
            print(json.dumps(points[-1]), flush=True)

    plan.RESHARD_KERNEL = False
    run("torch")
    ref13, ref2 = s13.clone(), s2.clone()
    plan.RESHARD_KERNEL = True
    grid = itertools.product((False, True), (int(v) for v in a.elems.split(",")), [int(v) for v in a.warps.split(",")])
    for divisor, elems, warps in grid:
        copy_kernel.ELEMS_PER_PROGRAM, copy_kernel.NUM_WARPS, copy_kernel.DIVISOR_COLS = elems, warps, divisor
        s13.zero_(), s2.zero_(), b13.zero_(), b2.zero_()
        run("copy_rows", elems=elems, warps=warps, divisor_cols=divisor)
        same = torch.equal(s13, ref13) and torch.equal(s2, ref2) and torch.equal(b13, w13) and torch.equal(b2, w2)
        points[-1]["same"] = points[-2]["same"] = same
        if not same:
            raise SystemExit(f"copy_rows ({elems}, {warps}, {divisor}) differs from torch's permuted copies")
    write_result(a.output, points, params=params_of(a, preset=a.model, layer_bytes_per_rank=moved // 2),
                 note="one layer of a rank's experts packed (EP -> TP) and unpacked (TP -> EP): torch's permuted "
                      "copies against kernels/copy.py's row copy; ms per call, hbm_tb_s: bytes read + written / time")


if __name__ == "__main__":
    main()
