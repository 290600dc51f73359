"""What a dependency between two kernels costs at one token, and what it would cost inside one persistent kernel.

A chain of S dependent one-row projections (x <- W_s x, W_s [H, H] bf16) timed two ways, each in a CUDA graph:
- `launch`: one launch per projection, the engine's `kernels.linear` (weights loaded before the PDL wait), in the
  LATE and EARLY release orders: what a layer pays today per boundary.
- `persistent`: one launch for the whole chain, a program per block of rows (all resident at once), stages ordered
  by a counter per stage (the program's stores, a CTA barrier, then one release add; the next stage spins on an
  acquire read of it): what a persistent decode kernel would pay per grid-wide dependency. `preload`: a program
  loads its next stage's weight rows before it waits (as `kernels.linear` does before the PDL wait); without it,
  after.

Per stage it reports µs, the weight bytes, and µs at the floor's HBM rate: the difference is the boundary's cost.
The persistent chain's output must equal the launched chain's (same products, same sums).

`--layer-chain P` instead times an idealized decode step of one TP-P rank at one or two tokens: per layer only the
dependent stages no design can merge (a norm where TP's all-reduce kernel runs, q|k|v, attention, o, the second
norm, the router with its top-k, gate|up, down), each a `kernels.linear` launch reading exactly the bytes the real
stage must (the KV for attention, the experts the batch hits for gate|up and down, as in the floor), ordered by the
stream and PDL as the engine's kernels are, distinct weights per layer (no L2 reuse), then the lm_head as the engine
runs it. What it takes is what a step built of one launch per dependency would take if every stage streamed like a
plain projection: a bound on what fusing launches or tuning kernels can reach, before the all-reduces. Also timed:
without the norm launches (as if the all-reduce + norm rode inside the kernels around it), and with the expert
stand-ins loading their weights only after their wait, as the real expert kernels must (the router picks them).

    python benchmarks/kernels/boundary_bench.py --output boundary.json
    python benchmarks/kernels/boundary_bench.py --layer-chain 2 --batches 1,2 --output chain.json

Recorded: benchmarks/results/h200-boundary.json (the chain), h200-tp-rank-ideal-chain.json (`--layer-chain 2`).
"""

from __future__ import annotations

import argparse
import functools
import json

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from moebius import kernels
from moebius.bench.floor import Hardware, _experts_hit, decode_step_floor_ms
from moebius.bench.graph_timing import graph_time_us
from moebius.bench.results import params_of, write_result
from moebius.config import PRESETS, ModelConfig
from moebius.kernels.fused import add_rmsnorm
from moebius.kernels.linear import TILE_ELEMS, linear
from moebius.models.registry import model_config

LATE_KERNELS = kernels.DEFAULT_KERNELS.with_release(kernels.LATE)  # the order the engine runs 1-2 tokens a rank in


@triton.jit
def _chain(X, W, Count, S, H, BN: tl.constexpr, BK: tl.constexpr, PRELOAD: tl.constexpr):
    """X [2, H] (stage s reads row s % 2, writes the other); W [S, H, H]; Count [S] zeros."""
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    rn = pid * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    mk = rk < H
    for s in range(S):
        wp = W + s.to(tl.int64) * H * H + rn[:, None].to(tl.int64) * H + rk[None, :]
        if PRELOAD:
            w = tl.load(wp, mask=mk[None, :], other=0.0)
        if s > 0:
            while tl.atomic_add(Count + s - 1, 0, sem="acquire", scope="gpu") < G:
                pass
            tl.debug_barrier()  # every thread's loads after the acquire
        if not PRELOAD:
            w = tl.load(wp, mask=mk[None, :], other=0.0)
        x = tl.load(X + (s % 2) * H + rk, mask=mk, other=0.0, cache_modifier=".cg")  # other SMs wrote it
        acc = tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
        tl.store(X + ((s + 1) % 2) * H + rn, acc.to(X.dtype.element_ty))
        tl.debug_barrier()  # every thread's store before the one release below
        tl.atomic_add(Count + s, 1, sem="release", scope="gpu")


