"""Where the fused MoE's one-program align pass (`fused_moe._align`, up to 1024 pairs) spends its time at decode
shapes: a copy of it stopped after the load and the per-expert histogram (phase 1), after the plan too (phase 2:
block experts, padding, cursors: `fused_moe._plan_blocks` as it is now), and whole (phase 3, its atomics as Triton's
default acq_rel), at 4, 8 and 16 warps, against the engine's `fused_moe.align` (`full`, relaxed atomics) and a
one-element torch add (`copy1`, a launch's floor in a graph). µs a call inside CUDA graphs of 20 calls. Results:
benchmarks/results/h100-p1-align-phases*.json (each with its commit: the plan changed between them).

    python benchmarks/kernels/align_phases.py out.json [--replot]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.language as tl

from moebius.bench.graph_timing import graph_time_us
from moebius.bench.results import load_result, save_result
from moebius.kernels import fused_moe as fm

# (tokens, experts, top-k, rows a block): Qwen3-30B-A3B's routing at 8, 64 and 128 tokens, DeepSeek-V2-Lite's at 64,
# gpt-oss-20b's at 128
CASES = ((8, 128, 8, 16), (64, 64, 6, 16), (64, 128, 8, 16), (128, 128, 8, 16), (128, 32, 4, 16))


@triton.jit
def _align_phase(Ids, N, first, E, SortedIds, BlockExpert, Cursor, num_rows, max_blocks, BM: tl.constexpr,
                 EB: tl.constexpr, CHUNK: tl.constexpr, PHASE: tl.constexpr):
    """`fused_moe._align` up to PHASE (1: keys and histogram; 2: and the plan; 3: whole, acq_rel atomics)."""
    bins = tl.arange(0, EB)
    offs = tl.arange(0, CHUNK)
    key, ok = fm._local_keys(Ids, offs, N, first, E)
    counts = tl.histogram(key, EB, mask=ok)
    if PHASE == 1:
        tl.store(Cursor + bins, counts)
    else:
        starts = fm._plan_blocks(counts, bins, E, BlockExpert, SortedIds, N, num_rows, max_blocks, BM, CHUNK)
        tl.store(Cursor + bins, starts)
        if PHASE == 3:
            tl.debug_barrier()
            row = tl.atomic_add(Cursor + key, 1, mask=ok)
            tl.store(SortedIds + row, offs, mask=ok)


def plot(result: dict, png: str) -> None:
    """µs a call of each case: the phases at 8 warps (the engine's), acq_rel whole, and the engine's relaxed align."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    keys = [("ph1_w8", "histogram"), ("ph2_w8", "+ plan"), ("ph3_w8", "whole, acq_rel"), ("full", "whole, relaxed"),
            ("copy1", "a torch add")]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / len(keys)
    for i, (k, label) in enumerate(keys):
        ax.bar([j + i * width for j in range(len(rows))], [r[k] for r in rows], width, label=label)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rows))],
                  [f"{r['T']} tokens\n{r['E']} experts, top-{r['K']}" for r in rows], fontsize=8)
    ax.set_ylabel("us a call (CUDA graph)")
    ax.set_title(f"the one-program MoE align by phase ({result.get('gpu', '')})", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=80)


def run() -> list[dict]:
    rows = []
    for T, E, K, BM in CASES:
        torch.manual_seed(0)
        _, ids = torch.randn(T, E, device="cuda").topk(K, -1)
        N = ids.numel()
        max_blocks = (N + min(E, N) * (BM - 1)) // BM
        sorted_ids = torch.empty(max_blocks * BM, dtype=torch.int32, device="cuda")
        block_expert = torch.empty(max_blocks, dtype=torch.int32, device="cuda")
        EB = triton.next_power_of_2(E + 1)
        cursor = torch.empty(EB, dtype=torch.int32, device="cuda")
        r = dict(T=T, E=E, K=K, BM=BM, full=graph_time_us(lambda ids=ids, E=E, BM=BM: fm.align(ids, 0, E, BM)))
        for nw in (4, 8, 16):
            for ph in (1, 2, 3):
                r[f"ph{ph}_w{nw}"] = graph_time_us(
                    lambda ph=ph, nw=nw, ids=ids, N=N, E=E, BM=BM, EB=EB, mb=max_blocks, s=sorted_ids,
                    be=block_expert, c=cursor: _align_phase[(1,)](ids, N, 0, E, s, be, c, mb * BM, mb, BM=BM, EB=EB,
                                                                  CHUNK=1024, PHASE=ph, num_warps=nw))
        r["copy1"] = graph_time_us(lambda c=cursor: c.add_(1))
        print({k: round(v, 2) if isinstance(v, float) else v for k, v in r.items()}, flush=True)
        rows.append(r)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(prog="python benchmarks/kernels/align_phases.py")
    ap.add_argument("output")
    ap.add_argument("--replot", action="store_true", help="draw the plot of the result at OUTPUT and stop")
    args = ap.parse_args()
    if args.replot:
        plot(load_result(args.output), os.path.splitext(args.output)[0] + ".png")
        return
    save_result(args.output, plot, rows=run(), params=dict(cases=[list(c) for c in CASES],
                                                           case_fields=["T", "E", "K", "BM"]),
                command="python benchmarks/kernels/align_phases.py " + " ".join(sys.argv[1:]),
                note="us a call in CUDA graphs of 20: ph<P>_w<W> the one-program align stopped after phase P (1 "
                     "histogram, 2 plan, 3 whole with acq_rel atomics) at W warps; full: fused_moe.align (relaxed "
                     "atomics, 8 warps); copy1: a one-element torch add")

if __name__ == "__main__":
    main()
