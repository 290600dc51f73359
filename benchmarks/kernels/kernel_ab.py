"""Small decode kernels against what they replaced, on one GPU, each call timed inside a CUDA graph of 20
(moebius/bench/graph_timing.py). Recorded: benchmarks/results/h200-router.json (`router`), h200-attn-splits.json
(`splits`), h200-qk-norm-argmax.json (`argmax`, and `qk` against the one-head-per-program launch).

    python benchmarks/kernels/kernel_ab.py router|splits|argmax|qk out.json
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.nn.functional as F

from moebius.bench.graph_timing import graph_time_us
from moebius.bench.results import write_result
from moebius.kernels import DEFAULT_KERNELS, fused
from moebius.kernels import attention as A
from moebius.kernels.pdl import pdl
from moebius.layers.attention import num_splits_for
from moebius.layers.rotary import rope_table
from moebius.layers.sampler import key_ids

DEV = "cuda"


def router() -> list[dict[str, Any]]:
    """cuBLAS logits + top-k against the K-split router (128 experts, top-8, renormalised)."""
    out = []
    for D in (2048, 4096):
        for T in (1, 2, 4, 8, 16):
            x = torch.randn(T, D, device=DEV, dtype=torch.bfloat16)
            g = torch.randn(128, D, device=DEV, dtype=torch.bfloat16) * 0.02
            out.append(dict(D=D, T=T, linear_then_topk_us=graph_time_us(
                lambda x=x, g=g: fused.topk_softmax(F.linear(x, g), 8, True, x.dtype)),
                router_us=graph_time_us(lambda x=x, g=g: fused.route(x, g, 8, True))))
    return out


def splits() -> list[dict[str, Any]]:
    """Decode attention (merge included) at every split count, context 512, the 30B TP and EP shards."""
    page, d, ctx = 16, 128, 512
    out = []
    for name, H, kvh in (("tp", 16, 2), ("ep", 32, 4)):
        for B in (1, 2, 4, 8, 16):
            per = -(-(ctx + 1) // page)
            cache = torch.randn(B * per + 1, 2, page, kvh, d, device=DEV, dtype=torch.bfloat16)
            bt = (torch.randperm(B * per, device=DEV) + 1).view(B, per).int().contiguous()
            seq = torch.full((B,), ctx + 1, device=DEV, dtype=torch.int64)
            qsl = torch.arange(B + 1, device=DEV, dtype=torch.int64)
            q = torch.randn(B, H, d, device=DEV, dtype=torch.bfloat16)
            row: dict[str, Any] = dict(mode=name, B=B, splits_for=num_splits_for(B, kvh))
            for ns in (1, 2, 4, 8, 16, 32):
                row[f"s{ns}"] = graph_time_us(
                    lambda ns=ns, q=q, cache=cache, bt=bt, seq=seq, qsl=qsl: A.paged_attention(
                        q, cache, bt, seq, qsl, 1, d ** -0.5, ns))
            out.append(row)
    return out


def argmax() -> list[dict[str, Any]]:
    """torch.argmax / torch.max against the vocabulary argmax keys, over TP (76k) and whole (152k) vocabularies."""
    out = []
    for V in (75968, 151936):
        for T in (1, 8, 64, 256, 1024, 2048):
            x = torch.randn(T, V, device=DEV).to(torch.bfloat16)
            out.append(dict(V=V, T=T, torch_argmax_us=graph_time_us(lambda x=x: x.argmax(-1)),
                            torch_max_us=graph_time_us(lambda x=x: x.max(-1)),
                            keys_us=graph_time_us(lambda x=x: key_ids(fused.argmax_keys(x, 0)))))
    return out


def qk() -> list[dict[str, Any]]:
    """q/k norm + RoPE + cache write: the launch qk_norm_rope_kv picks against one (token, head) row a program."""
    return [qk_case(name, H, kvh, T) for name, H, kvh in (("tp", 16, 2), ("ep", 32, 4))
            for T in (1, 8, 64, 256, 1024, 2048)]


def qk_case(name: str, H: int, kvh: int, T: int) -> dict[str, Any]:
    """One row of `qk`: H query and kvh KV heads, T tokens."""
    d, page = 128, 16
    rope = rope_table(d, 4096, 1e6, DEV)
    qkv = torch.randn(T, (H + 2 * kvh) * d, device=DEV, dtype=torch.bfloat16)
    qn, kn = (torch.rand(d, device=DEV, dtype=torch.bfloat16) + 0.5 for _ in range(2))
    pos = torch.randint(0, 4096, (T,), device=DEV)
    slots = torch.randperm(4096 * page, device=DEV)[:T]
    cache = torch.zeros(4096, 2, page, kvh, d, device=DEV, dtype=torch.bfloat16)
    q = torch.empty(T, H, d, device=DEV, dtype=torch.bfloat16)

    def one_head() -> None:  # one (token, head) row a program
        fused._qk_norm_rope_kv[(T * (H + kvh),)](
            qkv, qn, kn, rope, pos, slots, cache, q, 1e-6, T, H, kvh, qkv.stride(0), cache.stride(0),
            cache.stride(1), cache.stride(2), cache.stride(3), PAGE=page, D=d, R=1, num_warps=1,
            **pdl(qkv, DEFAULT_KERNELS))

    return dict(mode=name, T=T, one_head_us=graph_time_us(one_head), picked_us=graph_time_us(
        lambda: fused.qk_norm_rope_kv(qkv, qn, kn, rope, pos, slots, cache, H, 1e-6)))


CASES = {"router": router, "splits": splits, "argmax": argmax, "qk": qk}


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in CASES:
        raise SystemExit(f"usage: python benchmarks/kernels/kernel_ab.py {'|'.join(CASES)} [out.json]")
    what = sys.argv[1]
    rows = CASES[what]()
    for r in rows:
        print(r)
    output = sys.argv[2] if len(sys.argv) > 2 else f"{what}.json"
    write_result(output, rows, params=dict(case=what, output=output),
                 note=f"{what}: " + (CASES[what].__doc__ or "").strip() + " µs per call, CUDA graph of 20 calls")


if __name__ == "__main__":
    main()
