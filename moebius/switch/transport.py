"""How switch bytes travel between ranks. Both transports move the same bytes to the same places; only the route
differs.

- `CollectiveTransport`: torch.distributed all-to-all (gloo or NCCL; one machine or several). The reference.
- `PeerTransport` (`--switch-transport peer`): the expert staging of every rank is memory every rank addresses
  (`PeerBuffers`: symmetric memory mapped over NVLink on GPUs; shared-memory files on the CPU, where the tests run
  it). An exchange out of the staging (EP -> TP: each rank has packed there the shards it owes every peer) is each
  rank copying its rows out of every peer's staging; one into the staging (TP -> EP) is each rank copying its rows
  into every peer's. On the GPU these are copy-engine copies over NVLink, so the SMs stay free for the permutes of
  the layers around them. Each exchange sits between two barriers of all ranks: before it, every rank's staging is
  ready (packed, or done with by the unpack before); after it, every copy has landed and no staging is written
  again until every rank has read it. Exchanges of other tensors (the KV rows) go through the collective transport.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import Sequence
from typing import Protocol

import torch
import torch.distributed as dist

from moebius.parallel.groups import Groups, broadcast_json

Exchange = tuple[torch.Tensor, torch.Tensor, list[int], list[int]]  # out, inp, out_splits, in_splits


class Transport(Protocol):
    name: str
    peer_exchanges: int  # exchanges carried by peer copies so far (a diagnostic for tests and benchmarks)

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int]
                   ) -> None:
        """Rows in_splits[q] of `inp` (in peer order) go to peer q; rows from peer s land in `out` in peer order."""
        ...

    def all_to_all_many(self, exchanges: Sequence[Exchange]) -> None:
        """Several all_to_all calls, which a transport may carry out together."""
        ...

    def staging(self) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """Expert staging (w13-, w2-shaped pairs) the transport owns, or None: the switch allocates its own."""
        ...


class CollectiveTransport:
    name = "collective"
    peer_exchanges = 0

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int]
                   ) -> None:
        if self.group is None:  # one rank: the only peer is itself
            out.copy_(inp)
            return
        dist.all_to_all_single(out, inp.contiguous(), out_splits, in_splits, group=self.group)

    def all_to_all_many(self, exchanges: Sequence[Exchange]) -> None:
        for e in exchanges:
            self.all_to_all(*e)

    def staging(self) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        return None


class PeerBuffers(Protocol):
    """Tensors of the same shapes on every rank, each rank's addressable by every rank."""

    def local(self) -> list[torch.Tensor]: ...

    def peer(self, i: int, q: int) -> torch.Tensor:
        """Rank q's i-th buffer, as a tensor this rank reads and writes."""
        ...

    def barrier(self) -> None:
        """All ranks: every copy any rank queued before it has landed, for every rank, after it (on the GPU: in
        stream order)."""
        ...


