"""When to switch: the front end's policy, a pure component fed one observation per step.

Threshold policy (the paper's): the signal is the number of requests in flight (running or queued). In TP, switch
to EP as soon as the latest count exceeds the high threshold T_h; in EP, back to TP once the mean of the last W
counts falls below the low threshold T_l (T_l <= T_h: the band between them is hysteresis). After every switch,
and after a refused one (the target could not hold the live requests), nothing is asked for C seconds; the window
restarts with the new layout.

Cost policy (beyond the paper): with the calibrated step times of both layouts and the measured switch cost, switch
when the predicted time saved over the work still in flight exceeds the switch cost (`CostPolicy`).

Profiles: interactive serving keeps EP through short dips (T_l = 0.8 T_h, W = 8); a rollout step, one burst then a
monotone drain, switches at the crossover (T_l = T_h, W = 1). Both cool down 5 s.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

PROFILES: dict[str, dict[str, float]] = {
    "interactive": {"low_factor": 0.8, "window": 8, "cooldown": 5.0},
    "rollout": {"low_factor": 1.0, "window": 1, "cooldown": 5.0},
}


@dataclass(frozen=True)
class Thresholds:
    """T_h, T_l, W and C of the threshold policy."""

    high: float
    low: float
    window: int
    cooldown: float

    def __post_init__(self) -> None:
        if not self.low <= self.high:
            raise ValueError(f"the low threshold {self.low} is above the high threshold {self.high}")
        if self.window < 1:
            raise ValueError(f"the window must be at least one step, got {self.window}")
        if self.cooldown < 0:
            raise ValueError(f"the cooldown must be >= 0 s, got {self.cooldown}")

    @staticmethod
    def of(profile: str, high: float, low: float | None = None, window: int | None = None,
           cooldown: float | None = None) -> Thresholds:
        """The profile's values, each overridden where given."""
        if profile not in PROFILES:
            raise ValueError(f"switch profile must be one of {sorted(PROFILES)}, got {profile!r}")
        p = PROFILES[profile]
        return Thresholds(high, p["low_factor"] * high if low is None else low,
                          int(p["window"]) if window is None else window,
                          p["cooldown"] if cooldown is None else cooldown)


@dataclass(frozen=True)
class Decision:
    """A switch the policy asks for, and why (logged and kept in the mode timeline)."""

    target: str
    reason: str


class ThresholdPolicy:
    def __init__(self, thresholds: Thresholds) -> None:
        self.t = thresholds
        self._counts: deque[int] = deque(maxlen=thresholds.window)
        self._quiet_until = float("-inf")

    def observe(self, now: float, mode: str, in_flight: int) -> Decision | None:
        """The count of requests in flight after a step (time `now`, layout `mode`); the switch to ask for, if any."""
        self._counts.append(in_flight)
        if now < self._quiet_until:
            return None
        if mode == "tp" and in_flight > self.t.high:
            return Decision("ep", f"{in_flight} in flight > T_h {self.t.high:g}")
        if mode == "ep" and len(self._counts) == self.t.window:
            mean = sum(self._counts) / len(self._counts)
            if mean < self.t.low:
                return Decision("tp", f"mean of the last {self.t.window} counts {mean:.1f} < T_l {self.t.low:g}")
        return None

    def switched(self, now: float) -> None:
        """A switch happened (the policy's or an operator's): cool down, and count afresh in the new layout."""
        self._quiet_until = now + self.t.cooldown
        self._counts.clear()

    def refused(self, now: float) -> None:
        """The asked-for switch was refused (capacity): try again after the cooldown."""
        self._quiet_until = now + self.t.cooldown

    def reset(self) -> None:
        """Forget what was observed (a new workload starts)."""
        self._counts.clear()
        self._quiet_until = float("-inf")


@dataclass(frozen=True)
class StepCurve:
    """Calibrated decode step time (ms) of one layout at a few global batch sizes (ascending), read between them
    linearly; beyond the largest, along the last segment (never below the largest's time)."""

    batches: tuple[int, ...]
    step_ms: tuple[float, ...]

    def at(self, batch: np.ndarray | float) -> np.ndarray:
        b = np.asarray(batch, dtype=np.float64)
        inside = np.interp(b, self.batches, self.step_ms)
        if len(self.batches) < 2:
            return inside
        (b0, b1), (t0, t1) = self.batches[-2:], self.step_ms[-2:]
        beyond = np.maximum(t1 + (t1 - t0) / (b1 - b0) * (b - b1), t1)
        return np.where(b > b1, beyond, inside)


