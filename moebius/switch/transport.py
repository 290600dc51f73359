"""How switch bytes travel between ranks. The collective transport (torch.distributed all-to-all; gloo or NCCL, one
machine or several) is the reference; a direct NVLink transport can replace it behind the same interface."""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist


class Transport(Protocol):
    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int]
                   ) -> None:
        """Rows in_splits[q] of `inp` (in peer order) go to peer q; rows from peer s land in `out` in peer order."""
        ...


class CollectiveTransport:
    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int]
                   ) -> None:
        if self.group is None:  # one rank: the only peer is itself
            out.copy_(inp)
            return
        dist.all_to_all_single(out, inp.contiguous(), out_splits, in_splits, group=self.group)
