"""Tensors handed to the rank processes of this machine through POSIX shared memory, by name: the front end copies
them into one segment and sends each one's name, dtype, shape and offset in a message (`SharedTensor`); every rank
maps the segment and reads them where they lie. Nothing is pickled, and no byte goes through a socket.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from multiprocessing import shared_memory

import torch

from moebius.link.messages import SharedTensor

_ALIGN = 64  # bytes: every tensor starts at an offset its dtype (and vectorised copies) can read from
SHM_DIR = "/dev/shm"  # where Linux keeps POSIX shared-memory segments (a RAM file system)


def _map(segment: str, nbytes: int) -> torch.Tensor:
    """The segment as bytes, mapped shared (its tensors are views; the mapping goes with the last of them);
    FileNotFoundError where this machine has no such segment, ValueError where it is shorter than `nbytes`."""
    path = os.path.join(SHM_DIR, segment)
    # (torch.from_file would create a missing file, or extend a short one, with zeros: weights of nothing)
    size = os.stat(path).st_size
    if size < nbytes:
        raise ValueError(f"shared-memory segment {segment} holds {size} bytes, fewer than the {nbytes} of its tensors")
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)


def _end(refs: list[SharedTensor]) -> int:
    return max((r.offset + torch.Size(r.shape).numel() * getattr(torch, r.dtype).itemsize for r in refs), default=0)


def share(tensors: Mapping[str, torch.Tensor]) -> tuple[shared_memory.SharedMemory, list[SharedTensor]]:
    """A new segment holding a copy of every tensor (from any device), and where each lies. The caller unlinks the
    segment once every rank has read it (until then this process's resource tracker would unlink it at exit)."""
    refs, offset = [], 0
    for name, t in tensors.items():
        refs.append(SharedTensor(name, str(t.dtype).removeprefix("torch."), list(t.shape), offset))
        offset += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    seg = shared_memory.SharedMemory(create=True, size=max(offset, 1))
    seg.close()  # (Python's own mapping: the bytes are written through torch's)
    try:
        for ref, t in zip(refs, _views(seg.name, refs), strict=True):
            t.copy_(tensors[ref.name])
    except BaseException:
        seg.unlink()
        raise
    return seg, refs


def _views(segment: str, refs: list[SharedTensor]) -> list[torch.Tensor]:
    buf = _map(segment, _end(refs))
    out = []
    for r in refs:
        dtype = getattr(torch, r.dtype)
        n = torch.Size(r.shape).numel() * dtype.itemsize
        out.append(buf[r.offset: r.offset + n].view(dtype).view(r.shape))
    return out


def attach(segment: str, refs: list[SharedTensor]) -> dict[str, torch.Tensor]:
    """The tensors of a segment `share` made, by name (views of its shared mapping: no copy)."""
    return {r.name: t for r, t in zip(refs, _views(segment, refs), strict=True)}
