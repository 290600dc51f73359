"""Latent (MLA) decode attention launch shapes (KV splits, KV tile, warps, pipeline stages, whole tiles unmasked or
every tile masked: `kernels/mla.DecodeLaunch`) on one GPU: µs per call inside a CUDA graph and the latent cache
bandwidth reached, checked against the kernel's own launch (`kernels/mla.decode_launch`, the runner's
`num_splits_for`). DeepSeek-V2-Lite's 16 heads (and DeepSeek-V3's at TP 8)
and DeepSeek-V3's 128 (a rank of EP's data-parallel attention), context 1024, C = 512 latent + R = 64 rope values a
token. A profile put the kernel at 88 us a layer at batch 64 where its cache bytes take ~18 us on an H200
(benchmarks/results/h200-p1-decode-profiles.json).

    python benchmarks/kernels/mla_tune.py mla_tune.json [--heads 16] [--batches 256 1024] [--head-blocks 16 64]
        [--kv-tiles 32 64]
"""

from __future__ import annotations

import argparse
import itertools

import torch
import triton

from moebius.bench.floor import hardware_of
from moebius.bench.graph_timing import graph_time_us
from moebius.bench.results import write_result
from moebius.kernels import mla as M
from moebius.layers.attention import num_splits_for

PAGE, C, R, CTX = 16, 512, 64, 1024
SHAPES = (("16 heads", 16, (1, 8, 64, 128, 256, 1024)), ("128 heads", 128, (1, 8, 32, 128)))


def tune(name: str, H: int, B: int, dev: torch.device, hbm_bytes_s: float, head_blocks: list[int],
         kv_tiles: list[int]) -> list[dict]:
    """Every launch shape's row at one shape and batch (shapes that fail to compile are left out); head blocks
    (heads a program) as given, up to the shape's heads, each with its own KV splits; past 16 heads a block, 8 warps
    only (a [BH, C] float32 accumulator); the kernel's own launch always."""
    pages_per = -(-(CTX + 1) // PAGE)
    npages = B * pages_per + 1
    cache = torch.randn(npages, PAGE, C + R, device=dev, dtype=torch.bfloat16)
    bt = (torch.randperm(npages - 1, device=dev)[: B * pages_per] + 1).view(B, pages_per).int().contiguous()
    seq = torch.full((B,), CTX + 1, device=dev, dtype=torch.int64)
    qsl = torch.arange(B + 1, device=dev, dtype=torch.int64)
    q_lat = torch.randn(B, H, C, device=dev, dtype=torch.bfloat16)
    q_rope = torch.randn(B, H, R, device=dev, dtype=torch.bfloat16)
    scale = (128 + R) ** -0.5
    # the runner's (`geometry.split_units`: head blocks; `min_programs`)
    def splits(BH: int) -> int:
        return num_splits_for(B, triton.cdiv(H, BH), min_programs=M.DECODE_MIN_PROGRAMS)

    own = M.decode_launch(C, H, B, cache)  # the kernel's own launch
    base = splits(own.head_block)
    ref = M.latent_decode_attention(q_lat, q_rope, cache, bt, seq, qsl, scale, base)
    nbytes = B * (CTX + 1) * (C + R) * 2
    rows = []
    shapes = [(ns, M.DecodeLaunch(BH, BN, nw, st, whole)) for BH in head_blocks if BH <= max(H, 16)
              for ns, BN, nw, st, whole in itertools.product(sorted({1, 2, 4, 8, splits(BH)}), kv_tiles, (4, 8),
                                                             (2, 3), (False, True))
              if BH <= 16 or nw == 8]
    if (base, own) not in shapes:  # (the kernel's own launch, timed beside them)
        shapes.insert(0, (base, own))
    for ns, launch in shapes:
        o = torch.empty_like(q_lat)

        def fn(ns: int = ns, launch: M.DecodeLaunch = launch, o: torch.Tensor = o) -> None:
            M.latent_decode_attention(q_lat, q_rope, cache, bt, seq, qsl, scale, ns, out=o, launch=launch)

        try:
            us = graph_time_us(fn)
        except Exception as e:  # noqa: BLE001 - shapes beyond shared memory fail to compile: skip them
            print(name, B, ns, launch, "failed:", str(e)[:100])
            continue
        rows.append(dict(shape=name, heads=H, batch=B, head_block=launch.head_block, splits=ns, BN=launch.BN,
                         warps=launch.warps, stages=launch.stages, whole=launch.whole, us=us,
                         gbps=nbytes / us / 1e3, floor_us=nbytes / hbm_bytes_s * 1e6,
                         err=(o.float() - ref.float()).abs().max().item(), default=(ns, launch) == (base, own)))
    best = min(rows, key=lambda r: r["us"])
    print(f"{name} B={B}: floor {nbytes / hbm_bytes_s * 1e6:.1f} us; default "
          f"{[round(r['us'], 1) for r in rows if r['default']]}; best {best}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(prog="python benchmarks/kernels/mla_tune.py")
    ap.add_argument("output", nargs="?", default="mla_tune.json")
    ap.add_argument("--heads", type=int, nargs="+", help="only the shapes of these head counts (16, 128)")
    ap.add_argument("--batches", type=int, nargs="+", help="only these batches (of each shape's)")
    ap.add_argument("--head-blocks", type=int, nargs="+", default=[M.HEAD_BLOCK],
                    help="heads a program searched (HEAD_BLOCK by default; 32, 64: 8 warps; the kernel's own launch, "
                         "`decode_head_block`, is timed beside them)")
    ap.add_argument("--kv-tiles", type=int, nargs="+", default=[16, 32, 64], help="KV tiles (keys) searched")
    args = ap.parse_args()
    shapes = [(n, h, tuple(b for b in bs if not args.batches or b in args.batches)) for n, h, bs in SHAPES
              if not args.heads or h in args.heads]
    dev = torch.device("cuda")
    hbm = hardware_of(torch.cuda.get_device_name()).hbm_bytes_per_s
    out = []
    for name, H, batches in shapes:
        for B in batches:
            out += tune(name, H, B, dev, hbm, args.head_blocks, args.kv_tiles)
    path = args.output
    write_result(path, out, params=dict(output=path, page=PAGE, latent=C, rope=R, context=CTX,
                                        head_blocks=args.head_blocks, kv_tiles=args.kv_tiles,
                                        shapes=[dict(shape=n, heads=h, batches=list(b)) for n, h, b in shapes]),
                 note="latent decode attention per call inside a CUDA graph (us), the cache bandwidth reached (gbps) "
                      "and the cache bytes' HBM time (floor_us); err: max abs difference to the kernel's own launch; "
                      "default: the kernel's own launch shape")


if __name__ == "__main__":
    main()
