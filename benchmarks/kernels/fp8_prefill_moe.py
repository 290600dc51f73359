"""The fused MoE on FP8 rows at prompt sizes (W8A16, Qwen3-30B-A3B's experts on one GPU), eager as a prompt step runs
it, against the bf16 kernels on the same weights unpacked beforehand.

Variants per token count: `passes` (the default: the experts unpacked `fused_moe.UNPACK_BYTES` at a time, each share
through the bf16 kernels), `one_pass` (every expert unpacked at once), `fp8_direct` (the FP8 kernels on the rows,
no unpack, at --direct-tiles), `w8a8` and `w8a8_direct` (W8A8, --fp8-activations: the table's tiles and
--direct-tiles), `bf16` (the bf16 kernels on weights unpacked beforehand: the GEMMs alone) and `unpack`
(the two unpacks of every expert alone). Each: `wall_us` (eager calls back to back, synchronized: host launches
included, as an eager prompt step pays them), `host_us` (the host's time to issue a call) and `graph_us` (the GPU's
time inside a CUDA graph, `graph_time_us`).

    python benchmarks/kernels/fp8_prefill_moe.py --tokens 2048 4096 8192 --output fp8_prefill_moe.json
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from moebius.bench.graph_timing import graph_time_us
from moebius.bench.results import params_of, write_result
from moebius.config import PRESETS
from moebius.kernels import KernelConfig
from moebius.kernels import fused_moe as fm
from moebius.kernels.linear import unpack_fp8
from moebius.kernels.rows import FORMATS
from moebius.models.registry import model_config

W8A8 = KernelConfig(fp8_activations=True)


def eager_us(fn: Callable[[], object], n: int = 10) -> tuple[float, float]:
    """(wall, host) µs per call of n eager calls back to back after two warm-up calls."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e6 / n, host * 1e6 / n


def main() -> None:
    ap = argparse.ArgumentParser(prog="python benchmarks/kernels/fp8_prefill_moe.py")
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 4096, 8192])
    ap.add_argument("--direct-tiles", type=int, nargs=6, default=[128, 128, 8, 128, 4, 3],
                    metavar=("BM", "GATE_UP_BN", "GATE_UP_WARPS", "DOWN_BN", "DOWN_WARPS", "STAGES"),
                    help="`fp8_direct`'s blocks (BK and TMA as FP8 rows take them: `fused_moe._row_tiles`)")
    ap.add_argument("--output", default="fp8_prefill_moe.json")
    a = ap.parse_args()
    m = model_config(PRESETS[a.preset])
    D, I, E, K = m.hidden_size, m.moe_intermediate_size, m.num_experts, m.top_k
    fmt = FORMATS["fp8"]
    torch.manual_seed(0)
    # (as one rank holds them, `specs.whole_rows`: every row one segment)
    w13 = fmt.rows_of(torch.randn(E, 2 * I, D, device="cuda", dtype=torch.bfloat16) * 0.02, True)
    w2 = fmt.rows_of(torch.randn(E, D, I, device="cuda", dtype=torch.bfloat16) * 0.02, True)
    w13_bf16, w2_bf16 = fmt.unpack(w13, D, torch.bfloat16), fmt.unpack(w2, I, torch.bfloat16)
    bm, gbn, gw, dbn, dw, st = a.direct_tiles
    direct = fm.MoEConfig(bm, fm.TileConfig(gbn, 128, gw, st), fm.TileConfig(dbn, 128, dw, st))
    rows = []
    for T in a.tokens:
        x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
        w_TK, ids = torch.randn(T, E, device="cuda").softmax(-1).topk(K, -1)
        w_TK = w_TK.to(torch.bfloat16)
        saved = fm.UNPACK_BYTES

        def one_pass() -> torch.Tensor:
            fm.UNPACK_BYTES = 1 << 62
            try:
                return fm.fused_experts(x, w_TK, ids, w13, w2, 0, E)  # noqa: B023
            finally:
                fm.UNPACK_BYTES = saved

        variants = {
            "passes": lambda: fm.fused_experts(x, w_TK, ids, w13, w2, 0, E),  # noqa: B023
            "one_pass": one_pass,
            "fp8_direct": lambda: fm.fused_experts(x, w_TK, ids, w13, w2, 0, E, config=direct),  # noqa: B023
            "w8a8": lambda: fm.fused_experts(x, w_TK, ids, w13, w2, 0, E, kc=W8A8),  # noqa: B023
            "w8a8_direct": lambda: fm.fused_experts(x, w_TK, ids, w13, w2, 0, E, config=direct, kc=W8A8),  # noqa: B023
            "bf16": lambda: fm.fused_experts(x, w_TK, ids, w13_bf16, w2_bf16, 0, E),  # noqa: B023
            "unpack": lambda: (unpack_fp8(w13.flatten(0, 1), D, torch.bfloat16),
                               unpack_fp8(w2.flatten(0, 1), I, torch.bfloat16)),
        }
        ref = variants["bf16"]().float()
        for name, fn in variants.items():
            rel = None
            if name != "unpack":
                rel = ((fn().float() - ref).norm() / ref.norm()).item()
            wall, host = eager_us(fn)
            row = dict(tokens=T, variant=name, wall_us=wall, host_us=host, graph_us=graph_time_us(fn, reps=5),
                       rel_to_bf16=rel)
            print(row, flush=True)
            rows.append(row)
    write_result(a.output, rows, params=params_of(a),
                 note="µs per call of the fused MoE on FP8 rows at prompt sizes by variant: wall (eager, "
                      "synchronized), host (issuing a call), graph (inside a CUDA graph); rel_to_bf16: relative "
                      "difference from the bf16 kernels on the unpacked weights")


if __name__ == "__main__":
    main()
