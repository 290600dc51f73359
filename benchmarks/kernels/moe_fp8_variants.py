"""The fused MoE on FP8 rows in several versions of its source (a folder holding a `fused_moe.py` and the `linear.py`
it imports from, such as an earlier commit's two files), at Qwen3-30B-A3B's expert shapes (128 experts, top 8,
hidden 2048, 768 expert columns): µs a call inside a CUDA graph, W8A16, and W8A8 too for the variants --w8a8 names,
the same experts in bf16 (their dequantized values) for those --bf16 names (a control: what the plain rows reach).
Each variant also runs with every expert's weights addressed as expert e % 4 (columns `<name>_l2_*`): the weights
then stay in L2, so the time is the kernel's own ceiling, what a card with more bandwidth could get out of it (the
H200's question, asked on an H100). `tree_us`: the engine's own import, for reference. The rows are laid out as one
rank holds them (kernels/fp8_rows.py: one segment a row), or with --chunk-rows a segment a chunk (the layout of
down's rows where TP over ranks cuts them, and the only one a tree before 2026-12-07's twenty-fourth session reads).
A variant whose fused_moe.py defines `repack_rows(rows, cols)` (a layout of its own) runs on the FP8 rows so
converted.

    mkdir -p v/old && for f in fused_moe linear; do git show c19787f:moebius/kernels/$f.py > v/old/$f.py; done
    python benchmarks/kernels/moe_fp8_variants.py out.json --variants tree=moebius/kernels old=v/old \\
        --w8a8 tree old --bf16 tree --batches 8 64 256
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

import torch

from moebius.bench.floor import hardware_of
from moebius.bench.graph_timing import graph_time_us
from moebius.bench.results import write_result
from moebius.kernels import KernelConfig
from moebius.kernels import fused_moe as fm
from moebius.kernels.rows import FORMATS
from moebius.layers.moe import experts_ref

D, I, E, K = 2048, 768, 128, 8  # Qwen3-30B-A3B's experts
L2_EXPERTS = 4  # the L2 form's distinct experts (their FP8 rows: ~21 MB, inside an H100's or H200's L2)


def load_variant(name: str, folder: Path, l2: bool, into: Path) -> ModuleType:
    """The folder's fused_moe.py as a module of its own, importing the folder's linear.py (as `<name>_linear`) in
    place of the package's; with l2, every weight address taken at expert e % L2_EXPERTS."""
    mod = f"{name}_{'l2' if l2 else 'hbm'}"
    src = (folder / "fused_moe.py").read_text().replace("from moebius.kernels.linear import",
                                                        f"from {mod}_linear import")
    if l2:  # (pointers, and TMA descriptors' row coordinates)
        src, n = re.subn(r"(W13|W2) \+ e\.to\(tl\.int64\)", rf"\1 + (e % {L2_EXPERTS}).to(tl.int64)", src)
        src = re.sub(r"\.load\(\[e \* ", f".load([(e % {L2_EXPERTS}) * ", src)
        assert n >= 2, f"{folder}: no weight address to redirect"
    for part, text in (("linear", (folder / "linear.py").read_text()), ("fused_moe", src)):
        path = into / f"{mod}_{part}.py"  # (Triton reads a kernel's source from its file)
        path.write_text(text)
        spec = importlib.util.spec_from_file_location(f"{mod}_{part}", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[f"{mod}_{part}"] = module  # (the fused MoE imports its linear by this name; dataclasses look
        spec.loader.exec_module(module)        # their module up)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(prog="python benchmarks/kernels/moe_fp8_variants.py")
    ap.add_argument("output")
    ap.add_argument("--variants", nargs="+", required=True, help="name=folder (its fused_moe.py and linear.py)")
    ap.add_argument("--w8a8", nargs="*", default=[], help="the variants also timed in W8A8 (--fp8-activations)")
    ap.add_argument("--bf16", nargs="*", default=[], help="the variants also timed on the experts in bf16")
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 64, 256])
    ap.add_argument("--chunk-rows", action="store_true", help="the rows a segment a chunk (kernels/fp8_rows.py: "
                    "down's where TP over ranks cuts it), not one segment a row (one rank's)")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="moe_variants_"))
    mods = {}
    for spec in a.variants:
        name, folder = spec.split("=", 1)
        for l2 in (False, True):
            mods[f"{name}_l2" if l2 else name] = (name, load_variant(name, Path(folder), l2, tmp))
    fmt = FORMATS["fp8"]
    rate = hardware_of(torch.cuda.get_device_name(0)).hbm_bytes_per_s  # the floor's copy rate of this card
    torch.manual_seed(0)
    whole = not a.chunk_rows
    w13 = fmt.rows_of(torch.randn(E, 2 * I, D, device="cuda", dtype=torch.bfloat16) * 0.02, whole)
    w2 = fmt.rows_of(torch.randn(E, D, I, device="cuda", dtype=torch.bfloat16) * 0.02, whole)
    w13_ref, w2_ref = fmt.unpack(w13, D, torch.float32), fmt.unpack(w2, I, torch.float32)
    w13_bf16, w2_bf16 = w13_ref.bfloat16(), w2_ref.bfloat16()
    expert_bytes = w13[0].numel() + w2[0].numel()
    rows, t0 = [], time.time()
    repacked: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for B in a.batches:
        x = torch.randn(B, D, device="cuda", dtype=torch.bfloat16)
        w_TK, ids = torch.randn(B, E, device="cuda").softmax(-1).topk(K, -1)
        w_TK = w_TK.to(torch.bfloat16)
        hit = int(torch.unique(ids).numel())
        ref = experts_ref(x.float(), w_TK.float(), ids, w13_ref, w2_ref, 0)
        row = dict(batch=B, experts_hit=hit, weight_bytes=hit * expert_bytes,
                   floor_us=hit * expert_bytes / rate * 1e6,
                   tree_us=graph_time_us(lambda: fm.fused_experts(x, w_TK, ids, w13, w2, 0, E)))  # noqa: B023
        for key, (name, m) in mods.items():
            forms = ["w8a16"] + ["w8a8"] * (name in a.w8a8) + ["bf16"] * (name in a.bf16)
            for form in forms:
                col = key + ("" if form == "w8a16" else f"_{form}")
                kw = dict(kc=KernelConfig(fp8_activations=True)) if form == "w8a8" else {}
                ws = (w13_bf16, w2_bf16) if form == "bf16" else (w13, w2)
                if form != "bf16" and hasattr(m, "repack_rows"):  # a variant's own layout of the FP8 rows
                    if name not in repacked:
                        repacked[name] = (m.repack_rows(w13, D), m.repack_rows(w2, I))
                    ws = repacked[name]
                run = lambda m=m, kw=kw, ws=ws: m.fused_experts(x, w_TK, ids, *ws, 0, E, **kw)  # noqa: B023, E731
                if key == name:  # (the L2 form's outputs are another expert's)
                    row[f"{col}_rel_err"] = ((run().float() - ref).norm() / ref.norm()).item()
                row[f"{col}_us"] = graph_time_us(run)
                nbytes = hit * 3 * I * D * 2 if form == "bf16" else row["weight_bytes"]
                row[f"{col}_TBps"] = nbytes / row[f"{col}_us"] / 1e6
        print(json.dumps(row), flush=True)
        rows.append(row)
    write_result(a.output, tables={"per_batch": rows}, summary={"wall_s": time.time() - t0},
                 params=dict(variants=a.variants, w8a8=a.w8a8, bf16=a.bf16, batches=a.batches,
                             row_layout="a segment a chunk" if a.chunk_rows else "one segment a row"),
                 note="the fused MoE on FP8 rows in each variant's source, Qwen3-30B-A3B's experts, us a call in a "
                      "CUDA graph: <name>_us as written, <name>_l2_us with every expert's weights read as expert "
                      f"e % {L2_EXPERTS} (from L2: the kernel's ceiling), _w8a8 with --fp8-activations, _bf16 on the "
                      "experts in bf16; TBps: the hit experts' weight bytes (FP8 rows', or bf16's) over the time; "
                      "floor_us: the FP8 rows' bytes at the card's floor rate (bench/floor.py); rel_err: against the "
                      "float math on the dequantized rows; tree_us: the engine's import")


if __name__ == "__main__":
    main()
