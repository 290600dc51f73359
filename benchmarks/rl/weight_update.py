"""Weight updates into a running engine at P = 1 (the rank in this process), against what the bytes cost to move.

    python benchmarks/rl/weight_update.py --num-layers 24 --output benchmarks/results/h200-p1-weight-update.json
    python benchmarks/rl/weight_update.py --device cpu          (a smoke run on the built-in tiny model)

1. In memory: `llm.update_weights` of ALL weights from device tensors in Hugging Face names (random, the engine's
   shapes and dtype, built once), per-expert names as a checkpoint has them and (`fused`) transformers' fused
   `mlp.experts.gate_up_proj` / `down_proj` (the per-expert tensors are views of the fused ones: one set of bytes),
   timed end to end (wall time, synchronized), median of --repeats after a warm-up; against a device-to-device copy
   of every source tensor into a preallocated destination (same tensors, same bytes) and one flat copy of that many
   bytes (the copy engine's ceiling).
2. From disk: the same tensors written as a safetensors directory (--disk-dir, one file a layer), the page cache
   dropped where allowed (else the run says it is warm); `update_weights_from_disk` against a plain read of every
   file's bytes in the same cache state.
3. Graphs after an update: greedy tokens of a few prompts before the update, after it with the decode graphs, and
   after it with every step run eagerly (the runner's `graphs=False`, as the probes run it) on the same engine.

Writes one JSON (tables `update`, `disk`, `graphs`, `summary`) and a PNG bar chart beside it (--output).
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import statistics
import time
from typing import Any

import torch

from moebius.bench import results


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _timed(fn: Any, device: str) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def _median_after_warmup(fn: Any, device: str, repeats: int) -> tuple[float, list[float]]:
    _timed(fn, device)
    times = [_timed(fn, device) for _ in range(repeats)]
    return statistics.median(times), times


def build_sources(cfg: Any, dtype: torch.dtype, device: str, seed: int
                  ) -> tuple[list[tuple[str, torch.Tensor]], list[tuple[str, torch.Tensor]]]:
    """Random tensors of every checkpoint name the model reads: (per-expert list, fused list), sharing storage (a
    per-expert tensor is a view of its layer's fused tensor). Norm weights near one, the rest std 0.02 (as the dummy
    checkpoint), so generation stays finite."""
    from moebius.models.registry import family_of
    from moebius.models.specs import per_expert

    g = torch.Generator(device=device).manual_seed(seed)
    shapes = family_of(cfg).checkpoint_tensors(cfg)
    fused_names = [n for n in shapes if n.endswith("mlp.experts.gate_up_proj") or n.endswith("mlp.experts.down_proj")]
    covered: set[str] = set()
    fused: list[tuple[str, torch.Tensor]] = []
    per: list[tuple[str, torch.Tensor]] = []
    for n in fused_names:
        t = torch.randn(shapes[n], generator=g, device=device, dtype=torch.float32).mul_(0.02).to(dtype)
        fused.append((n, t))
        parts = per_expert(cfg, n, t)
        per += parts
        covered |= {p for p, _ in parts}
    for n, shape in shapes.items():
        if n in covered or n in fused_names:
            continue
        if n.endswith("norm.weight"):
            t = (1 + 0.05 * torch.randn(shape, generator=g, device=device)).to(dtype)
        else:
            t = torch.randn(shape, generator=g, device=device, dtype=torch.float32).mul_(0.02).to(dtype)
        per.append((n, t))
        fused.append((n, t))
    return per, fused


def _nbytes(named: list[tuple[str, torch.Tensor]]) -> int:
    return sum(t.numel() * t.element_size() for _, t in named)


def _drop_cache() -> bool:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def _read_all(files: list[str]) -> int:
    buf = bytearray(64 << 20)
    view = memoryview(buf)
    n = 0
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while True:
                k = f.readinto(view)
                if not k:
                    break
                n += k
    return n


def write_checkpoint(per: list[tuple[str, torch.Tensor]], path: str) -> list[str]:
    """One safetensors file a layer (and one for the rest), every tensor copied to the host on its own."""
    from safetensors.torch import save_file

    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    groups: dict[str, list[tuple[str, torch.Tensor]]] = {}
    for n, t in per:
        key = n.split(".")[2] if n.startswith("model.layers.") else "rest"
        groups.setdefault(key, []).append((n, t))
    files = []
    for key, named in groups.items():
        file = os.path.join(path, f"model-{key}.safetensors")
        save_file({n: t.detach().cpu().contiguous() for n, t in named}, file)
        files.append(file)
    return files


def greedy(llm: Any, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from moebius import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp)]


def eager_generate(llm: Any, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """The same engine, every step eager: the in-process rank's runner launched with graphs=False (as the probes)."""
    runner = llm.engine.ranks.rank.runner
    runner.launch = functools.partial(type(runner).launch, runner, graphs=False)
    try:
        llm.reset_prefix_cache()
        return greedy(llm, prompts, max_tokens)
    finally:
        del runner.launch


