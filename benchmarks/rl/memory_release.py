"""Memory release and resume at P = 1 (the rank in this process), for a trainer colocated on the GPU.

    python benchmarks/rl/memory_release.py --output benchmarks/results/h200-p1-memory-release.json
    python benchmarks/rl/memory_release.py --device cpu          (a smoke run on the built-in tiny model)

An engine on Qwen3-30B-A3B shapes (every layer, dummy weights, the KV cache sized by the default --mem-fraction, the
decode graphs captured), then cycles of: `release_memory_occupation` of weights + KV cache (weights kept in pinned
host memory), `resume_memory_occupation`; a release of the KV cache alone; `sleep(level=2)` (weights dropped) and
`wake_up`. Each measures the device's free memory before and after (`torch.cuda.mem_get_info`: what the trainer
gets) against the unified buffer's bytes, and the wall time of the call. Greedy tokens of a few prompts before any
release, after each resume through the captured graphs, and eagerly (the runner's graphs=False) must all be equal;
a decode-heavy batch is timed before and after (the remapped memory is as fast). Writes one JSON (tables `cycles`,
`tokens`, `decode`, `summary`) and a PNG beside it (--output).
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import torch
from weight_update import eager_generate, greedy

from moebius.bench import results


def _free(cuda: bool) -> int:
    if cuda:
        torch.cuda.synchronize()
        return torch.cuda.mem_get_info()[0]
    with open("/proc/self/statm") as f:  # the CPU: this process's resident bytes, negated (freed = more "free")
        return -int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def plot(result: dict[str, Any], png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results.table(result, "cycles")
    s = results.summary_of(result)
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 3.8))
    labels = [f"{r['what']} #{r['cycle']}" for r in rows]
    a.barh(labels, [r["freed_gib"] for r in rows], color="C0")
    a.axvline(s["buffer_gib"], color="k", ls="--", lw=1, label=f"unified buffer {s['buffer_gib']:.1f} GiB")
    a.set_xlabel("device memory freed by the release (GiB)")
    a.legend(fontsize=8)
    a.invert_yaxis()
    b.barh(labels, [r["release_s"] for r in rows], color="C1", label="release")
    b.barh(labels, [r["resume_s"] for r in rows], left=[r["release_s"] for r in rows], color="C2", label="resume")
    b.set_xlabel("seconds")
    b.legend(fontsize=8)
    b.invert_yaxis()
    fig.suptitle(f"memory release / resume, {s['num_layers']} layers: weights + KV freed "
                 f"{s['freed_fraction_min']:.1%} of the buffer (min); tokens after resume equal before: "
                 f"{s['tokens_equal']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(prog="python benchmarks/rl/memory_release.py", description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--model", default=None, help="default: qwen3-30b-a3b on cuda, the built-in model on cpu")
    ap.add_argument("--num-layers", type=int, default=None)
    ap.add_argument("--cycles", type=int, default=2, help="release / resume cycles of weights + KV cache")
    ap.add_argument("--max-tokens", type=int, default=16, help="greedy tokens a prompt in the token check")
    ap.add_argument("--decode-batch", type=int, default=64, help="requests of the timed decode batch")
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--output", default=None, help="result JSON (PNG beside it)")
    args = ap.parse_args()
    t_start = time.perf_counter()
    from moebius import LLM, SamplingParams

    cuda = args.device == "cuda"
    model = args.model or ("qwen3-30b-a3b" if cuda else None)
    kw: dict[str, Any] = dict(device=args.device, rank_process="off", max_model_len=1024, max_num_batched_tokens=1024)
    if cuda:
        kw.update(load_format="dummy", dtype="bfloat16", cuda_graph_max_bs=args.decode_batch,
                  cuda_graph_max_tokens=256, warmup="none")
    else:
        kw.update(dtype="float32", block_size=16)
    if args.num_layers is not None:
        kw["num_layers"] = args.num_layers
    llm = LLM(model=model, **kw)
    start_s = time.perf_counter() - t_start
    cfg = llm.engine.model_config
    mem = llm.engine.query("memory")[0]
    buffer = mem["umm_bytes"]
    summary: dict[str, Any] = {"engine_start_s": round(start_s, 2), "num_layers": cfg.num_layers,
                               "buffer_gib": buffer / 2**30, "releasable_fraction": mem["releasable_bytes"] / buffer,
                               "kv_gib": mem["kv_bytes"] / 2**30}
    tables: dict[str, list[dict[str, Any]]] = {"cycles": [], "tokens": [], "decode": []}
    print(f"engine up in {start_s:.1f} s: buffer {buffer / 2**30:.2f} GiB, releasable "
          f"{mem['releasable_bytes'] / buffer:.2%}")

    prompts = [[(17 * i + 5 * j) % 1000 + 10 for j in range(8 + 3 * i)] for i in range(4)]
    before = greedy(llm, prompts, args.max_tokens)
    batch = [[(31 * i + 7 * j) % 1000 + 10 for j in range(32)] for i in range(args.decode_batch)]
    decode = SamplingParams(temperature=0.0, max_tokens=args.decode_tokens, ignore_eos=True)

    def time_decode(when: str) -> None:
        llm.reset_prefix_cache()
        t = time.perf_counter()
        llm.generate(batch, decode)
        s = time.perf_counter() - t
        tables["decode"].append(dict(when=when, seconds=s, tokens=args.decode_batch * args.decode_tokens,
                                     tok_per_s=args.decode_batch * args.decode_tokens / s))
        print(f"decode batch {args.decode_batch} x {args.decode_tokens} ({when}): {s:.3f} s")

    def check_tokens(when: str) -> None:
        llm.reset_prefix_cache()
        graph = greedy(llm, prompts, args.max_tokens)
        eager = eager_generate(llm, prompts, args.max_tokens)
        tables["tokens"].append(dict(when=when, graph_equals_before=graph == before,
                                     eager_equals_before=eager == before))
        print(f"tokens after {when}: graphs {'==' if graph == before else '!='} before, eager "
              f"{'==' if eager == before else '!='} before")

    time_decode("before")
    time_decode("before (again)")
    cycles = [("weights+kv_cache, weights kept", None, True)] * args.cycles + [("kv_cache", ["kv_cache"], True)]
    if cuda:
        cycles.append(("sleep level 2: weights dropped", None, False))
    for i, (what, tags, keep) in enumerate(cycles):
        free0 = _free(cuda)
        t = time.perf_counter()
        out = llm.release_memory_occupation(tags, keep_weights=keep)
        release_s = time.perf_counter() - t
        freed = _free(cuda) - free0
        t = time.perf_counter()
        back = llm.resume_memory_occupation(tags)
        resume_s = time.perf_counter() - t
        row = dict(what=what, cycle=i, release_s=release_s, resume_s=resume_s, freed_bytes=freed,
                   freed_gib=freed / 2**30, freed_fraction_of_buffer=freed / buffer, unmapped_bytes=out.nbytes,
                   host_bytes=out.host_bytes, release_rank_s=out.seconds, resume_rank_s=back.seconds)
        tables["cycles"].append(row)
        print(f"{what}: freed {freed / 2**30:.2f} GiB ({freed / buffer:.1%} of the buffer) in {release_s:.2f} s, "
              f"resumed in {resume_s:.2f} s ({out.host_bytes / 2**30:.2f} GiB through the host)")
        if keep:
            check_tokens(f"{what} #{i}")
    time_decode("after the cycles")
    full = [r for r in tables["cycles"] if r["what"].startswith("weights+kv_cache")]
    summary.update(freed_fraction_min=min(r["freed_fraction_of_buffer"] for r in full),
                   release_s_median=sorted(r["release_s"] for r in full)[len(full) // 2],
                   resume_s_median=sorted(r["resume_s"] for r in full)[len(full) // 2],
                   tokens_equal=all(r["graph_equals_before"] and r["eager_equals_before"] for r in tables["tokens"]),
                   wall_s=round(time.perf_counter() - t_start, 1))
    print(summary)
    llm.close()
    if args.output is None:
        return
    note = (f"Memory release / resume at P = 1 (rank_process off), {model or 'built-in model'} shapes, "
            f"{cfg.num_layers} decoder layers, dummy weights, KV cache sized by the default --mem-fraction, decode "
            "graphs captured up to the decode batch. Table cycles: release_memory_occupation (tags: both, or the KV "
            "cache alone; keep_weights: the weights copied to pinned host memory first, or dropped) and "
            "resume_memory_occupation, wall times; freed_bytes: the device's free memory after the release minus "
            "before (torch.cuda.mem_get_info), against the unified buffer's bytes. Table tokens: greedy tokens of 4 "
            "prompts after each resume, through the graphs and eagerly, against before any release. Table decode: a "
            "greedy batch timed before and after the cycles.")
    results.write_result(args.output, tables={k: v for k, v in tables.items() if v}, summary=summary,
                         params=vars(args) | {"engine": kw}, note=note, num_gpus=1 if cuda else 0)
    try:
        plot(results.load_result(args.output), os.path.splitext(args.output)[0] + ".png")
    except ImportError:
        print("matplotlib missing: no PNG")


if __name__ == "__main__":
    main()
