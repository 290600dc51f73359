"""Fused-MoE align: the current kernel against a previous fused_moe.py on one GPU. Checks both give the same block
experts and the same pairs per expert (row order within an expert may differ), then times each inside a CUDA graph.

    git show f7428a7^:moebius/kernels/fused_moe.py > /tmp/old_fused_moe.py
    python benchmarks/kernels/align_compare.py --old /tmp/old_fused_moe.py --output align.json

Recorded: benchmarks/results/h200-moe-align.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys

import torch

from moebius.bench.graph_timing import graph_time_us
from moebius.bench.results import params_of, write_result
from moebius.kernels import fused_moe as fm

# (tokens, experts of the model, local experts, first local expert, rows per block): 30B decode shapes at P = 2
CASE_FIELDS = ("T", "E_all", "E", "first_expert", "BM")
CASES = [(8, 128, 128, 0, 16), (128, 128, 128, 0, 16), (200, 128, 128, 0, 64), (1024, 128, 128, 0, 64),
         (2048, 128, 128, 0, 64), (2048, 128, 64, 0, 128), (2048, 128, 64, 64, 128), (1024, 128, 64, 64, 64),
         (300, 128, 64, 64, 32)]


def check(ids: torch.Tensor, first: int, E: int, BM: int, out: object) -> None:
    """out: align's result, a `fused_moe.Blocks` (or, from older kernels, a (sorted ids, block experts, max blocks)
    tuple)."""
    sorted_ids, block_expert = (out[0], out[1]) if isinstance(out, tuple) else (out.rows, out.block_expert)
    flat = ids.flatten()
    rows = sorted_ids.long()
    used = rows < flat.numel()
    local = torch.nonzero((flat >= first) & (flat < first + E)).flatten()
    assert torch.equal(rows[used].sort().values, local), "not every local pair exactly once"
    blocks = block_expert.long().repeat_interleave(BM)
    assert torch.equal(flat[rows[used]] - first, blocks[used]), "a pair in another expert's block"


def main() -> None:
    ap = argparse.ArgumentParser(prog="python benchmarks/kernels/align_compare.py")
    ap.add_argument("--old", required=True, help="a previous fused_moe.py")
    ap.add_argument("--output", default="align.json")
    a = ap.parse_args()
    spec = importlib.util.spec_from_file_location("old_fused_moe", a.old)
    old = importlib.util.module_from_spec(spec)
    sys.modules["old_fused_moe"] = old  # its dataclasses look their module up
    spec.loader.exec_module(old)
    results = []
    for T, E_all, E, first, BM in CASES:
        torch.manual_seed(T)
        _, ids = torch.randn(T, E_all, device="cuda").topk(8, -1)
        for mod in (old, fm):
            check(ids, first, E, BM, mod.align(ids, first, E, BM))
        r = dict(T=T, E=E, first_expert=first, BM=BM,
                 old_us=graph_time_us(lambda ids=ids, first=first, E=E, BM=BM: old.align(ids, first, E, BM)),
                 new_us=graph_time_us(lambda ids=ids, first=first, E=E, BM=BM: fm.align(ids, first, E, BM)))
        print(r, flush=True)
        results.append(r)
    write_result(a.output, results, params=params_of(a, cases=CASES, case_fields=CASE_FIELDS),
                 note="fused_moe.align: µs per call inside a CUDA graph, a previous kernel (old_us) against this one")


if __name__ == "__main__":
    main()
