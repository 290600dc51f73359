"""Decode attention launch shapes (KV splits, tile, warps, pipeline stages) at the 30B sweep shapes on one GPU: µs per
call inside a CUDA graph and the KV bandwidth reached, checked against the kernel's default launch. Chose
`_decode_tiles` and `num_splits_for` (benchmarks/results/h200-attn-decode-tiles.json).

    python benchmarks/kernels/attn_tune.py attn_tune.json
"""

from __future__ import annotations

import itertools
import sys

import torch

from moebius.bench.graph_timing import graph_time_us
from moebius.bench.results import write_result
from moebius.kernels import DEFAULT_KERNELS
from moebius.kernels import attention as A
from moebius.kernels.pdl import pdl
from moebius.layers.attention import num_splits_for

PAGE, D, CTX = 16, 128, 512
SHAPES = (("tp", 16, 2, (1, 8, 64, 256, 1024, 2048)), ("ep", 32, 4, (1, 4, 32, 128, 512, 1024)))


def tune(name: str, H: int, kvh: int, B: int, dev: torch.device) -> list[dict]:
    """Every launch shape's row at one shape and batch (shapes that fail to compile are left out)."""
    G = H // kvh
    pages_per = -(-(CTX + 1) // PAGE)
    npages = B * pages_per + 1
    cache = torch.randn(npages, 2, PAGE, kvh, D, device=dev, dtype=torch.bfloat16)
    bt = (torch.randperm(npages - 1, device=dev)[: B * pages_per] + 1).view(B, pages_per).int().contiguous()
    seq = torch.full((B,), CTX + 1, device=dev, dtype=torch.int64)
    qsl = torch.arange(B + 1, device=dev, dtype=torch.int64)
    q = torch.randn(B, H, D, device=dev, dtype=torch.bfloat16)
    ref = A.paged_attention(q, cache, bt, seq, qsl, 1, D ** -0.5, num_splits_for(B, kvh))
    nbytes = B * (CTX + 1) * kvh * D * 2 * 2
    base = num_splits_for(B, kvh)
    mine = []
    for ns, BN, nw, st in itertools.product(sorted({1, base, 2 * base}), (32, 64, 128), (4, 8), (2, 3)):
        o = torch.empty_like(q)
        pa = torch.empty(B * H * ns, D, dtype=torch.float32, device=dev)
        pm = torch.empty(B * H * ns, 2, dtype=torch.float32, device=dev)

        def fn(ns=ns, BN=BN, nw=nw, st=st, o=o, pa=pa, pm=pm) -> None:
            A._attn_fwd[(kvh * ns, 1, B)](
                q, cache, o, pa if ns > 1 else o, pm if ns > 1 else o, bt, seq, qsl, seq, D ** -0.5,
                q.stride(0), q.stride(1), o.stride(0), o.stride(1), cache.stride(0), cache.stride(1),
                cache.stride(2), cache.stride(3), bt.stride(0), q, q, q, q, q, q, 0.0, H, 0, NUM_SPLITS=ns, G=G,
                BM=max(1, 16 // G), BN=BN, D=D, PAGE=PAGE, PREC="tf32", QK=False, TABLE=False, num_warps=nw,
                num_stages=st, **pdl(q, DEFAULT_KERNELS))
            if ns > 1:
                A._merge_splits[(B, H)](pa, pm, o, o.stride(0), o.stride(1), H, NUM_SPLITS=ns, D=D,
                                        **pdl(q, DEFAULT_KERNELS))

        try:
            us = graph_time_us(fn)
        except Exception as e:  # noqa: BLE001 - shapes beyond shared memory fail to compile: skip them
            print(name, B, ns, BN, nw, st, "failed:", str(e)[:100])
            continue
        mine.append(dict(mode=name, batch=B, splits=ns, BN=BN, warps=nw, stages=st, us=us,
                         gbps=nbytes / us / 1e3, err=(o.float() - ref.float()).abs().max().item(),
                         default=(ns == base and BN == 64 and nw == 4)))
    best = min(mine, key=lambda r: r["us"])
    print(f"{name} B={B}: floor {nbytes / 4.28e6:.1f} us; default "
          f"{[round(r['us'], 1) for r in mine if r['default']]}; best {best}", flush=True)
    return mine


def main() -> None:
    dev = torch.device("cuda")
    out = []
    for name, H, kvh, batches in SHAPES:
        for B in batches:
            out += tune(name, H, kvh, B, dev)
    path = sys.argv[1] if len(sys.argv) > 1 else "attn_tune.json"
    shapes = [dict(mode=m, heads=h, kv_heads=k, batches=list(b)) for m, h, k, b in SHAPES]
    write_result(path, out, params=dict(output=path, page=PAGE, head_dim=D, context=CTX, shapes=shapes),
                 note="decode attention per call inside a CUDA graph (us) and the KV bandwidth reached (gbps); err: "
                      "max abs difference to the kernel's own launch; default: the kernel's default launch shape")


if __name__ == "__main__":
    main()
