"""FlashAttention-4 (flash_attn.cute) against cuDNN (torch SDPA) and the paged Triton kernel at the 30B shapes
(32 query heads, 4 KV heads, d 128, 16-token pages): one layer's attention of prompt chunks (fresh chunks, chunks
after a cached prefix, many short prompts, mixed prefixes). FA4 through the pages (`fa4_paged`; `fa4_paged_out`: into
a given buffer, as the engine calls it) and on K and V gathered contiguous beforehand (`fa4_contig`). ms: median of 20
launches (CUDA events); rel_err against the float32 torch reference; first_call_s: the first launch (compilation,
where not cached). Needs the flash extra (benchmarks/README.md says how it reaches the GPU machine). Chose
kernels/flash.py.

    python benchmarks/kernels/flash_attention_ab.py benchmarks/results/h200-flash-attention.json [--one]
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from collections.abc import Callable

import numpy as np
import torch

from moebius.bench.graph_timing import event_time_ms
from moebius.bench.results import write_result
from moebius.kernels import DEFAULT_KERNELS
from moebius.kernels import attention as A
from moebius.layers.attention import AttentionMetadata, paged_attention_ref, query_blocks

PAGE, D, H, KVH = 16, 128, 32, 4
DEV = torch.device("cuda")
SCALE = D ** -0.5


def case(fa: object, name: str, qlens: list[int], prefixes: list[int], ref_check: bool = True) -> dict:
    ql, pre = np.array(qlens), np.array(prefixes)
    seqs = ql + pre
    B = len(ql)
    pages_per = -(-seqs // PAGE)
    g = torch.Generator(device=DEV).manual_seed(0)
    cache = torch.randn(int(pages_per.sum()) + 1, 2, PAGE, KVH, D, device=DEV, dtype=torch.bfloat16, generator=g)
    perm = (torch.randperm(int(pages_per.sum()), device=DEV, generator=g) + 1).int()
    bt = torch.zeros(B, int(pages_per.max()), dtype=torch.int32, device=DEV)
    used = 0
    for b in range(B):
        bt[b, :pages_per[b]] = perm[used:used + pages_per[b]]
        used += pages_per[b]
    q = torch.randn(int(ql.sum()), H, D, device=DEV, dtype=torch.bfloat16, generator=g)
    seq = torch.tensor(seqs, device=DEV, dtype=torch.int64)
    qsl = torch.tensor(np.concatenate([[0], np.cumsum(ql)]), device=DEV, dtype=torch.int64)
    flops = float(sum(4 * H * D * (t * p + t * (t + 1) / 2) for t, p in zip(ql, pre, strict=True)))
    ref = None
    if ref_check:
        pos = torch.cat([torch.arange(p, p + t, device=DEV) for t, p in zip(qlens, prefixes, strict=True)])
        tseq = torch.repeat_interleave(torch.arange(B, device=DEV), torch.tensor(qlens, device=DEV))
        meta = AttentionMetadata(pos, pos, qsl, seq, bt, tseq, pos - torch.tensor(prefixes, device=DEV)[tseq],
                                 int(ql.max()), int(seqs.max()), PAGE)
        ref = paged_attention_ref(q.float(), cache.float(), meta, SCALE)
    out = torch.empty_like(q)
    qb = torch.tensor(query_blocks(ql, seqs, A.query_block_tokens(D, H // KVH)), device=DEV)
    max_q = int(ql.max())
    fns: dict[str, Callable[[], object]] = {
        "triton": lambda: A._launch(q, cache, bt, seq, qsl, max_q, SCALE, 1, None, DEFAULT_KERNELS, out, qb)}
    if B == 1 and pre[0] == 0:
        fns["cudnn"] = lambda: A.fresh_chunk_attention(q, cache, bt, SCALE, out)
    qsl32, seq32, kc, vc = qsl.int(), seq.int(), cache[:, 0], cache[:, 1]
    paged = dict(cu_seqlens_q=qsl32, max_seqlen_q=max_q, seqused_k=seq32, page_table=bt, softmax_scale=SCALE,
                 causal=True)
    fns["fa4_paged"] = lambda: fa.flash_attn_varlen_func(q, kc, vc, **paged)
    fns["fa4_paged_out"] = lambda: fa._flash_attn_fwd(q, kc, vc, out=out, **paged)
    if B == 1:
        kk, vv = (cache[bt[0, :pages_per[0]].long(), i].flatten(0, 1)[:int(seqs[0])].contiguous() for i in (0, 1))
        cuk = torch.tensor([0, int(seqs[0])], device=DEV, dtype=torch.int32)
        fns["fa4_contig"] = lambda: fa.flash_attn_varlen_func(q, kk, vv, cu_seqlens_q=qsl32, cu_seqlens_k=cuk,
                                                              max_seqlen_q=max_q, max_seqlen_k=int(seqs[0]),
                                                              softmax_scale=SCALE, causal=True)
    res = {}
    for k, fn in fns.items():
        try:
            t1 = time.time()
            r = fn()
            torch.cuda.synchronize()
            first = time.time() - t1
            r = out if r is None else (r[0] if isinstance(r, tuple) else r)
            err = float(((r.float() - ref).norm() / ref.norm()).item()) if ref is not None else None
            ms = event_time_ms(fn, 20)
            res[k] = dict(ms=ms, tflops=flops / ms / 1e9, rel_err=err, first_call_s=first)
            print(f"{name} {k}: {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s err {err} first {first:.2f}s", flush=True)
        except Exception as e:  # noqa: BLE001 - a variant this build lacks: recorded, the others still run
            traceback.print_exc()
            res[k] = dict(error=repr(e)[:300])
    return dict(case=name, qlens=qlens[:4], B=B, T=int(ql.sum()), prefix=prefixes[:4], flops=flops, res=res)


def main() -> None:
    ap = argparse.ArgumentParser(prog="python benchmarks/kernels/flash_attention_ab.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("output", nargs="?", default="benchmarks/results/flash-attention.json")
    ap.add_argument("--one", action="store_true", help="the 8k fresh chunk only (a second process: the disk cache)")
    a = ap.parse_args()
    t0 = time.time()
    from flash_attn.cute import interface as fa

    print(f"import {time.time() - t0:.2f}s", flush=True)
    rows = [case(fa, "8k_fresh", [8192], [0])]
    if not a.one:
        rng = np.random.default_rng(0)
        mixed = rng.integers(64, 512, 32).tolist()
        rows += [case(fa, "2k_fresh", [2048], [0]), case(fa, "8k_after_8k", [8192], [8192]),
                 case(fa, "16k_fresh", [16384], [0], ref_check=False),
                 case(fa, "8k_after_24k", [8192], [24576], ref_check=False),
                 case(fa, "28x292_fresh", [292] * 28, [0] * 28),
                 case(fa, "32_mixed_prefix", mixed, rng.integers(0, 1024, 32).tolist()),
                 case(fa, "512_after_1500", [512], [1500])]
    flat = [dict(case=r["case"], tokens=r["T"], sequences=r["B"], prefix=r["prefix"][0] if r["B"] == 1 else None,
                 kernel=k, **res) for r in rows for k, res in r["res"].items()]
    write_result(a.output, rows=flat, params={"heads": H, "kv_heads": KVH, "head_dim": D, "page": PAGE},
                 command="python benchmarks/kernels/flash_attention_ab.py " + " ".join(sys.argv[1:]),
                 note="one layer's attention of prompt chunks; kernel: triton (the paged Triton kernel), cudnn "
                      "(torch SDPA on K/V gathered from the pages), fa4_paged (_out: into a given buffer), "
                      "fa4_contig (K/V gathered contiguous beforehand, not timed); ms: median of 20 launches; "
                      "rel_err against the float32 reference; first_call_s: the first launch (compilation)")


if __name__ == "__main__":
    main()
