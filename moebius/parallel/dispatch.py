"""The communication a layout needs, behind one interface, so the model math never branches on layout.

- `reduce(x)`: sum of per-rank partial results (after a row-parallel matmul): all-reduce in TP, identity in EP.
- `dispatch(x, w, ids)` / `combine(y, handle)`: move routed tokens to the ranks owning their experts and bring the
  weighted expert outputs back. TP: every rank holds a shard of every expert, so dispatch is the identity and
  combine is the all-reduce. EP: all-to-all both ways.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch


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
