"""The communication a layout needs, behind one interface, so the model math never branches on layout.

- `reduce(x)`: sum of per-rank partial results (after a row-parallel matmul): all-reduce in TP, identity in EP.
- `dispatch(x, w, ids)` / `combine(y, handle)`: move routed tokens to the ranks owning their experts and bring the
  weighted expert outputs back. TP: every rank holds a shard of every expert, so dispatch is the identity and
  combine is the all-reduce. EP: all-to-all both ways.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist


class Communicator(Protocol):
    def reduce(self, x: torch.Tensor) -> torch.Tensor: ...

    def dispatch(self, x_TD: torch.Tensor, w_TK: torch.Tensor, ids_TK: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any]: ...

    def combine(self, y_TD: torch.Tensor, handle: Any) -> torch.Tensor: ...


class LocalComm:
    """A single rank (P = 1): nothing to exchange."""

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def dispatch(self, x_TD: torch.Tensor, w_TK: torch.Tensor, ids_TK: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any]:
        return x_TD, w_TK, ids_TK, None

    def combine(self, y_TD: torch.Tensor, handle: Any) -> torch.Tensor:
        return y_TD


class TPComm:
    """TP: partial sums of row-parallel matmuls and of expert shards are all-reduced; tokens stay put."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.group)
        return x

    def dispatch(self, x_TD: torch.Tensor, w_TK: torch.Tensor, ids_TK: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any]:
        return x_TD, w_TK, ids_TK, None

    def combine(self, y_TD: torch.Tensor, handle: Any) -> torch.Tensor:
        return self.reduce(y_TD)


@dataclass
class _EPHandle:
    token: torch.Tensor  # [S] source token of each sent row
    send: list[int]  # rows sent to each rank
    recv: list[int]  # rows received from each rank
    num_tokens: int


class EPComm:
    """EP: each token goes once to each rank owning one of its top-k experts (with its ids and weights); the
    weighted expert outputs come back and are summed per token. Attention is data-parallel: `reduce` is identity.
    """

    def __init__(self, group: dist.ProcessGroup, world_size: int, experts_per_rank: int) -> None:
        self.group, self.P, self.E_local = group, world_size, experts_per_rank

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def _exchange(self, x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=self.group)
        return out

    def dispatch(self, x_TD: torch.Tensor, w_TK: torch.Tensor, ids_TK: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any]:
        T = x_TD.shape[0]
        to_rank_TP = torch.zeros(T, self.P, dtype=torch.bool, device=x_TD.device)
        to_rank_TP.scatter_(1, ids_TK // self.E_local, True)
        rank_S, token_S = to_rank_TP.t().nonzero(as_tuple=True)  # grouped by destination rank
        send_t = torch.bincount(rank_S, minlength=self.P)
        recv_t = torch.empty_like(send_t)
        dist.all_to_all_single(recv_t, send_t, group=self.group)
        send, recv = send_t.tolist(), recv_t.tolist()
        x = self._exchange(x_TD[token_S], send, recv)
        w = self._exchange(w_TK[token_S], send, recv)
        ids = self._exchange(ids_TK[token_S], send, recv)
        return x, w, ids, _EPHandle(token_S, send, recv, T)

    def combine(self, y_TD: torch.Tensor, handle: Any) -> torch.Tensor:
        back = self._exchange(y_TD, handle.recv, handle.send)
        out = back.new_zeros((handle.num_tokens, back.shape[1]))
        return out.index_add_(0, handle.token, back)
