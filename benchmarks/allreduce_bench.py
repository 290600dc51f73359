"""All-reduce of decode-sized activations inside CUDA graphs: NCCL against torch symmetric-memory kernels.

    torchrun --nproc-per-node 2 benchmarks/allreduce_bench.py --output allreduce.json
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
from graph_timing import graph_time_us


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256, 512, 1024, 2048])
    ap.add_argument("--output", default="allreduce.json")
    a = ap.parse_args()
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    group = dist.group.WORLD
    import torch.distributed._symmetric_memory as symm_mem

    n_max = max(a.tokens) * a.hidden
    buf = symm_mem.empty(n_max, dtype=torch.bfloat16, device="cuda")
    handle = symm_mem.rendezvous(buf, group.group_name)
    name = group.group_name
    rows = []
    for T in a.tokens:
        n = T * a.hidden
        x = torch.randn(n, device="cuda", dtype=torch.bfloat16) * (rank + 1)
        want = x.clone()
        dist.all_reduce(want)
        row = dict(tokens=T, bytes=n * 2)
        y = x.clone()
        row["nccl_us"] = graph_time_us(lambda y=y: dist.all_reduce(y), reps=48, barrier=dist.barrier)
        variants = {
            "symm_one_shot_copy_in": lambda x=x, n=n: torch.ops.symm_mem.one_shot_all_reduce(
                buf[:n].copy_(x), "sum", name),
            "symm_one_shot_copy": lambda x=x: torch.ops.symm_mem.one_shot_all_reduce_copy(buf, x, "sum", name),
            "symm_two_shot_copy_in": lambda x=x, n=n: torch.ops.symm_mem.two_shot_all_reduce_(
                buf[:n].copy_(x), "sum", name),
        }
        for key, fn in variants.items():
            try:
                got = fn().clone()
                torch.cuda.synchronize()
                ok = bool(torch.allclose(got.float(), want.float(), atol=1e-2, rtol=1e-2))
                row[key + "_ok"] = ok
                row[key + "_us"] = graph_time_us(fn, reps=48, barrier=dist.barrier)
            except Exception as e:  # noqa: BLE001 - report what this torch build lacks
                row[key + "_error"] = f"{type(e).__name__}: {str(e)[:200]}"
                torch.cuda.synchronize()
        if rank == 0:
            print(json.dumps(row), flush=True)
        rows.append(row)
    if rank == 0:
        json.dump(dict(gpu=torch.cuda.get_device_name(), world=dist.get_world_size(),
                       multicast=bool(handle.multicast_ptr), rows=rows), open(a.output, "w"), indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