def plot(result: dict[str, Any], png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = results.summary_of(result)
    panels = [(rows, unit, scale) for rows, unit, scale in ((results.table(result, "update"), "ms", 1e3),
                                                           (results.table(result, "disk"), "s", 1.0)) if rows]
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 3.6), squeeze=False)
    for ax, (rows, unit, scale) in zip(axes[0], panels, strict=True):
        labels = [r["what"] + (f" #{r['repeat']}" if r.get("repeat") else "") for r in rows]
        vals = [r["median_s"] * scale for r in rows]
        ax.barh(labels, vals, color=["C0" if r.get("kind") == "update" else "C7" for r in rows])
        for i, (v, r) in enumerate(zip(vals, rows, strict=True)):
            ax.text(v, i, f" {v:.3g} {unit} ({r['gb_per_s']:.4g} GB/s)", va="center", fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel(f"{unit} (median)")
        ax.set_xlim(0, max(vals) * 1.6)
    ratios = (f"in memory {s.get('ratio_per_expert_vs_copy', 0):.2f}x (per expert) / "
              f"{s.get('ratio_fused_vs_copy', 0):.2f}x (fused) the copy of the same tensors, "
              f"{s.get('ratio_fused_vs_flat_copy', 0):.2f}x a flat copy")
    if s.get("ratio_disk_vs_read"):
        ratios += f"; disk {s['ratio_disk_vs_read']:.2f}x the read"
    fig.suptitle(f"weight update of {s.get('gb', 0):.1f} GB, {s.get('num_layers')} layers: {ratios}", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(prog="python benchmarks/rl/weight_update.py", description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cpu: a smoke run on the built-in tiny model (no preset), float32")
    ap.add_argument("--model", default=None, help="default: qwen3-30b-a3b on cuda, the built-in model on cpu")
    ap.add_argument("--num-layers", type=int, default=None, help="decoder layers kept (engine + source must fit)")
    ap.add_argument("--repeats", type=int, default=3, help="timed updates / copies after one warm-up")
    ap.add_argument("--disk-repeats", type=int, default=1, help="cold disk reads / updates (each after a drop)")
    ap.add_argument("--disk-dir", default="/tmp/moebius-weight-update", help="where the safetensors go (removed)")
    ap.add_argument("--skip-disk", action="store_true")
    ap.add_argument("--drop-cache", action=argparse.BooleanOptionalAction, default=None,
                    help="drop the page cache before each disk read (root; default: on cuda only)")
    ap.add_argument("--skip-graphs", action="store_true")
    ap.add_argument("--max-tokens", type=int, default=16, help="greedy tokens a prompt in the graph check")
    ap.add_argument("--time-budget", type=float, default=1e9,
                    help="seconds: past this, the phases not begun are skipped (the result still written)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--output", default=None, help="result JSON (PNG beside it); written after every phase")
    args = ap.parse_args()
    t_start = time.perf_counter()
    from moebius import LLM

    cuda = args.device == "cuda"
    if args.drop_cache is None:
        args.drop_cache = cuda
    model = args.model or ("qwen3-30b-a3b" if cuda else None)
    kw: dict[str, Any] = dict(device=args.device, rank_process="off", max_model_len=256,
                              max_num_batched_tokens=256)
    if model is not None:
        kw["model"] = model
    if cuda:
        kw.update(load_format="dummy", dtype="bfloat16", max_total_tokens=16384, cuda_graph_max_bs=8,
                  cuda_graph_max_tokens=256, warmup="none")
    else:
        kw.update(dtype="float32", block_size=16)
    if args.num_layers is not None:
        kw["num_layers"] = args.num_layers
    llm = LLM(**{k: v for k, v in kw.items() if k != "model"}, model=kw.get("model"))
    start_s = time.perf_counter() - t_start
    cfg = llm.engine.model_config
    dtype = torch.bfloat16 if cuda else torch.float32
    tables: dict[str, list[dict[str, Any]]] = {"update": [], "disk": [], "graphs": []}
    summary: dict[str, Any] = {"engine_start_s": round(start_s, 2), "num_layers": cfg.num_layers}
    skipped: list[str] = []

    def over() -> bool:
        return time.perf_counter() - t_start > args.time_budget

    def save() -> None:
        summary["wall_s"] = round(time.perf_counter() - t_start, 1)
        summary["skipped"] = skipped
        if args.output is None:
            return
        where = ("of 48: --num-layers so the engine, the source tensors and the copy destination (3 x ~31 GB) fit "
                 "in one H200") if cuda else "smoke run on the CPU"
        note = (f"Weight updates into a running engine at P = 1 (rank_process off), {model or 'built-in model'}"
                f" shapes, {cfg.num_layers} decoder layers ({where}), "
                f"{str(dtype).removeprefix('torch.')}, dummy weights. Table update: llm.update_weights of every weight "
                "from device tensors (per-expert names; fused gate_up_proj / down_proj), wall time with a "
                "synchronize, median after one warm-up, against a device copy of the same source tensors into a "
                "preallocated destination (copy_per_tensor) and one flat copy of as many bytes (copy_flat); "
                "ratio = update / copy_per_tensor. Table disk: update_weights_from_disk from a safetensors "
                f"directory of the same tensors on the machine's local disk ({args.disk_dir}), against reading "
                "every file's bytes once (plain reads), each after the page cache was dropped (cache_dropped false: "
                "warm). Table graphs: greedy tokens of a few prompts before the update, after it with decode graphs "
                "and after it eagerly on the same engine (runner graphs=False).")
        results.write_result(args.output, tables={k: v for k, v in tables.items() if v}, summary=summary,
                             params=vars(args) | {"engine": {k: v for k, v in kw.items()}},
                             note=note, num_gpus=1 if cuda else 0)
        if cuda:
            try:
                plot(results.load_result(args.output), os.path.splitext(args.output)[0] + ".png")
            except ImportError:
                print("matplotlib missing: no PNG")

    prompts = [[(17 * i + 5 * j) % 1000 + 10 for j in range(8 + 3 * i)] for i in range(4)]
    before = None if args.skip_graphs else greedy(llm, prompts, args.max_tokens)

    per, fused = build_sources(cfg, dtype, args.device, args.seed)
    nbytes = _nbytes(per)
    gb = nbytes / 1e9
    summary.update(gb=round(gb, 3), tensors_per_expert=len(per), tensors_fused=len(fused))
    print(f"engine up in {start_s:.1f} s; {len(per)} tensors ({len(fused)} fused), {gb:.2f} GB")

    # 1. in memory, against copies of the same bytes
    dst = {n: torch.empty_like(t) for n, t in fused}  # fused storage: per-expert destinations are views of it
    from moebius.models.specs import per_expert
    dst_per = [d for n, t in fused for _, d in per_expert(cfg, n, dst[n])]

    def copy_per() -> None:
        for (_, s), d in zip(per, dst_per, strict=True):
            d.copy_(s)

    def copy_fused() -> None:
        for n, s in fused:
            dst[n].copy_(s)

    # the flat copy: at most 8 GB (memory: engine + sources + destination already hold ~3 x the bytes), its time
    # scaled to the sources' bytes (a copy this large runs at the copy engine's rate: linear in bytes)
    flat_bytes = min(nbytes, 8_000_000_000)
    flat_src = torch.empty(flat_bytes, dtype=torch.uint8, device=args.device)
    flat_dst = torch.empty_like(flat_src)
    for what, fn, kind in (("copy_flat", lambda: flat_dst.copy_(flat_src), "copy"),
                           ("copy_per_tensor.per_expert", copy_per, "copy"),
                           ("copy_per_tensor.fused", copy_fused, "copy"),
                           ("update.per_expert", lambda: llm.update_weights(per, weight_version="w1"), "update"),
                           ("update.fused", lambda: llm.update_weights(fused, weight_version="w1"), "update")):
        med, times = _median_after_warmup(fn, args.device, args.repeats)
        row = dict(what=what, kind=kind, median_s=med, times_s=times, gb=gb, gb_per_s=gb / med)
        if what == "copy_flat":  # scaled from flat_bytes to the sources' bytes
            row.update(measured_gb=flat_bytes / 1e9, measured_median_s=med, median_s=med * nbytes / flat_bytes,
                       gb_per_s=flat_bytes / 1e9 / med)
            med = row["median_s"]
        tables["update"].append(row)
        print(f"{what:30s} {med * 1e3:9.1f} ms  {gb / med:7.1f} GB/s")
    flat_src = flat_dst = None  # the copies' memory back before the disk phase
    dst.clear()
    dst_per.clear()
    if cuda:
        torch.cuda.empty_cache()
    t = {r["what"]: r["median_s"] for r in tables["update"]}
    summary.update(ratio_per_expert_vs_copy=t["update.per_expert"] / t["copy_per_tensor.per_expert"],
                   ratio_fused_vs_copy=t["update.fused"] / t["copy_per_tensor.fused"],
                   ratio_per_expert_vs_flat_copy=t["update.per_expert"] / t["copy_flat"],
                   ratio_fused_vs_flat_copy=t["update.fused"] / t["copy_flat"])
    save()

    # 3. graphs after the update (weights W = the sources, just written)
    if not args.skip_graphs and not over():
        llm.reset_prefix_cache()
        graph = greedy(llm, prompts, args.max_tokens)
        eager = eager_generate(llm, prompts, args.max_tokens)
        for i, (b, g, e) in enumerate(zip(before, graph, eager, strict=True)):
            first = next((k for k, (x, y) in enumerate(zip(g, e, strict=True)) if x != y), None)
            tables["graphs"].append(dict(prompt=i, tokens_graph=g, tokens_eager=e, tokens_before_update=b,
                                         graph_equals_eager=g == e, first_difference=first,
                                         changed_by_update=b != g))
        rows = tables["graphs"]
        summary.update(graphs_equal_eager=sum(r["graph_equals_eager"] for r in rows), graphs_prompts=len(rows),
                       changed_by_update=sum(r["changed_by_update"] for r in rows))
        print(f"graphs == eager on {summary['graphs_equal_eager']}/{len(rows)} prompts; the update changed "
              f"{summary['changed_by_update']}")
        save()
    elif not args.skip_graphs:
        skipped.append("graphs")

    # 2. from disk
    parent = os.path.dirname(os.path.abspath(args.disk_dir))
    free = shutil.disk_usage(parent).free
    summary["disk_free_gb"] = round(free / 1e9, 1)
    if not args.skip_disk and free < 1.1 * nbytes:
        skipped.append(f"disk: {free / 1e9:.1f} GB free in {parent}, {nbytes / 1e9:.1f} GB needed")
    elif not args.skip_disk and not over():
        t0 = time.perf_counter()
        files = write_checkpoint(per, args.disk_dir)
        os.sync()
        summary["disk_write_s"] = round(time.perf_counter() - t0, 2)
        per.clear()  # the sources' memory back (written to disk)
        fused.clear()
        if cuda:
            torch.cuda.empty_cache()
        disk_bytes = sum(os.path.getsize(f) for f in files)
        summary["disk_gb"] = round(disk_bytes / 1e9, 3)
        print(f"wrote {disk_bytes / 1e9:.2f} GB in {summary['disk_write_s']} s")
        for rep in range(args.disk_repeats):
            if over():
                skipped.append(f"disk repeat {rep}")
                break
            for what, fn in (("disk_read", lambda: _read_all(files)),
                             ("update_from_disk", lambda: llm.update_weights_from_disk(args.disk_dir, "w2"))):
                dropped = _drop_cache() if args.drop_cache else False
                s = _timed(fn, args.device)
                tables["disk"].append(dict(what=what, kind="update" if what.startswith("update") else "copy",
                                           repeat=rep, cache_dropped=dropped, median_s=s, gb=disk_bytes / 1e9,
                                           gb_per_s=disk_bytes / 1e9 / s))
                print(f"{what:30s} {s:9.2f} s  {disk_bytes / 1e9 / s:7.2f} GB/s  (cache dropped: {dropped})")
        rd = [r["median_s"] for r in tables["disk"] if r["what"] == "disk_read"]
        up = [r["median_s"] for r in tables["disk"] if r["what"] == "update_from_disk"]
        if rd and up:
            summary.update(ratio_disk_vs_read=statistics.median(up) / statistics.median(rd),
                           cache_dropped=all(r["cache_dropped"] for r in tables["disk"]))
        shutil.rmtree(args.disk_dir, ignore_errors=True)
    elif not args.skip_disk:
        skipped.append("disk")
    save()
    llm.close()
    print({k: v for k, v in summary.items()})


if __name__ == "__main__":
    main()