def ep_ahead_from(tp_ms: Sequence[float], ep_ms: Sequence[float]) -> int | None:
    """The first index from which EP's time is below TP's at every later index (None: not at the last)."""
    first = None
    for i in reversed(range(len(tp_ms))):
        if ep_ms[i] < tp_ms[i]:
            first = i
        else:
            break
    return first


def crossover(tp: StepCurve, ep: StepCurve) -> float | None:
    """The global batch from which EP's step is shorter at every larger measured batch, interpolated between the
    last measured batch where TP is faster and the first where EP is; 0.0 when EP is faster everywhere, None when TP
    is faster at the largest measured batch."""
    b, t_tp, t_ep = tp.batches, tp.step_ms, ep.step_ms
    first = ep_ahead_from(t_tp, t_ep)
    if first is None:
        return None
    if first == 0:
        return 0.0
    j = first - 1  # TP faster at j, EP at j + 1: where the two lines cross
    gap_j, gap_k = t_tp[j] - t_ep[j], t_tp[first] - t_ep[first]  # <= 0, > 0
    return b[j] + (b[first] - b[j]) * (-gap_j) / (gap_k - gap_j)


class CostPolicy:
    """Switch when the time the other layout saves over the work still in flight beats the switch's cost.

    At each step: predict how the running count decays from the running requests' remaining output tokens (each
    request's max_tokens left, capped by the output-length distribution seen so far), sum each layout's step times
    over that decay, and switch when the other layout's total plus the switch's cost (plus a margin) is smaller.
    Cooldown and refusals as in the threshold policy."""

    def __init__(self, tp: StepCurve, ep: StepCurve, switch_ms: dict[str, float], cooldown: float,
                 margin: float = 0.1, horizon_steps: int = 4096) -> None:
        self.curves = {"tp": tp, "ep": ep}
        self.switch_ms, self.cooldown, self.margin, self.horizon = switch_ms, cooldown, margin, horizon_steps
        self._quiet_until = float("-inf")

    def predict(self, mode: str, remaining: Sequence[int]) -> float:
        """ms to finish requests with these remaining tokens (one a step each) in layout `mode`, arrivals aside:
        while the shortest left decodes, the count stays at the number not finished yet."""
        r = np.minimum(np.sort(np.asarray([x for x in remaining if x > 0], dtype=np.int64)), self.horizon)
        if not len(r):
            return 0.0
        spans = np.diff(r, prepend=0)  # steps during which len(r) - i requests run
        counts = len(r) - np.arange(len(r))
        return float((spans * self.curves[mode].at(counts)).sum())

    def decide(self, now: float, mode: str, remaining: Sequence[int]) -> Decision | None:
        """remaining: the running requests' predicted remaining output tokens."""
        if now < self._quiet_until or not remaining:
            return None
        other = "ep" if mode == "tp" else "tp"
        stay = self.predict(mode, remaining)
        move = self.predict(other, remaining) + self.switch_ms[other]
        if move * (1 + self.margin) < stay:
            return Decision(other, f"predicted {stay:.0f} ms in {mode}, {move:.0f} ms in {other} with the switch")
        return None

    def switched(self, now: float) -> None:
        self._quiet_until = now + self.cooldown

    def refused(self, now: float) -> None:
        self._quiet_until = now + self.cooldown

    def reset(self) -> None:
        self._quiet_until = float("-inf")


def predicted_remaining(max_left: Sequence[int], produced: Sequence[int], finished_sorted: Sequence[int]
                        ) -> list[int]:
    """Each running request's remaining output tokens: what its max_tokens leaves, capped by the output lengths of
    the requests finished so far (`finished_sorted`, ascending): with enough of them longer than what a request has
    produced, it is expected to end at their median."""
    out = []
    for left, n in zip(max_left, produced, strict=True):
        i = bisect.bisect_right(finished_sorted, n)
        longer = len(finished_sorted) - i
        if longer >= 8:
            left = min(left, finished_sorted[i + longer // 2] - n)
        out.append(max(left, 1))
    return out