def persistent_rows(H: int, sms: int) -> int:
    """Rows a program: kernels.linear's tile, or more where that would leave programs without an SM (a program
    that is not resident would never arrive and the chain would hang)."""
    return max(TILE_ELEMS // triton.next_power_of_2(H), triton.next_power_of_2(triton.cdiv(H, sms)))


def persistent(x: torch.Tensor, w: torch.Tensor, count: torch.Tensor, buf: torch.Tensor, BN: int, preload: bool
               ) -> torch.Tensor:
    S, H, _ = w.shape
    count.zero_()
    buf[0].copy_(x)
    _chain[(H // BN,)](buf, w, count, S, H, BN=BN, BK=triton.next_power_of_2(H), PRELOAD=preload, num_warps=8)
    return buf[S % 2]


def launched(x: torch.Tensor, w: torch.Tensor, kc: kernels.KernelConfig = LATE_KERNELS) -> torch.Tensor:
    for s in range(w.shape[0]):
        x = linear(x[None], w[s], kc=kc)[0]
    return x


EXPERT_STAGES = ("gate_up", "down")  # their weights are picked by the router: `--layer-chain`'s after-wait variant


def layer_stages(cfg: ModelConfig, P: int, batch: int, context: int) -> list[tuple[str, int, int]]:
    """(name, N, K) of the projections standing for one TP-P rank's dependent stages at `batch` tokens (N x K
    elements read, as the real stage reads; "norm" stages are the engine's add_rmsnorm, N = K = hidden)."""
    D, d, I_ = cfg.hidden_size, cfg.head_dim, cfg.moe_intermediate_size // P
    qh, kvh = cfg.num_heads // P, max(1, cfg.num_kv_heads // P)
    hit = _experts_hit(cfg, batch, cfg.num_experts)  # expected distinct experts, as the floor counts them
    kv_elems = batch * context * kvh * d * 2
    return [("norm", D, D), ("qkv", (qh + 2 * kvh) * d, D), ("attention", qh * d, kv_elems // (qh * d)),
            ("o", D, qh * d), ("norm", D, D), ("router", cfg.num_experts, D),
            ("gate_up", round(hit * 2 * I_), D), ("down", D, round(hit * I_))]


def layer_chain(args: argparse.Namespace, dev: torch.device) -> None:
    cfg = model_config(PRESETS[args.preset])
    P, L = args.layer_chain, cfg.num_layers
    vocab = cfg.vocab_size // P
    hbm = Hardware().hbm_bytes_per_s
    g = torch.Generator(device=dev).manual_seed(0)
    lm_head = (torch.randn(vocab, cfg.hidden_size, device=dev, generator=g) * 0.02).to(torch.bfloat16)
    norm_w = torch.ones(cfg.hidden_size, dtype=torch.bfloat16, device=dev)
    rows, stage_rows = [], []
    for B in (int(b) for b in args.batches.split(",")):
        if not 1 <= B <= kernels.PREFETCH_ROWS:
            raise SystemExit(f"--batches: {B} tokens is not a one-launch projection (1..{kernels.PREFETCH_ROWS})")
        stages = layer_stages(cfg, P, B, args.context)
        # one input buffer as wide as any stage reads; the stream (and PDL's wait) orders the stages as the
        # engine's are ordered, whatever buffer each reads
        x = torch.randn(B, max(k for _, _, k in stages), device=dev, generator=g).to(torch.bfloat16) * 0.1
        h = torch.randn(B, cfg.hidden_size, device=dev, generator=g).to(torch.bfloat16)
        res = torch.zeros_like(h)
        weights = [[None if name == "norm" else
                    (torch.randn(n, k, device=dev, generator=g) * 0.02).to(torch.bfloat16)
                    for name, n, k in stages] for _ in range(L)]

        def step(skip_norms: bool = False, experts_wait: bool = False, layers: list = weights,
                 stages: list = stages, x: torch.Tensor = x, h: torch.Tensor = h, res: torch.Tensor = res) -> None:
            for layer in layers:
                for (name, _, k), w in zip(stages, layer, strict=True):
                    if name != "norm":
                        linear(x[:, :k], w, wait_first=experts_wait and name in EXPERT_STAGES, kc=LATE_KERNELS)
                    elif not skip_norms:
                        add_rmsnorm(h, res, norm_w, 1e-6, kc=LATE_KERNELS)
            F.linear(x[:, :cfg.hidden_size], lm_head).argmax(-1)

        # in the LATE order, as the engine runs one or two tokens a rank
        ms, no_norms, ms_w, no_norms_w = (graph_time_us(functools.partial(step, skip, late), reps=1) / 1e3
                                          for late in (False, True) for skip in (False, True))
        lm_ms = graph_time_us(lambda x=x: F.linear(x[:, :cfg.hidden_size], lm_head).argmax(-1), reps=1) / 1e3
        layer_bytes = sum(n * k * 2 for name, n, k in stages if name != "norm")
        floor = decode_step_floor_ms(cfg, P, "tp", B, args.context)
        stage_rows += [{"batch": B, "index": i, "stage": name, "N": n, "K": k, "bytes": n * k * 2}
                       for i, (name, n, k) in enumerate(stages)]
        row = {"batch": B, "tp": P, "context_len": args.context, "layers": L,
               "launches_per_layer": len(stages), "layer_weight_bytes": layer_bytes,
               "layer_us_at_hbm_rate": layer_bytes / hbm * 1e6,
               "chain_step_ms": ms, "chain_layer_us": (ms - lm_ms) / L * 1e3,
               "chain_without_norms_step_ms": no_norms, "chain_experts_after_wait_step_ms": ms_w,
               "chain_experts_after_wait_without_norms_step_ms": no_norms_w, "lm_head_ms": lm_ms,
               "tp_floor_ms": floor, "chain_ratio_to_floor": ms / floor}
        print(json.dumps(row), flush=True)
        rows.append(row)
        del weights, step  # step holds the weights too
        torch.cuda.empty_cache()
    write_result(args.output, tables={"chain": rows, "stage": stage_rows}, params=params_of(args),
                 note=f"idealized decode step of one TP-{P} rank (table chain): one kernels.linear launch per "
                      "dependent stage (table stage: each stage's N x K elements read), against the TP floor")


def main() -> None:
    ap = argparse.ArgumentParser(prog="python benchmarks/kernels/boundary_bench.py")
    ap.add_argument("--hidden", default="1024,2048")
    ap.add_argument("--stages", type=int, default=64)
    ap.add_argument("--layer-chain", type=int, default=0, metavar="P",
                    help="time the idealized decode step of one TP-P rank instead (module docstring)")
    ap.add_argument("--preset", default="qwen3-30b-a3b", choices=sorted(PRESETS))
    ap.add_argument("--batches", default="1,2")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--output", required=True)
    args = ap.parse_args()
    dev = torch.device("cuda")
    if args.layer_chain:
        layer_chain(args, dev)
        return
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    hbm = Hardware().hbm_bytes_per_s
    rows = []
    for H in (int(h) for h in args.hidden.split(",")):
        BN = persistent_rows(H, sms)
        if H % BN:
            print(f"H={H}: not a multiple of {BN} rows, skipped")
            continue
        g = torch.Generator(device=dev).manual_seed(0)
        w = (torch.randn(args.stages, H, H, device=dev, generator=g) / H ** 0.5).to(torch.bfloat16)
        x = torch.randn(H, device=dev, generator=g).to(torch.bfloat16)
        count = torch.zeros(args.stages, dtype=torch.int32, device=dev)
        buf = torch.zeros(2, H, dtype=torch.bfloat16, device=dev)
        ref = launched(x, w).clone()
        bytes_stage = H * H * 2
        row = {"hidden": H, "stages": args.stages, "programs": H // BN, "weight_bytes_per_stage": bytes_stage,
               "floor_us_per_stage": bytes_stage / hbm * 1e6}
        for name, order in (("launch_late", kernels.LATE), ("launch_early", kernels.EARLY)):
            kc = kernels.DEFAULT_KERNELS.with_release(order)
            us = graph_time_us(lambda x=x, w=w, kc=kc: launched(x, w, kc), reps=1)
            row[f"{name}_us_per_stage"] = us / args.stages
        for preload in (True, False):
            name = "persistent_preload" if preload else "persistent_after_wait"
            out = persistent(x, w, count, buf, BN, preload)
            torch.cuda.synchronize()
            # the same products and row sums; another row tile may sum in another order
            row[f"{name}_max_diff_to_launch"] = (out.float() - ref.float()).abs().max().item()
            row[f"{name}_us_per_stage"] = graph_time_us(
                lambda p=preload, x=x, w=w, count=count, buf=buf, BN=BN: persistent(x, w, count, buf, BN, p),
                reps=1) / args.stages
        print(json.dumps(row))
        rows.append(row)
    write_result(args.output, rows, params=params_of(args),
                 note="a chain of dependent one-row projections: one launch per stage (LATE / EARLY release order) "
                      "against one persistent kernel ordering its stages by counters (weights before / after the "
                      "wait); per stage: us, weight bytes, us at the floor's HBM rate")


if __name__ == "__main__":
    main()