def _flat(shapes: Sequence[torch.Size], dtype: torch.dtype) -> tuple[int, list[int]]:
    """Elements of one flat allocation holding the buffers back to back (each 128-byte aligned), and their offsets."""
    align = max(1, 128 // dtype.itemsize)
    offsets, n = [], 0
    for s in shapes:
        offsets.append(n)
        n += -(-s.numel() // align) * align
    return n, offsets


def _views(flat: torch.Tensor, shapes: Sequence[torch.Size], offsets: list[int]) -> list[torch.Tensor]:
    return [flat[o: o + s.numel()].view(s) for s, o in zip(shapes, offsets, strict=True)]


class SharedFileBuffers:
    """CPU ranks: one shared-memory file a rank, mapped by every rank (the files are unlinked once all are mapped;
    the mappings stay). Collective: every rank constructs it at the same point."""

    def __init__(self, shapes: Sequence[torch.Size], dtype: torch.dtype, groups: Groups) -> None:
        self.groups = groups
        numel, offsets = _flat(shapes, dtype)
        folder = token = None
        if groups.rank == 0:  # one folder for all: shared memory where it has room for every rank's file (a full
            # /dev/shm faults on first write), else the temporary folder
            shm, need = "/dev/shm", 2 * groups.world_size * numel * dtype.itemsize
            roomy = os.path.isdir(shm) and os.statvfs(shm).f_bavail * os.statvfs(shm).f_frsize > need
            folder, token = shm if roomy else tempfile.gettempdir(), uuid.uuid4().hex
        folder, token = broadcast_json([folder, token], groups)
        path = [os.path.join(folder, f"moebius-switch-{token}-{q}") for q in range(groups.world_size)]
        with open(path[groups.rank], "wb") as f:
            f.truncate(numel * dtype.itemsize)
        self.barrier()  # every file exists
        self.bufs = [_views(torch.from_file(p, shared=True, size=numel, dtype=dtype), shapes, offsets) for p in path]
        self.barrier()  # every rank mapped every file
        os.unlink(path[groups.rank])

    def local(self) -> list[torch.Tensor]:
        return self.bufs[self.groups.rank]

    def peer(self, i: int, q: int) -> torch.Tensor:
        return self.bufs[q][i]

    def barrier(self) -> None:
        dist.barrier(group=self.groups.cpu)


class SymmetricPeerBuffers:
    """GPU ranks on one machine: one symmetric-memory allocation a rank (torch `_symmetric_memory`), rendezvoused
    once; a peer's buffers are its allocation mapped over NVLink, so a copy into or out of them is a peer copy.
    Collective: every rank constructs it at the same point."""

    def __init__(self, shapes: Sequence[torch.Size], dtype: torch.dtype, group: dist.ProcessGroup,
                 device: torch.device) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        numel, offsets = _flat(shapes, dtype)
        flat = symm_mem.empty(numel, dtype=dtype, device=device)
        self.handle = symm_mem.rendezvous(flat, group.group_name)
        rank = dist.get_rank(group)
        start = (flat.data_ptr() - self.handle.buffer_ptrs[rank]) // dtype.itemsize  # inside its block: same on all
        self.bufs = [_views(flat, shapes, offsets) if q == rank else
                     _views(self.handle.get_buffer(q, [numel], dtype, start), shapes, offsets)
                     for q in range(dist.get_world_size(group))]
        self.rank = rank

    def local(self) -> list[torch.Tensor]:
        return self.bufs[self.rank]

    def peer(self, i: int, q: int) -> torch.Tensor:
        return self.bufs[q][i]

    def barrier(self) -> None:
        self.handle.barrier(channel=0)


class PeerTransport:
    """Exchanges into and out of peer-addressable staging (module docstring); everything else through `fallback`.
    The staging is `pairs` pairs of (w13-, w2-shaped) buffers in `buffers`."""

    name = "peer"

    def __init__(self, buffers: PeerBuffers, pairs: int, rank: int, P: int, fallback: CollectiveTransport) -> None:
        self.buffers, self.rank, self.P, self.fallback = buffers, rank, P, fallback
        own = buffers.local()
        self.pairs = [(own[2 * j], own[2 * j + 1]) for j in range(pairs)]
        self._index = {(t.data_ptr(), tuple(t.shape)): i for i, t in enumerate(own)}
        self.peer_exchanges = 0

    @classmethod
    def build(cls, groups: Groups, device: torch.device, shapes: Sequence[torch.Size], dtype: torch.dtype,
              pairs: int) -> PeerTransport:
        """Staging of `pairs` pairs of `shapes` (w13, w2) on every rank. Collective."""
        assert groups.device is not None  # several ranks
        shapes = list(shapes) * pairs
        bufs: PeerBuffers = (SymmetricPeerBuffers(shapes, dtype, groups.device, device) if device.type == "cuda"
                             else SharedFileBuffers(shapes, dtype, groups))
        return cls(bufs, pairs, groups.rank, groups.world_size, CollectiveTransport(groups.device))

    def staging(self) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        return list(self.pairs)

    def _own(self, t: torch.Tensor) -> int | None:
        return self._index.get((t.data_ptr(), tuple(t.shape)))

    def _route(self, e: Exchange) -> tuple[str, int] | None:
        """("pull", buffer) when the input is this rank's staging, ("push", buffer) when the output is; None: not a
        staging exchange, or splits other than the even ones the expert exchanges use."""
        out, inp, out_splits, in_splits = e
        n = inp.shape[0] // self.P
        if not (out.shape == inp.shape and out.is_contiguous() and inp.is_contiguous()
                and list(out_splits) == list(in_splits) == [n] * self.P):
            return None
        if (i := self._own(inp)) is not None:
            return "pull", i
        if (i := self._own(out)) is not None:
            return "push", i
        return None

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int]
                   ) -> None:
        self.all_to_all_many([(out, inp, out_splits, in_splits)])

    def all_to_all_many(self, exchanges: Sequence[Exchange]) -> None:
        """Staging exchanges between one pair of barriers; any other exchange goes through the fallback (every rank
        makes the same calls, so all agree on which is which)."""
        routes = [self._route(e) for e in exchanges]
        for e, r in zip(exchanges, routes, strict=True):
            if r is None:
                self.fallback.all_to_all(*e)
        ours = [(e, r) for e, r in zip(exchanges, routes, strict=True) if r is not None]
        if not ours:
            return
        me, bufs = self.rank, self.buffers
        bufs.barrier()  # every rank's staging is packed (pull) or free to be written (push)
        for (out, inp, _, _), (how, i) in ours:
            n = inp.shape[0] // self.P
            for k in range(self.P):
                q = (me + k) % self.P  # start with the local copy, then the peers in turn
                if how == "pull":  # peer q packed rows [me*n, (me+1)*n) of its staging for this rank
                    out[q * n: (q + 1) * n].copy_(inp[me * n: (me + 1) * n] if q == me
                                                  else bufs.peer(i, q)[me * n: (me + 1) * n])
                else:  # rows [q*n, (q+1)*n) of the input are peer q's: they land in its staging at this rank's rows
                    dst = out if q == me else bufs.peer(i, q)
                    dst[me * n: (me + 1) * n].copy_(inp[q * n: (q + 1) * n])
        bufs.barrier()  # every copy landed; no staging is rewritten before every rank has read it
        self.peer_exchanges += len(ours)
