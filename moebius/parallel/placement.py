"""Which rank owns each live request in EP: one placement rule, and the one table that records it.

The rule: a request goes to the least-loaded rank, by live requests and then by reserved tokens (ties to the lower
rank); the n samples of one request go together (with prefix caching on, the prompt is computed once). New requests
are placed one at a time as they arrive; a TP -> EP switch places every live request at once, largest first.
Deterministic, so its answer is the same wherever it is computed.
"""

from __future__ import annotations

from collections.abc import Mapping


def _least_loaded(load: list[tuple[int, int]]) -> int:
    return min(range(len(load)), key=lambda r: (load[r], r))


def partition(weights: list[int], P: int) -> list[int]:
    """Owners of requests with these token weights placed at once: by decreasing weight (ties by index), each to the
    least-loaded rank."""
    load = [(0, 0)] * P
    owner = [0] * len(weights)
    for i in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        r = _least_loaded(load)
        owner[i] = r
        load[r] = (load[r][0] + 1, load[r][1] + weights[i])
    return owner


class Placement:
    """The ownership table of the live requests of an EP layout (kept by the front end; ranks learn owners from the
    plans)."""

    def __init__(self, num_ranks: int) -> None:
        self.num_ranks = num_ranks
        self._owner: dict[str, tuple[int, int]] = {}  # request id -> (rank, weight)
        self._load = [(0, 0)] * num_ranks

    def owner(self, request_id: str) -> int | None:
        entry = self._owner.get(request_id)
        return None if entry is None else entry[0]

    def place(self, request_id: str, weight: int, beside: str | None = None) -> int:
        """Place one new request on the least-loaded rank, or on the rank of request `beside` (a sample of the same
        request: they share its prompt's KV pages); returns the rank."""
        rank = self._owner[beside][0] if beside is not None else _least_loaded(self._load)
        self._add(request_id, rank, weight)
        return rank

    def release(self, request_id: str) -> int | None:
        """Forget a request (finished or aborted); returns the rank that held it, None if it was not placed."""
        entry = self._owner.pop(request_id, None)
        if entry is None:
            return None
        rank, weight = entry
        n, tokens = self._load[rank]
        self._load[rank] = (n - 1, tokens - weight)
        return rank

    def repartition(self, weights: Mapping[str, int]) -> dict[str, int]:
        """Place every live request at once (a switch into EP), replacing the table; returns the owners."""
        ids = list(weights)
        owners = partition([weights[i] for i in ids], self.num_ranks)
        self.clear()
        for rid, rank in zip(ids, owners, strict=True):
            self._add(rid, rank, weights[rid])
        return dict(zip(ids, owners, strict=True))

    def clear(self) -> None:
        """No placed requests (a switch out of EP: every rank holds every request)."""
        self._owner.clear()
        self._load = [(0, 0)] * self.num_ranks

    def _add(self, request_id: str, rank: int, weight: int) -> None:
        self._owner[request_id] = (rank, weight)
        n, tokens = self._load[rank]
        self._load[rank] = (n + 1, tokens + weight)
