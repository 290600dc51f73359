"""Auto mode (`--mode auto`): which layout an engine starts in, and the switch policy the front end consults after
every step, built from the flags and, where they leave the thresholds open, the calibration profile."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from moebius.config import ConfigError, EngineConfig
from moebius.parallel.layout import MODES
from moebius.switch.calibration import Calibration
from moebius.switch.policy import PROFILES, CostPolicy, Decision, ThresholdPolicy, Thresholds

log = logging.getLogger("moebius")


def resolve_mode(ecfg: EngineConfig, world_size: int, tp_possible: bool = True) -> tuple[str, bool, tuple[str, ...]]:
    """(the layout the engine starts in, whether the policy switches it, the layouts its ranks hold): --mode auto
    (the default with several ranks) starts in TP for interactive serving, in EP for a rollout (one burst, then a
    drain), holding both; --static-layout holds the start one alone. tp_possible: whether TP can cut the model (a
    quantized one whose experts TP would cut inside a scale block cannot): with --mode unset or ep such a model is
    served in EP alone (said in a warning); --mode tp or auto, asked for, is refused where the ranks are built."""
    auto = ecfg.mode == "auto" or (ecfg.mode is None and world_size > 1)
    if world_size > 1 and not tp_possible and ecfg.mode in (None, "ep"):
        log.warning("serving in EP alone: TP over %d ranks would cut the quantized experts inside their scale "
                    "blocks, so there is no second layout to switch to", world_size)
        return "ep", False, ("ep",)
    if not auto:
        start = ecfg.mode or "tp"
        return start, False, (start,) if ecfg.static_layout else MODES
    if world_size == 1:  # one rank: both layouts are the same; nothing to decide
        return "tp", False, ("tp",) if ecfg.static_layout else MODES
    if ecfg.static_layout:
        raise ConfigError("--mode auto switches layouts: it needs both (drop --static-layout or pick --mode tp/ep)")
    return ("ep" if ecfg.switch_profile == "rollout" else "tp"), True, MODES


def engine_tokens(per_rank: Sequence[int], data_parallel: bool) -> int:
    """KV tokens engine-wide from each rank's (held or held at most): EP holds each request on one rank, so the
    ranks' sum; TP every request on every rank (its heads of them, or all of a cache replicated: MLA's latent, GQA's
    heads below P), so one rank's (the largest: they hold the same)."""
    return sum(per_rank) if data_parallel else max(per_rank, default=0)


def needs_calibration(ecfg: EngineConfig) -> bool:
    return ecfg.switch_policy == "cost" or ecfg.switch_high is None


@dataclass
class AutoMode:
    policy: ThresholdPolicy | CostPolicy
    note: str  # what it will do, in words (logged at start, reported by status)
    cost_every: float = 0.25  # seconds between the cost policy's predictions (each sorts the requests in flight)
    # tokens of KV each layout holds engine-wide (a running engine's from its ranks' pools, `EngineCore.
    # kv_capacity_by_layout`; the simulator's `Calibration.kv_tokens`; TP's is 1/P of EP's for MLA): a switch whose
    # target cannot hold the live KV is not asked for (empty: not known; the switch's own check refuses it)
    capacity: dict[str, int] = field(default_factory=dict)
    refusals: int = 0  # switches the policy wanted and the capacity refused
    _next_cost: float = float("-inf")

    def observe(self, now: float, mode: str, in_flight: int, remaining: Callable[[], Sequence[int]],
                kv_tokens: Callable[[], int] | None = None) -> Decision | None:
        """After a step: the switch to ask for, if any. in_flight: requests running or queued; remaining(): their
        predicted remaining output tokens (only the cost policy asks, at most every `cost_every` seconds);
        kv_tokens(): the KV tokens the live requests hold (asked only when a switch is wanted and the target's
        capacity is known; past it the switch is refused as the engine's would be, and the policy cools down)."""
        if isinstance(self.policy, ThresholdPolicy):
            d = self.policy.observe(now, mode, in_flight)
        elif now < self._next_cost:
            return None
        else:
            self._next_cost = now + self.cost_every
            d = self.policy.decide(now, mode, remaining())
        if d is not None and kv_tokens is not None and d.target in self.capacity:
            held = kv_tokens()
            if held > self.capacity[d.target]:
                log.info("auto mode: no switch to %s (%s): the live requests hold %d KV tokens, %s holds %d",
                         d.target, d.reason, held, d.target.upper(), self.capacity[d.target])
                self.refusals += 1
                self.policy.refused(now)
                return None
        return d

    def switched(self, now: float) -> None:
        self.policy.switched(now)

    def refused(self, now: float) -> None:
        self.policy.refused(now)

    def reset(self) -> None:
        self.policy.reset()
        self._next_cost = float("-inf")


def build(ecfg: EngineConfig, calibration: Calibration | None) -> AutoMode:
    """The policy the flags ask for (calibration: required where the flags leave T_h open, or for the cost
    policy)."""
    profile = PROFILES[ecfg.switch_profile]
    cooldown = profile["cooldown"] if ecfg.switch_cooldown is None else ecfg.switch_cooldown
    if ecfg.switch_policy == "cost":
        assert calibration is not None
        tp, ep = calibration.curves()
        return AutoMode(CostPolicy(tp, ep, calibration.switch_ms, cooldown),
                        f"cost policy over the calibrated steps ({calibration.summary()})",
                        capacity=dict(calibration.kv_tokens))
    high = ecfg.switch_high
    note = ""
    if high is None:
        assert calibration is not None
        x = calibration.crossover()
        if x is None:
            high, note = math.inf, "TP is faster at every calibrated batch: the policy stays in TP"
        elif x == 0.0:
            high, note = -1.0, "EP is faster at every calibrated batch: the policy stays in EP"
        else:
            high, note = x, f"T_h = the calibrated crossover {x:.1f}"
    low = ecfg.switch_low if ecfg.switch_low is not None else (high if high < 0 else None)
    t = Thresholds.of(ecfg.switch_profile, high, low, ecfg.switch_window, cooldown)
    note = (note + "; " if note else "") + (f"threshold policy ({ecfg.switch_profile}): TP -> EP above {t.high:g} "
                                            f"in flight, EP -> TP below a mean {t.low:g} over {t.window} steps, "
                                            f"cooldown {t.cooldown:g} s")
    return AutoMode(ThresholdPolicy(t), note, capacity=dict(calibration.kv_tokens) if calibration else {})
