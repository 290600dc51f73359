"""The engine's mode timeline: what layout it ran in, with how many requests, over time, and every switch (direction,
outcome, phases, why). Kept by the front end; benchmarks and metrics read it."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass, replace
from typing import Any

from moebius.link.messages import RankTimes, SwitchOutcome, SwitchTimes


@dataclass(frozen=True)
class Sample:
    t: float  # seconds since the engine started
    mode: str
    running: int
    waiting: int
    kv_used: float  # fraction of the KV pool in use (all ranks)
    steps: int = 0  # engine steps run so far, and output tokens made: between two samples, ms a step and tokens/s
    tokens: int = 0
    # rank 0's host, device-sync and plan-wait seconds so far (messages.RankTimes): between two samples, per step
    rank_host_s: float = 0.0
    rank_sync_s: float = 0.0
    rank_wait_s: float = 0.0
    # CPU seconds so far of the front end's process (all its threads: with `moebius serve --engine-process off`, the
    # HTTP side too; never the rank processes) and of the thread stepping the engine: between two samples, per step
    cpu_s: float = 0.0
    thread_cpu_s: float = 0.0


@dataclass(frozen=True)
class SwitchEvent:
    t: float
    source: str  # from
    target: str  # to
    done: bool
    reason: str  # why it was asked for (policy, operator), or why it was refused
    total_ms: float | None = None  # rank 0's times of a switch done (a switch riding on a step: a step later)
    weights_ms: float | None = None
    kv_ms: float | None = None


class ModeTimeline:
    """Samples at most every `interval` seconds (a step more often than that is skipped unless the layout changed),
    the newest `maxlen` of them, and every switch."""

    def __init__(self, start: float, interval: float = 0.05, maxlen: int = 200_000) -> None:
        self.start, self.interval = start, interval
        self.samples: deque[Sample] = deque(maxlen=maxlen)
        self.switches: deque[SwitchEvent] = deque(maxlen=maxlen)

    def due(self, now: float, mode: str) -> bool:
        """Whether a sample now would be kept (the interval has passed, or the layout changed)."""
        last = self.samples[-1] if self.samples else None
        return last is None or now - self.start - last.t >= self.interval or last.mode != mode

    def sample(self, now: float, mode: str, running: int, waiting: int, kv_used: float, steps: int = 0,
               tokens: int = 0, rank: RankTimes | None = None) -> None:
        """On the thread that steps the engine (its CPU time is read here)."""
        if self.due(now, mode):
            r = rank or RankTimes()
            self.samples.append(Sample(now - self.start, mode, running, waiting, kv_used, steps, tokens,
                                       r.host_ms / 1e3, r.sync_ms / 1e3, r.wait_ms / 1e3, time.process_time(),
                                       time.thread_time()))

    def switch(self, now: float, outcome: SwitchOutcome, reason: str) -> None:
        d = outcome.device
        self.switches.append(SwitchEvent(now - self.start, outcome.source, outcome.target, outcome.done, reason,
                                         *((d.total_ms, d.weights_ms, d.kv_ms) if d else ())))

    def complete(self, times: SwitchTimes) -> None:
        """The device times of the last switch, which came with the step after it."""
        if self.switches and self.switches[-1].done:
            last = self.switches.pop()
            self.switches.append(replace(last, total_ms=times.total_ms, weights_ms=times.weights_ms,
                                         kv_ms=times.kv_ms))

    def to_json(self, since: float = 0.0) -> dict[str, Any]:
        """Samples and switches from `since` seconds on (all by default), as lists of dicts."""
        return {"samples": [asdict(s) for s in self.samples if s.t >= since],
                "switches": [asdict(s) for s in self.switches if s.t >= since]}
