"""The communication at the end of a sublayer, inside CUDA graphs, at decode sizes.

TP: all-reduce + residual add + RMSNorm. Variants: NCCL all-reduce then the add_rmsnorm kernel; torch
symmetric-memory one-/two-shot all-reduce then add_rmsnorm; the one-launch fused kernel (`kernels.symmetric`),
one-shot and two-shot, over grid caps, rows per iteration and warps.
EP: dispatch (all-gather of token rows, weights, ids) + combine (reduce-scatter) + add + RMSNorm, per token
capacity: `EPComm` through NCCL against `EPComm` through `kernels.symmetric.EPExchange`.

    torchrun --nproc-per-node 2 benchmarks/comm/comm_bench.py --output comm.json

Recorded: benchmarks/results/h200x2-comm.json (rows of table "tp": TP; of table "ep": EP).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist

from moebius.bench.graph_timing import graph_time_us
from moebius.bench.results import command_line, params_of, write_result
from moebius.kernels.fused import add_rmsnorm
from moebius.kernels.symmetric import EPExchange, FusedAllReduceNorm
from moebius.parallel.dispatch import EPComm, SymmetricAllReduce


def main() -> None:
    ap = argparse.ArgumentParser(prog="torchrun --nproc-per-node N benchmarks/comm/comm_bench.py")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256, 512, 1024, 2048])
    ap.add_argument("--ep-capacity", type=int, nargs="+", default=[1, 8, 64, 256, 1024, 2048])
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--output", default="comm.json")
    a = ap.parse_args()
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dev = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl", device_id=dev)
    group = dist.group.WORLD
    n_max = max(a.tokens) * a.hidden
    symm = SymmetricAllReduce(group, n_max, torch.bfloat16, dev)
    fused = FusedAllReduceNorm(group, n_max, torch.bfloat16, dev)  # every size, to find where fusing stops paying
    D, eps = a.hidden, 1e-6
    weight = torch.ones(D, device=dev, dtype=torch.bfloat16)
    rows = []
    for T in a.tokens:
        x = torch.randn(T, D, device=dev, dtype=torch.bfloat16) * (rank + 1)
        res = torch.zeros(T, D, device=dev, dtype=torch.bfloat16)
        row = dict(tokens=T, bytes=T * D * 2)
        want = x.clone()
        dist.all_reduce(want)
        y = x.clone()

        def nccl(y: torch.Tensor = y, res: torch.Tensor = res) -> torch.Tensor:
            dist.all_reduce(y)  # in place, as the engine's NCCL path (values grow; the time does not care)
            return add_rmsnorm(y, res, weight, eps)

        variants = {
            "nccl_add_norm": (nccl, None),
            "symm_add_norm": (lambda x=x, res=res: add_rmsnorm(torch_symmetric(symm, x), res, weight, eps), None),
            **{f"fused_{shot}_shot_g{g}_r{r}_w{w}": (
                lambda x=x, res=res, two=shot == "two": fused(x, res, weight, eps, two_shot=two), (g, r, w))
               for shot in ("one", "two") for g, r, w in [(128, 1, 4), (128, 4, 4), (128, 4, 8), (256, 4, 8)]},
        }
        for key, (fn, setting) in variants.items():
            if setting is not None:
                fused.programs, fused.max_rows, fused.num_warps = setting
                r1 = torch.zeros_like(res)  # the timed calls add into `res`; check on a fresh residual
                fn(res=r1)
                row[key + "_equals_nccl"] = bool(torch.equal(r1, want))  # the new residual: the sum, rounded once
            row[key + "_us"] = graph_time_us(fn, reps=48, barrier=dist.barrier)
        if rank == 0:
            print(json.dumps(row), flush=True)
        rows.append(row)
    ep_rows = ep_exchange(a, group, dev, weight, eps)
    if rank == 0:
        world = dist.get_world_size()
        write_result(a.output, tables={"tp": rows, "ep": ep_rows}, params=params_of(a, world=world), num_gpus=world,
                     command=command_line(prefix=f"torchrun --nproc-per-node {world}"),
                     note="TP (table tp): all-reduce + residual add + RMSNorm; EP (table ep): dispatch + "
                          "combine + add + RMSNorm; per call inside a CUDA graph")
    dist.barrier()
    dist.destroy_process_group()


def torch_symmetric(symm: SymmetricAllReduce, x: torch.Tensor) -> torch.Tensor:
    """torch's own symmetric-memory all-reduce in its buffer: one-shot up to 512 KiB, two-shot above."""
    if x.numel() * x.element_size() > 512 * 1024:
        return symm(x)  # the engine's path above the fused size: two-shot
    buf = symm.buf[: x.numel()]
    buf.copy_(x.view(-1))
    return torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", symm.name).view_as(x)


def ep_exchange(a: argparse.Namespace, group: dist.ProcessGroup, dev: torch.device, weight: torch.Tensor,
                eps: float) -> list[dict]:
    """EP's dispatch + combine + add + norm per capacity (every rank holding `capacity` tokens), NCCL vs symmetric."""
    P, D, K = dist.get_world_size(group), a.hidden, a.top_k
    nccl, symm = EPComm(group, P, 1), EPComm(group, P, 1)
    symm.symmetric = EPExchange(group, max(a.ep_capacity), D, K, torch.bfloat16, dev)
    out = []
    for C in a.ep_capacity:
        x = torch.randn(C, D, device=dev, dtype=torch.bfloat16)
        w = torch.rand(C, K, device=dev, dtype=torch.bfloat16)
        ids = torch.randint(0, 128, (C, K), device=dev)
        y = torch.randn(P * C, D, device=dev, dtype=torch.bfloat16)
        res = torch.zeros(C, D, device=dev, dtype=torch.bfloat16)
        row: dict = dict(capacity=C)
        got = {}
        for name, comm in (("nccl", nccl), ("symmetric", symm)):
            comm.capacity = C

            def step(comm: EPComm = comm, res: torch.Tensor = res, x: torch.Tensor = x, w: torch.Tensor = w,
                     ids: torch.Tensor = ids, y: torch.Tensor = y) -> torch.Tensor:
                gx, gw, gi, handle = comm.dispatch(x, w, ids)
                return comm.combine_add_norm(y, handle, res, weight, eps)[0]

            r1 = torch.zeros_like(res)
            gx, gw, gi, handle = comm.dispatch(x, w, ids)
            got[name] = (gx.clone(), gw.clone(), gi.clone(), comm.combine_add_norm(y, handle, r1, weight, eps)[1])
            row[name + "_us"] = graph_time_us(step, reps=48, barrier=dist.barrier)
        row["symmetric_equals_nccl"] = all(torch.equal(p, q) for p, q in zip(got["nccl"], got["symmetric"],
                                                                              strict=True))
        if dist.get_rank() == 0:
            print(json.dumps(row), flush=True)
        out.append(row)
    return out


if __name__ == "__main__":
    main()
