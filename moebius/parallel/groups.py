"""Process groups of the engine and the control-message transport between ranks.

Each rank joins one device group (NCCL on GPU, gloo on CPU) for the model's collectives and one gloo group on the
CPU for control messages. Control messages are JSON bytes in uint8 tensors: nothing that arrives over the wire is
ever unpickled.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist


@dataclass
class Groups:
    rank: int
    world_size: int
    device: dist.ProcessGroup | None  # None when world_size == 1
    cpu: dist.ProcessGroup | None


def init_groups(rank: int, world_size: int, device: torch.device, init_method: str | None) -> Groups:
    """Join the engine's process groups (init_method None: env:// as set by torchrun)."""
    if world_size == 1:
        return Groups(0, 1, None, None)
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs: dict[str, Any] = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, init_method=init_method or "env://", rank=rank, world_size=world_size,
                            **kwargs)
    cpu = dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD
    return Groups(rank, world_size, dist.group.WORLD, cpu)


def _encode(obj: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(obj, separators=(",", ":")).encode()), dtype=torch.uint8)


def _decode(t: torch.Tensor) -> Any:
    return json.loads(t.numpy().tobytes().decode())


def broadcast_json(obj: Any, groups: Groups, src: int = 0) -> Any:
    """Rank `src` sends `obj` (JSON-able); every rank returns it."""
    if groups.world_size == 1:
        return obj
    size = torch.zeros(1, dtype=torch.int64)
    payload = _encode(obj) if groups.rank == src else None
    if payload is not None:
        size[0] = payload.numel()
    dist.broadcast(size, src, group=groups.cpu)
    buf = payload if payload is not None else torch.empty(int(size[0]), dtype=torch.uint8)
    dist.broadcast(buf, src, group=groups.cpu)
    return obj if groups.rank == src else _decode(buf)


def _padded_payload(obj: Any, groups: Groups) -> tuple[torch.Tensor, list[int]]:
    """`obj` encoded and padded to the longest payload of all ranks, and every rank's payload length."""
    payload = _encode(obj)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(groups.world_size)]
    dist.all_gather(sizes, torch.tensor([payload.numel()], dtype=torch.int64), group=groups.cpu)
    lengths = [int(n[0]) for n in sizes]
    padded = torch.zeros(max(lengths), dtype=torch.uint8)
    padded[: payload.numel()] = payload
    return padded, lengths


def gather_json(obj: Any, groups: Groups, dst: int = 0) -> list[Any] | None:
    """Every rank sends `obj`; rank `dst` returns the list of all of them in rank order, others None."""
    if groups.world_size == 1:
        return [obj]
    padded, lengths = _padded_payload(obj, groups)
    bufs = [torch.empty_like(padded) for _ in lengths] if groups.rank == dst else None
    dist.gather(padded, bufs, dst=dst, group=groups.cpu)
    return None if bufs is None else [_decode(b[:n]) for b, n in zip(bufs, lengths, strict=True)]


def all_gather_json(obj: Any, groups: Groups) -> list[Any]:
    """Every rank sends `obj`; every rank returns the list of all of them in rank order."""
    if groups.world_size == 1:
        return [obj]
    padded, lengths = _padded_payload(obj, groups)
    bufs = [torch.empty_like(padded) for _ in lengths]
    dist.all_gather(bufs, padded, group=groups.cpu)
    return [_decode(b[:n]) for b, n in zip(bufs, lengths, strict=True)]


def all_gather_ints(values: list[int], groups: Groups) -> list[list[int]]:
    """Small integer vectors from every rank (same length everywhere), on the CPU group."""
    if groups.world_size == 1:
        return [values]
    t = torch.tensor(values, dtype=torch.int64)
    out = [torch.empty_like(t) for _ in range(groups.world_size)]
    dist.all_gather(out, t, group=groups.cpu)
    return [o.tolist() for o in out]


def tensor_to_json(t: torch.Tensor | None) -> dict[str, Any] | None:
    """A float tensor as JSON (float32 bytes, base64), for control messages that carry small tensors."""
    if t is None:
        return None
    a = t.float().contiguous().numpy()
    return dict(shape=list(a.shape), data=base64.b64encode(a.tobytes()).decode())


def tensor_from_json(d: dict[str, Any] | None) -> torch.Tensor | None:
    if d is None:
        return None
    a = np.frombuffer(base64.b64decode(d["data"]), dtype=np.float32).reshape(d["shape"])
    return torch.from_numpy(a.copy())
