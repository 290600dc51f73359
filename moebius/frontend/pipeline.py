"""Plans on their way to the ranks: with rank processes the front end sends the next step's plan (or the next two:
--plans-ahead) as soon as a step's report is in, so that the ranks schedule and launch it while the front end turns
that report into outputs. Reports come back in the order the plans went out."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Protocol

from moebius.link.messages import StepPlan, StepReport


class Ranks(Protocol):
    """The ranks as the front end reaches them (`worker/launch.py`)."""

    ahead: bool  # whether a plan may go out before the report of the one before is read (rank processes)

    def send(self, plan: StepPlan) -> None: ...

    def receive(self) -> StepReport: ...


class PlanPipeline:
    def __init__(self, ranks: Ranks, ahead: int) -> None:
        self.ranks = ranks
        self.ahead = ahead if ranks.ahead else 0  # in process a plan runs when it is received: nothing to overlap
        self._out: deque[StepPlan] = deque()  # sent, report not read yet; oldest first

    def __len__(self) -> int:
        return len(self._out)

    def send(self, plan: StepPlan) -> None:
        self.ranks.send(plan)
        self._out.append(plan)

    def receive(self) -> tuple[StepPlan, StepReport]:
        """The oldest plan out and its report."""
        assert self._out, "no plan in flight"
        return self._out.popleft(), self.ranks.receive()

    def admits_out(self) -> bool:
        """Whether a plan on its way admits requests (their work is not in any report yet)."""
        return any(p.admit for p in self._out)

    def top_up(self, next_plan: Callable[[], StepPlan | None]) -> None:
        """Send plans ahead until `ahead` are out or `next_plan` has none to send (a switch waits for its turn)."""
        while len(self._out) < self.ahead:
            plan = next_plan()
            if plan is None:
                return
            self.send(plan)

    def drain(self) -> list[tuple[StepPlan, StepReport]]:
        """Every plan out and its report, oldest first: afterwards nothing runs on the ranks."""
        return [self.receive() for _ in range(len(self._out))]
