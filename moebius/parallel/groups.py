"""Process groups of the engine and the control-message transport between ranks.

Each rank joins one device group (NCCL on GPU, gloo on CPU) for the model's collectives and one gloo group on the
CPU for control messages. Control messages are JSON bytes in uint8 tensors: nothing that arrives over the wire is
ever unpickled.
"""

from __future__ import annotations

import array
import base64
import json
import struct
import sys
from collections.abc import Sequence
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


# Bytes of a control message carried inline by its first collective (with its length): the step loop's messages
# (plans, reports) fit, so each costs one gloo round instead of two; longer ones send the rest after.
_INLINE = 16384


def _head(payload: torch.Tensor, inline: int = _INLINE) -> torch.Tensor:
    """[8-byte length | the first `inline` bytes of the payload, zero-padded]."""
    head = torch.zeros(8 + inline, dtype=torch.uint8)
    head[:8] = torch.tensor([payload.numel()], dtype=torch.int64).view(torch.uint8)
    head[8: 8 + min(payload.numel(), inline)] = payload[:inline]
    return head


def _head_length(head: torch.Tensor) -> int:
    return int(head[:8].view(torch.int64)[0])


def broadcast_json(obj: Any, groups: Groups, src: int = 0) -> Any:
    """Rank `src` sends `obj` (JSON-able); every rank returns it."""
    if groups.world_size == 1:
        return obj
    payload = _encode(obj) if groups.rank == src else None
    head = _head(payload) if payload is not None else torch.empty(8 + _INLINE, dtype=torch.uint8)
    dist.broadcast(head, src, group=groups.cpu)
    n = _head_length(head)
    if n > _INLINE:  # the rest, in a second round
        rest = payload[_INLINE:].clone() if payload is not None else torch.empty(n - _INLINE, dtype=torch.uint8)
        dist.broadcast(rest, src, group=groups.cpu)
        body = torch.cat([head[8:], rest])
    else:
        body = head[8: 8 + n]
    return obj if groups.rank == src else _decode(body)


def gather_json(obj: Any, groups: Groups, dst: int = 0) -> list[Any] | None:
    """Every rank sends `obj`; rank `dst` returns the list of all of them in rank order, others None."""
    if groups.world_size == 1:
        return [obj]
    payload = _encode(obj)
    head = _head(payload)
    heads = [torch.empty_like(head) for _ in range(groups.world_size)] if groups.rank == dst else None
    dist.gather(head, heads, dst=dst, group=groups.cpu)
    if groups.rank != dst:
        if payload.numel() > _INLINE:  # dst learns that from the length and receives the rest from this rank
            dist.send(payload[_INLINE:].clone(), dst, group=groups.cpu)
        return None
    assert heads is not None
    out = []
    for r, h in enumerate(heads):
        n = _head_length(h)
        if n <= _INLINE:
            body = h[8: 8 + n]
        elif r == dst:
            body = payload
        else:
            rest = torch.empty(n - _INLINE, dtype=torch.uint8)
            dist.recv(rest, r, group=groups.cpu)
            body = torch.cat([h[8:], rest])
        out.append(_decode(body))
    return out


def all_gather_json(obj: Any, groups: Groups, device: torch.device | None = None, inline: int = _INLINE
                    ) -> list[Any]:
    """Every rank sends `obj`; every rank returns the list of all of them in rank order (one round when every
    payload fits inline, else a second for the rest). `device`: through the device group (a CUDA device: NCCL;
    for the switch, which has the device to itself anyway: a little quicker than gloo for its EP -> TP request list)
    instead of the CPU group. inline: bytes carried by the first round (every rank sends that many): a caller whose
    messages are long and rare saves the second round."""
    if groups.world_size == 1:
        return [obj]
    if device is not None and device.type != "cuda":
        device = None  # on the CPU the device group is gloo too: one path
    group = groups.cpu if device is None else groups.device
    payload = _encode(obj)
    head = _head(payload, inline)
    head = head.to(device) if device is not None else head
    heads = head.new_empty(groups.world_size * head.numel())
    dist.all_gather_into_tensor(heads, head, group=group)
    heads = heads.cpu().view(groups.world_size, -1)
    lengths = [_head_length(h) for h in heads]
    longest = max(lengths)
    if longest <= inline:
        return [_decode(h[8: 8 + n]) for h, n in zip(heads, lengths, strict=True)]
    rest = torch.zeros(longest - inline, dtype=torch.uint8)  # every rank knows every length: all take part
    rest[: max(payload.numel() - inline, 0)] = payload[inline:]
    rest = rest.to(device) if device is not None else rest
    rests = rest.new_empty(groups.world_size * rest.numel())
    dist.all_gather_into_tensor(rests, rest, group=group)
    rests = rests.cpu().view(groups.world_size, -1)
    return [_decode(torch.cat([h[8:], r])[:n]) for h, r, n in zip(heads, rests, lengths, strict=True)]


def all_gather_ints(values: list[int], groups: Groups) -> list[list[int]]:
    """Small integer vectors from every rank (same length everywhere), on the CPU group."""
    if groups.world_size == 1:
        return [values]
    t = torch.tensor(values, dtype=torch.int64)
    out = [torch.empty_like(t) for _ in range(groups.world_size)]
    dist.all_gather(out, t, group=groups.cpu)
    return [o.tolist() for o in out]


def ids_to_json(*seqs: Sequence[int]) -> str:
    """Token ids (of one or more sequences, concatenated) as base64 of little-endian int32: quicker both ways than a
    JSON list of numbers; struct packs a list quicker than array or numpy convert it."""
    return base64.b64encode(b"".join(struct.pack(f"<{len(s)}i", *s) for s in seqs)).decode()


def ids_from_json(s: str) -> list[int]:
    a = array.array("i")
    a.frombytes(base64.b64decode(s))
    if sys.byteorder != "little":
        a.byteswap()
    return a.tolist()


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
