"""A weight update's tensors read by the rank processes of this machine where they lie, by name: in a POSIX
shared-memory segment (`SharedTensor`: its dtype, shape and offset in the segment) or, in the plain description of
`link/tensor_handles.py`, CUDA tensors by IPC handle as well. Nothing is pickled, and no byte goes through a socket.
"""

from __future__ import annotations

import torch

from moebius.link.messages import SharedTensor
from moebius.link.tensor_handles import map_segment


def _end(refs: list[SharedTensor]) -> int:
    return max((r.offset + torch.Size(r.shape).numel() * getattr(torch, r.dtype).itemsize for r in refs), default=0)


def attach(segment: str, refs: list[SharedTensor]) -> dict[str, torch.Tensor]:
    """The tensors of a segment, by name (views of its shared mapping: no copy)."""
    buf = map_segment(segment, _end(refs))
    out = {}
    for r in refs:
        dtype = getattr(torch, r.dtype)
        n = torch.Size(r.shape).numel() * dtype.itemsize
        out[r.name] = buf[r.offset: r.offset + n].view(dtype).view(r.shape)
    return out
