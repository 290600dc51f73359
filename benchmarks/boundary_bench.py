"""What a dependency between two kernels costs at one token, and what it would cost inside one persistent kernel.

A chain of S dependent one-row projections (x <- W_s x, W_s [H, H] bf16) timed two ways, each in a CUDA graph:
- `launch`: one launch per projection, the engine's `kernels.linear` (weights loaded before the PDL wait), in the
  LATE and EARLY release orders: what a layer pays today per boundary.
- `persistent`: one launch for the whole chain, a program per block of rows (all resident at once), stages ordered
  by a counter per stage (the program's stores, a CTA barrier, then one release add; the next stage spins on an
  acquire read of it): what a persistent decode kernel would pay per grid-wide dependency. `preload`: a program
  loads its next stage's weight rows before it waits (as `kernels.linear` does before the PDL wait); without it,
  after.

Per stage it reports µs, the weight bytes, and µs at the floor's HBM rate: the difference is the boundary's cost.
The persistent chain's output must equal the launched chain's (same products, same sums).

    python3 benchmarks/boundary_bench.py --output boundary.json
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl
from graph_timing import graph_time_us

from moebius import kernels
from moebius.bench.floor import Hardware
from moebius.kernels.linear import TILE_ELEMS, linear


@triton.jit
def _chain(X, W, Count, S, H, BN: tl.constexpr, BK: tl.constexpr, PRELOAD: tl.constexpr):
    """X [2, H] (stage s reads row s % 2, writes the other); W [S, H, H]; Count [S] zeros."""
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    rn = pid * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    mk = rk < H
    for s in range(S):
        wp = W + s.to(tl.int64) * H * H + rn[:, None].to(tl.int64) * H + rk[None, :]
        if PRELOAD:
            w = tl.load(wp, mask=mk[None, :], other=0.0)
        if s > 0:
            while tl.atomic_add(Count + s - 1, 0, sem="acquire", scope="gpu") < G:
                pass
            tl.debug_barrier()  # every thread's loads after the acquire
        if not PRELOAD:
            w = tl.load(wp, mask=mk[None, :], other=0.0)
        x = tl.load(X + (s % 2) * H + rk, mask=mk, other=0.0, cache_modifier=".cg")  # other SMs wrote it
        acc = tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
        tl.store(X + ((s + 1) % 2) * H + rn, acc.to(X.dtype.element_ty))
        tl.debug_barrier()  # every thread's store before the one release below
        tl.atomic_add(Count + s, 1, sem="release", scope="gpu")


def persistent_rows(H: int, sms: int) -> int:
    """Rows a program: kernels.linear's tile, or more where that would leave programs without an SM (a program
    that is not resident would never arrive and the chain would hang)."""
    return max(TILE_ELEMS // triton.next_power_of_2(H), triton.next_power_of_2(triton.cdiv(H, sms)))


def persistent(x: torch.Tensor, w: torch.Tensor, count: torch.Tensor, buf: torch.Tensor, BN: int, preload: bool
               ) -> torch.Tensor:
    S, H, _ = w.shape
    count.zero_()
    buf[0].copy_(x)
    _chain[(H // BN,)](buf, w, count, S, H, BN=BN, BK=triton.next_power_of_2(H), PRELOAD=preload, num_warps=8)
    return buf[S % 2]


def launched(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    for s in range(w.shape[0]):
        x = linear(x[None], w[s])[0]
    return x


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", default="1024,2048")
    ap.add_argument("--stages", type=int, default=64)
    ap.add_argument("--output", required=True)
    args = ap.parse_args()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    hbm = Hardware().hbm_bytes_per_s
    rows = []
    for H in (int(h) for h in args.hidden.split(",")):
        BN = persistent_rows(H, sms)
        if H % BN:
            print(f"H={H}: not a multiple of {BN} rows, skipped")
            continue
        g = torch.Generator(device=dev).manual_seed(0)
        w = (torch.randn(args.stages, H, H, device=dev, generator=g) / H ** 0.5).to(torch.bfloat16)
        x = torch.randn(H, device=dev, generator=g).to(torch.bfloat16)
        count = torch.zeros(args.stages, dtype=torch.int32, device=dev)
        buf = torch.zeros(2, H, dtype=torch.bfloat16, device=dev)
        with kernels.release_order(kernels.LATE):
            ref = launched(x, w).clone()
        bytes_stage = H * H * 2
        row = {"hidden": H, "stages": args.stages, "programs": H // BN, "weight_bytes_per_stage": bytes_stage,
               "floor_us_per_stage": bytes_stage / hbm * 1e6}
        for name, order in (("launch_late", kernels.LATE), ("launch_early", kernels.EARLY)):
            with kernels.release_order(order):
                row[f"{name}_us_per_stage"] = graph_time_us(lambda: launched(x, w), reps=1) / args.stages
        for preload in (True, False):
            name = "persistent_preload" if preload else "persistent_after_wait"
            out = persistent(x, w, count, buf, BN, preload)
            torch.cuda.synchronize()
            # the same products and row sums; another row tile may sum in another order
            row[f"{name}_max_diff_to_launch"] = (out.float() - ref.float()).abs().max().item()
            row[f"{name}_us_per_stage"] = graph_time_us(lambda p=preload: persistent(x, w, count, buf, BN, p),
                                                         reps=1) / args.stages
        print(json.dumps(row))
        rows.append(row)
    json.dump({"gpu": torch.cuda.get_device_name(dev), "command": "python3 benchmarks/boundary_bench.py "
               f"--hidden {args.hidden} --stages {args.stages} --output {args.output}", "rows": rows},
              open(args.output, "w"), indent=1)


if __name__ == "__main__":
    main()
