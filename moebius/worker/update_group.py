"""Weight updates from a trainer's process group (SGLang's `init_weights_update_group` /
`update_weights_from_distributed` protocol): the trainer is rank 0 of a process group of its own, the engine's rank r
is rank `rank_offset + r`; the trainer broadcasts each tensor in the order the metadata names them, every engine rank
receives it into a temporary, and the usual all-or-nothing write follows (`worker/weight_update.py`).

The group: the engine's ranks already belong to their own default group, and `dist.new_group` only carves groups out
of that one, so this group is built beside it, on a store of its own (the trainer's TCP store on
master_address:master_port, `dist.rendezvous`), with `distributed_c10d._new_process_group_helper` and the group name
as the store prefix: the same call and keys as SGLang's `init_custom_process_group`, which trainers written for it
(slime, verl, AReaL) run on their side, so they join unchanged. It is private torch API, present with this signature
in torch 2.6 to 2.13; the public alternative (a `ProcessGroupGloo` / `ProcessGroupNCCL` built on the store) would
not share those trainers' store keys.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from moebius.config import ModelConfig
from moebius.link.messages import BroadcastTensors, UpdateGroupOrder
from moebius.models.loader import check_update

BACKENDS = ("gloo", "nccl")
LOAD_FORMATS = (None, "auto", "direct", "flattened_bucket")  # SGLang's names; all but the last: a broadcast a tensor
# how long a rank waits for the trainer to join, or for one broadcast: a trainer that died frees the engine then
TIMEOUT = timedelta(minutes=10)


def parse_dtype(name: str) -> torch.dtype:
    """A dtype as trainers write it, "bfloat16" or "torch.bfloat16"; ValueError naming it otherwise."""
    dtype = getattr(torch, name.removeprefix("torch."), None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype {name!r} is not a torch dtype (write e.g. 'bfloat16' or 'torch.bfloat16')")
    return dtype


def check_broadcast(cfg: ModelConfig, group_name: str, names: Sequence[str], dtypes: Sequence[str],
                    shapes: Sequence[Sequence[int]], load_format: str | None = None) -> BroadcastTensors:
    """The metadata of a broadcast update checked as `check_update` checks tensors (every name, shape and dtype,
    nothing twice), before the trainer sends a byte; ValueError naming the first bad entry. load_format: None
    (one broadcast a tensor) or "flattened_bucket" (one broadcast of their bytes back to back, SGLang's)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {list(LOAD_FORMATS)}, got {load_format!r}")
    if not (len(names) == len(dtypes) == len(shapes)):
        raise ValueError(f"names, dtypes and shapes must have one entry per tensor: got {len(names)} names, "
                         f"{len(dtypes)} dtypes, {len(shapes)} shapes")
    if not names:
        raise ValueError("an update from a process group names at least one tensor")
    parsed = [parse_dtype(d) for d in dtypes]
    fake = []
    for name, dtype, shape in zip(names, parsed, shapes, strict=True):
        if not (isinstance(shape, list | tuple) and all(isinstance(d, int) and d >= 0 for d in shape)):
            raise ValueError(f"tensor {name!r}: shape must be a list of non-negative ints, got {shape!r}")
        # a zero-byte stand-in of that shape and dtype: check_update's own checks without the memory
        fake.append((name, torch.empty((), dtype=dtype).expand(*shape)))
    check_update(cfg, fake)
    return BroadcastTensors(group_name, list(names), [str(d).removeprefix("torch.") for d in parsed],
                            [list(s) for s in shapes], load_format == "flattened_bucket")


def check_group_order(order: UpdateGroupOrder, engine_ranks: int, on_gpu: bool) -> None:
    """ValueError naming the bad field of an `init_weights_update_group` call (rank 0 is the trainer's)."""
    if not order.group_name:
        raise ValueError("group_name must not be empty")
    if order.backend not in BACKENDS:
        raise ValueError(f"backend must be one of {list(BACKENDS)}, got {order.backend!r}")
    if order.backend == "nccl" and not on_gpu:
        raise ValueError("backend 'nccl' needs the engine's ranks on GPUs; on the CPU use 'gloo'")
    if not order.master_address:
        raise ValueError("master_address must not be empty")
    if not 0 < order.master_port < 65536:
        raise ValueError(f"master_port must be in 1..65535, got {order.master_port}")
    if order.rank_offset < 1:
        raise ValueError(f"rank_offset must be >= 1 (rank 0 is the trainer), got {order.rank_offset}")
    if order.world_size < order.rank_offset + engine_ranks:
        raise ValueError(f"world_size {order.world_size} cannot hold the engine's {engine_ranks} rank(s) from "
                         f"rank_offset {order.rank_offset} (needs >= {order.rank_offset + engine_ranks})")


def join(order: UpdateGroupOrder, engine_rank: int) -> dist.ProcessGroup:
    """This rank's membership of the trainer's group (blocks until every member joined, or TIMEOUT)."""
    rank = order.rank_offset + engine_rank
    store, _, _ = next(dist.rendezvous(f"tcp://{order.master_address}:{order.master_port}", rank, order.world_size,
                                       timeout=TIMEOUT))
    store.set_timeout(TIMEOUT)
    made = c10d._new_process_group_helper(order.world_size, rank, [], order.backend, store,
                                          group_name=order.group_name, timeout=TIMEOUT)
    pg = made[0] if isinstance(made, tuple) else made  # (pg, prefix store) since torch 2.3
    # group ranks are the trainer's numbering: broadcast(src=0, group=pg) means the trainer
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(order.world_size)}
    return pg


def receive(pg: dist.ProcessGroup, meta: BroadcastTensors, device: torch.device) -> list[tuple[str, torch.Tensor]]:
    """Every tensor the trainer broadcasts, in the metadata's order, each into a temporary on this rank's device."""
    if meta.bucket:
        return _receive_bucket(pg, meta, device)
    out = []
    for name, dtype, shape in zip(meta.names, meta.dtypes, meta.shapes, strict=True):
        t = torch.empty(shape, dtype=parse_dtype(dtype), device=device)
        dist.broadcast(t, src=0, group=pg)
        out.append((name, t))
    return out


def _receive_bucket(pg: dist.ProcessGroup, meta: BroadcastTensors, device: torch.device
                    ) -> list[tuple[str, torch.Tensor]]:
    """SGLang's flattened bucket: every tensor's bytes in the metadata's order, in one uint8 broadcast."""
    dtypes = [parse_dtype(d) for d in meta.dtypes]
    sizes = [math.prod(s) * d.itemsize for s, d in zip(meta.shapes, dtypes, strict=True)]
    flat = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
    dist.broadcast(flat, src=0, group=pg)
    out, start = [], 0
    for name, dtype, shape, size in zip(meta.names, dtypes, meta.shapes, sizes, strict=True):
        part = flat[start:start + size]
        if start % dtype.itemsize:  # (a view as a wider dtype needs an aligned start: mixed dtypes may not give one)
            part = part.clone()
        out.append((name, part.view(dtype).view(shape)))
        start += size
    return out


def leave(pg: dist.ProcessGroup) -> None:
    dist.destroy_process_group(pg)
