"""Measure the fused MoE kernels on one GPU at the decode shapes of a preset and pick block shapes per size.

For each layout's expert shard (TP: all experts, I/P columns; EP: E/P whole experts fed every rank's tokens) and
each global batch, checks the fused path against the torch reference (the default shapes' `rel_err`, the best
found's `best.rel_err`; up to 512 tokens), then times (inside CUDA graphs, so launch
gaps count as they do in the engine) the align kernel and each GEMM kernel over candidate block shapes. Writes
JSON: a row per (mode, batch) with the default and the best shapes (nested settings flattened: `best.gate_up.BN`),
their times and the weight bandwidth they reach, and torch._grouped_mm's GEMMs on the same pairs as a reference
(table "per_batch"); every BM tried, from 32 rows also its best with half blocks (`TileConfig.halves`; table
"tried"); every shape each BM's search timed, gate_up's and down's (table "candidates"); wall_s (the "summary" row).

    python benchmarks/kernels/moe_tune.py --preset qwen3-30b-a3b --ranks 2 --output moe_tune.json
    python benchmarks/kernels/moe_tune.py --no-search --batches 256 512 1024 2048 --output moe_tma.json
    python benchmarks/kernels/moe_tune.py --ranks 1 --modes tp --batches 2048 8192 16384 --output moe_prefill.json
    python benchmarks/kernels/moe_tune.py --ranks 1 --modes tp --quantization fp8 --output moe_tune_fp8.json
    python benchmarks/kernels/moe_tune.py --preset gpt-oss-20b --ranks 1 --modes tp --no-search --groups 1 4 8 \
        --batches 512 1024 --output moe_groups.json

With --quantization the experts are quantized rows (kernels/rows.py: the GEMMs take BK and pipeline stages from the
format, so the search is over BN, warps and BM; --fp8-max-stages lifts FP8's cap on the stages, so that the search's
3, 4 and 6 apply); the reference is the float math on the dequantized rows (with FP8's W8A8 activations the error is
percents), grouped_mm the bf16 weights' GEMMs.

Recorded: benchmarks/results/h200-moe-tune.json, h200-moe-tma.json (`--no-search`).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
import time

import torch

from moebius.bench.floor import hardware_of
from moebius.bench.graph_timing import graph_time_us
from moebius.bench.results import flatten, params_of, write_result
from moebius.config import PRESETS
from moebius.kernels import fused_moe as fm
from moebius.kernels.fused import sum_k
from moebius.kernels.rows import FORMATS
from moebius.layers.moe import experts_ref
from moebius.models.registry import model_config

SMALL = [fm.TileConfig(bn, bk, w, s) for bn, bk, (w, s) in itertools.product(
    (16, 32, 64, 128), (128, 256), ((4, 3), (4, 4), (4, 6)))]
LARGE = [fm.TileConfig(bn, bk, w, s, tma) for bn, bk, (w, s), tma in itertools.product(
    (64, 128), (64, 128), ((4, 3), (8, 3), (4, 4), (8, 4)), (False, True))] + [
    fm.TileConfig(256, 64, 8, s, True) for s in (2, 3)] + [  # one N = 256 MMA a K step (down; gate_up's two spill)
    # four warpgroups: 128 x 512 (gate_up) or 256 x 256 tiles, more FLOPs a byte brought from L2 (at 8k tokens the
    # GEMMs did not speed up when the padding rows of an expert's last block were dropped: the loads set the pace)
    fm.TileConfig(bn, 64, 16, s, True) for bn in (128, 256) for s in (2, 3)]


def best_of(configs: list[fm.TileConfig], run, timed: list[tuple[fm.TileConfig, float]]
            ) -> tuple[fm.TileConfig | None, float]:
    """The fastest of `configs` and its µs; every one timed is appended to `timed` (a shape that does not compile is
    skipped)."""
    out: tuple[fm.TileConfig | None, float] = (None, float("inf"))
    for c in configs:
        try:
            t = graph_time_us(lambda c=c: run(c))
        except Exception as e:  # noqa: BLE001 - shapes that exceed shared memory fail to compile: skip them
            print(f"  skip {c}: {type(e).__name__}", flush=True)
            torch.cuda.synchronize()
            continue
        timed.append((c, t))
        if t < out[1]:
            out = (c, t)
    return out


def rel_err(out: torch.Tensor, ref: torch.Tensor | None) -> float | None:
    """The outputs' error relative to the reference's norm (None without a reference: past 512 tokens)."""
    return None if ref is None else ((out.float() - ref).norm() / ref.norm().clamp_min(1e-6)).item()


def main() -> None:
    ap = argparse.ArgumentParser(prog="python benchmarks/kernels/moe_tune.py")
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--batches", type=int, nargs="+", default=[2 ** i for i in range(12)])
    ap.add_argument("--modes", default="tp,ep", help="the layouts' shards to tune (at --ranks 1 they are the same)")
    ap.add_argument("--output", default="moe_tune.json")
    ap.add_argument("--old", help="path of a previous fused_moe.py to time for comparison")
    ap.add_argument("--quantization", choices=sorted(FORMATS), help="the experts as quantized rows of this format")
    ap.add_argument("--no-search", action="store_true", help="time the default block shapes only (`default_timed`, "
                    "and `tma_switched`: them with TMA switched), no search over others")
    ap.add_argument("--groups", type=int, nargs="*", default=[], help="also time the default shapes, and each "
                    "searched BM's best, with their blocks interleaved in groups of these sizes (`TileConfig.group`)")
    ap.add_argument("--fp8-max-stages", type=int, help="let FP8 rows' tiles pipeline this many stages (the search's "
                    "3, 4 and 6 where shared memory holds them; the engine caps them at fused_moe.FP8_MAX_STAGES)")
    a = ap.parse_args()
    if a.fp8_max_stages:
        fm.FP8_MAX_STAGES = a.fp8_max_stages
    m = model_config(PRESETS[a.preset])  # the family's parse: every family's expert shapes under one name
    D, I_full, E_all, K = m.hidden_size, m.moe_intermediate_size, m.num_experts, m.top_k
    P = a.ranks
    old = None
    if a.old:
        import importlib.util

        spec = importlib.util.spec_from_file_location("old_moe", a.old)
        old = importlib.util.module_from_spec(spec)
        sys.modules["old_moe"] = old  # its dataclasses look their module up
        spec.loader.exec_module(old)
    dev = "cuda"
    rate = hardware_of(torch.cuda.get_device_name(0)).hbm_bytes_per_s  # the floor's copy rate of this card
    results, tried, candidates = [], [], []
    t0 = time.time()
    for mode in a.modes.split(","):
        E, I = (E_all, I_full // P) if mode == "tp" else (E_all // P, I_full)
        torch.manual_seed(0)
        w13 = w13_bf16 = torch.randn(E, 2 * I, D, device=dev, dtype=torch.bfloat16) * 0.02
        w2 = w2_bf16 = torch.randn(E, D, I, device=dev, dtype=torch.bfloat16) * 0.02
        fmt = FORMATS[a.quantization] if a.quantization else None
        expert_bytes = 3 * I * D * 2
        if fmt is not None:  # the rows the slots hold, and their values for the reference
            whole2 = P == 1  # (down's rows in one segment where no TP over ranks cuts them: `specs.whole_rows`)
            w13, w2 = fmt.rows_of(w13_bf16, True), fmt.rows_of(w2_bf16, whole2)
            w13_bf16, w2_bf16 = fmt.unpack(w13, D, torch.bfloat16), fmt.unpack(w2, I, torch.bfloat16)
            expert_bytes = 2 * I * fmt.width(D, True) + D * fmt.width(I, whole2)
        for B in a.batches:
            T = B if mode == "tp" else -(-B // P) * P  # EP: every rank's tokens, padded to the agreed capacity
            x = torch.randn(T, D, device=dev, dtype=torch.bfloat16)
            w_TK, ids = torch.randn(T, E_all, device=dev).softmax(-1).topk(K, -1)
            w_TK = w_TK.to(torch.bfloat16)
            local = (ids < E).sum().item()
            hit = int(torch.unique(ids[ids < E]).numel())
            cfg = fm.config_for(T * K, E, E_all // E, fm.table_for(w13, D))
            out = fm.fused_experts(x, w_TK, ids, w13, w2, 0, E_all)
            ref = experts_ref(x.float(), w_TK.float(), ids, w13_bf16.float(), w2_bf16.float(), 0) if T <= 512 else None
            rel = rel_err(out, ref)
            total_us = graph_time_us(lambda: fm.fused_experts(x, w_TK, ids, w13, w2, 0, E_all))  # noqa: B023
            old_us = graph_time_us(lambda: old.fused_experts(x, w_TK, ids, w13, w2, 0)) if old else None  # noqa: B023
            bm = cfg.BM
            blocks = fm.direct(ids, 0, bm) if T * K <= fm.DIRECT_MAX_PAIRS else fm.align(ids, 0, E, bm)
            align_us = graph_time_us(lambda: fm.align(ids, 0, E, bm))  # noqa: B023 - (direct blocks skip it)
            h = fm.gate_up(x, w13, blocks, K, cfg.gate_up)
            wflat = w_TK.reshape(-1).contiguous()
            y = fm.down(h, w2, blocks, wflat, cfg.down)
            sum_us = graph_time_us(lambda: sum_k(y, ids, 0, E))  # noqa: B023
            timed_default = {}
            variants = [("default_timed", cfg.gate_up, cfg.down),
                        ("tma_switched", dataclasses.replace(cfg.gate_up, tma=not cfg.gate_up.tma),
                         dataclasses.replace(cfg.down, tma=not cfg.down.tma))]
            variants += [(f"group_{g}", dataclasses.replace(cfg.gate_up, group=g),
                          dataclasses.replace(cfg.down, group=g)) for g in a.groups]
            for name, gu_c, dn_c in variants:
                timed_default[name] = dict(
                    tma=[gu_c.tma, dn_c.tma],
                    gate_up_us=graph_time_us(lambda c=gu_c: fm.gate_up(x, w13, blocks, K, c)),  # noqa: B023
                    down_us=graph_time_us(lambda c=dn_c: fm.down(h, w2, blocks, wflat, c)))  # noqa: B023
            if hasattr(torch, "_grouped_mm"):  # the library's grouped GEMM on the same pairs, sorted by expert and
                # gathered beforehand (kernels/moe.py): a reference for the fused kernels' GEMMs
                key = torch.where(ids < E, ids, E).flatten()
                order = torch.argsort(key, stable=True)
                offs = torch.cumsum(torch.bincount(key, minlength=E + 1)[:E], 0, dtype=torch.int32)
                xs, hs = x[order // K], torch.randn(T * K, I, device=dev, dtype=torch.bfloat16)
                timed_default["grouped_mm"] = dict(
                    gate_up_us=graph_time_us(lambda: torch._grouped_mm(xs, w13_bf16.transpose(1, 2), offs=offs)),  # noqa: B023
                    down_us=graph_time_us(lambda: torch._grouped_mm(hs, w2_bf16.transpose(1, 2), offs=offs)))  # noqa: B023
            if not blocks.direct:  # rows the GEMMs multiply: used, and padding up to each expert's last block
                used = (blocks.rows.view(-1, bm) < T * K).sum(1)
                timed_default.update(rows_used=int(used.sum()), blocks_used=int((used > 0).sum()))
            ppe = local / max(hit, 1)
            rows = []
            # (128 from 17 pairs an expert: one block an expert reads each weight tile once, `halves` sparing most of
            # its padding's FLOPs)
            bms = ([16] if ppe <= 16 else [16, 32, 64, 128] if ppe <= 64 else [32, 64, 128] if ppe <= 256
                   else [64, 128, 256])
            for bm_try in [] if a.no_search else bms:
                b2 = fm.align(ids, 0, E, bm_try)
                cands = SMALL if bm_try == 16 else LARGE
                h2 = fm.gate_up(x, w13, b2, K, cfg.gate_up if bm_try == bm else cands[0])
                gu_all: list[tuple[fm.TileConfig, float]] = []
                dn_all: list[tuple[fm.TileConfig, float]] = []
                gu = best_of(cands, lambda c: fm.gate_up(x, w13, b2, K, c), gu_all)  # noqa: B023
                dn = best_of(cands, lambda c: fm.down(h2, w2, b2, wflat, c), dn_all)  # noqa: B023
                candidates += [flatten(dict(mode=mode, batch=B, BM=bm_try, launch=name, **c.__dict__, us=t))
                               for name, timed in (("gate_up", gu_all), ("down", dn_all)) for c, t in timed]
                row = dict(BM=bm_try, gate_up=gu[0].__dict__ if gu[0] else None, gate_up_us=gu[1],
                           down=dn[0].__dict__ if dn[0] else None, down_us=dn[1])
                for g in a.groups if gu[0] and dn[0] else ():  # each BM's best with its blocks in groups
                    gu_g, dn_g = dataclasses.replace(gu[0], group=g), dataclasses.replace(dn[0], group=g)
                    row[f"gate_up_group_{g}_us"] = graph_time_us(
                        lambda c=gu_g: fm.gate_up(x, w13, b2, K, c))  # noqa: B023
                    row[f"down_group_{g}_us"] = graph_time_us(
                        lambda c=dn_g: fm.down(h2, w2, b2, wflat, c))  # noqa: B023
                rows.append(row)
                if bm_try >= 32 and gu[0] and dn[0]:  # each BM's best with half blocks (`TileConfig.halves`)
                    gu_h, dn_h = dataclasses.replace(gu[0], halves=True), dataclasses.replace(dn[0], halves=True)
                    rows.append(dict(
                        BM=bm_try, gate_up=gu_h.__dict__, down=dn_h.__dict__,
                        gate_up_us=graph_time_us(lambda c=gu_h: fm.gate_up(x, w13, b2, K, c)),  # noqa: B023
                        down_us=graph_time_us(lambda c=dn_h: fm.down(h2, w2, b2, wflat, c))))  # noqa: B023
            wbytes = hit * expert_bytes
            best = min(rows, key=lambda r: r["gate_up_us"] + r["down_us"]) if rows else timed_default["default_timed"]
            if rows and ref is not None:  # the best shapes' numbers checked as the default's are
                bc = fm.MoEConfig(best["BM"], fm.TileConfig(**best["gate_up"]), fm.TileConfig(**best["down"]))
                best_out = fm.fused_experts(x, w_TK, ids, w13, w2, 0, E_all, config=bc)
                best = dict(best, rel_err=rel_err(best_out, ref))
            r = dict(mode=mode, batch=B, tokens=T, local_pairs=local, experts_hit=hit, rel_err=rel,
                     default=dict(BM=bm, gate_up=cfg.gate_up.__dict__, down=cfg.down.__dict__), total_us=total_us,
                     old_total_us=old_us, align_us=align_us, sum_us=sum_us, **timed_default, weight_bytes=wbytes,
                     floor_us=wbytes / rate * 1e6, best=best,
                     best_gemm_TBps=wbytes / (best["gate_up_us"] + best["down_us"]) / 1e6)
            print(json.dumps(r), flush=True)
            results.append(flatten(r))
            tried += [flatten(dict(mode=mode, batch=B, **t)) for t in rows]
    write_result(a.output, tables={"per_batch": results, "tried": tried, "candidates": candidates},
                 summary={"wall_s": time.time() - t0},
                 params=params_of(a),
                 note="fused MoE kernels per (mode, batch) (table per_batch): µs per call inside a CUDA graph; "
                      "default: the shapes fused_moe.config_for picks; best: the fastest searched (table tried: "
                      "every BM's best gate_up / down; table candidates: every shape timed); grouped_mm: "
                      "torch._grouped_mm's two GEMMs on the same pairs "
                      "(sorted and gathered beforehand); floor_us: the hit experts' weights at the card's "
                      "floor rate (bench/floor.py)")


if __name__ == "__main__":
    main()
