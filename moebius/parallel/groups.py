"""Process groups of the engine and the control-message transport between ranks.

Each rank joins one device group (NCCL on GPU, gloo on CPU) for the model's collectives and one gloo group on the
CPU for control messages. Control messages are JSON bytes in uint8 tensors: nothing that arrives over the wire is
ever unpickled.

Ranks spawned on one machine meet at a `LoopbackRendezvous`: rank 0's TCP store serves on a socket bound to
127.0.0.1 (torch's TCPStore server, given only a port, listens on every interface), and their gloo pairs listen on
the loopback interface too. Under torchrun (env://, possibly across machines) torchrun's settings are kept.
"""

from __future__ import annotations

import array
import base64
import json
import os
import socket
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout


@dataclass
class Groups:
    rank: int
    world_size: int
    device: dist.ProcessGroup | None  # None when world_size == 1
    cpu: dist.ProcessGroup | None


@dataclass
class LoopbackRendezvous:
    """Where ranks spawned on one machine meet: a TCP store that rank 0 serves on a listening socket bound to
    127.0.0.1, made by the launcher (`open`) and handed to rank 0's process (multiprocessing passes the socket), so
    the port is held from the start and nothing listens beyond the loopback."""

    port: int
    listener: socket.socket | None = None  # rank 0's copy: the bound, listening socket its store serves on

    @classmethod
    def open(cls) -> LoopbackRendezvous:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
        return cls(sock.getsockname()[1], sock)

    def for_rank(self, rank: int) -> LoopbackRendezvous:
        """What rank `rank` is handed: rank 0 the socket, the others the port."""
        return self if rank == 0 else LoopbackRendezvous(self.port)

    def close(self) -> None:
        """The launcher's copy of the socket (rank 0 holds its own)."""
        if self.listener is not None:
            self.listener.close()

    def store(self, rank: int, world_size: int) -> dist.TCPStore:
        if rank != 0:
            return dist.TCPStore("127.0.0.1", self.port, world_size, False, default_pg_timeout)
        assert self.listener is not None, "rank 0 needs the rendezvous socket"
        fd = self.listener.detach()  # the store owns the descriptor from here on (and closes it)
        return dist.TCPStore("127.0.0.1", self.port, world_size, True, default_pg_timeout, master_listen_fd=fd)


def _loopback_interface() -> str | None:
    """The loopback interface's name ("lo" on Linux, "lo0" on macOS), if there is one."""
    names = {name for _, name in socket.if_nameindex()} if hasattr(socket, "if_nameindex") else set()
    return next((n for n in ("lo", "lo0") if n in names), None)


def init_groups(rank: int, world_size: int, device: torch.device, rendezvous: LoopbackRendezvous | None) -> Groups:
    """Join the engine's process groups (rendezvous None: env:// as set by torchrun)."""
    if world_size == 1:
        return Groups(0, 1, None, None)
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs: dict[str, Any] = {"device_id": device} if device.type == "cuda" else {}
    if rendezvous is None:
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size, **kwargs)
    else:
        # gloo's pairs listen on the address this machine's hostname resolves to (a LAN address on most hosts)
        # unless told an interface; a user's own setting wins
        if "GLOO_SOCKET_IFNAME" not in os.environ and (lo := _loopback_interface()) is not None:
            os.environ["GLOO_SOCKET_IFNAME"] = lo
        dist.init_process_group(backend, store=rendezvous.store(rank, world_size), rank=rank, world_size=world_size,
                                **kwargs)
    cpu = dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD
    return Groups(rank, world_size, dist.group.WORLD, cpu)


def all_gather_single(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """All-gather into one tensor under torch's current name (2.13 warns that all_gather_into_tensor is deprecated;
    2.11 has only that)."""
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, inp, group=group)


def reduce_scatter_single(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """Reduce-scatter (sum) from one tensor, under torch's current name (as all_gather_single)."""
    (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(out, inp, group=group)


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
    all_gather_single(heads, head, group)
    heads = heads.cpu().view(groups.world_size, -1)
    lengths = [_head_length(h) for h in heads]
    longest = max(lengths)
    if longest <= inline:
        return [_decode(h[8: 8 + n]) for h, n in zip(heads, lengths, strict=True)]
    rest = torch.zeros(longest - inline, dtype=torch.uint8)  # every rank knows every length: all take part
    rest[: max(payload.numel() - inline, 0)] = payload[inline:]
    rest = rest.to(device) if device is not None else rest
    rests = rest.new_empty(groups.world_size * rest.numel())
    all_gather_single(rests, rest, group)
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
