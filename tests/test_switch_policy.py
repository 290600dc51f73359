"""The switch policy on its own (no engine): hysteresis band, window, cooldown, refusal then retry, no oscillation
inside the band, the rollout profile switching once on a draining batch; the crossover, the calibration file, and
the cost policy's prediction."""

from __future__ import annotations

import math
import random

import pytest

from moebius.switch import calibration as store
from moebius.switch.calibration import Calibration, CalibrationKey
from moebius.switch.policy import (
    CostPolicy,
    StepCurve,
    ThresholdPolicy,
    Thresholds,
    crossover,
    predicted_remaining,
)


def run(policy: ThresholdPolicy, counts: list[int], mode: str = "tp", dt: float = 0.1, t0: float = 0.0
        ) -> tuple[list[tuple[int, str]], str]:
    """Feed counts one step apart; apply every decision at once (as the engine does a step later). Returns the
    (step, target) switches and the final mode."""
    switches = []
    for i, n in enumerate(counts):
        now = t0 + i * dt
        d = policy.observe(now, mode, n)
        if d is not None:
            switches.append((i, d.target))
            mode = d.target
            policy.switched(now)
    return switches, mode


def test_profiles_and_overrides() -> None:
    t = Thresholds.of("interactive", 100)
    assert (t.high, t.low, t.window, t.cooldown) == (100, 80, 8, 5.0)
    t = Thresholds.of("rollout", 100)
    assert (t.high, t.low, t.window, t.cooldown) == (100, 100, 1, 5.0)
    t = Thresholds.of("interactive", 100, low=50, window=3, cooldown=0)
    assert (t.high, t.low, t.window, t.cooldown) == (100, 50, 3, 0)
    with pytest.raises(ValueError, match="above the high"):
        Thresholds.of("interactive", 10, low=20)
    with pytest.raises(ValueError, match="profile"):
        Thresholds.of("bursty", 10)


def test_tp_to_ep_on_the_latest_count_above_t_h() -> None:
    p = ThresholdPolicy(Thresholds(high=10, low=8, window=4, cooldown=0))
    assert run(p, [3, 9, 10, 10, 11])[0] == [(4, "ep")]  # strictly above T_h, at once


def test_ep_to_tp_on_the_window_mean_below_t_l() -> None:
    p = ThresholdPolicy(Thresholds(high=10, low=8, window=4, cooldown=0))
    # one low count is not enough: the mean of the last 4 must fall below 8
    switches, mode = run(p, [12, 12, 2, 12, 12, 7, 7, 7, 7], mode="ep")
    assert switches == [(8, "tp")] and mode == "tp"
    p = ThresholdPolicy(Thresholds(high=10, low=8, window=4, cooldown=0))
    assert run(p, [1, 1, 1], mode="ep")[0] == []  # a window not yet full decides nothing


def test_no_oscillation_on_a_noisy_count_inside_the_band() -> None:
    rnd = random.Random(0)
    counts = [rnd.randint(81, 100) for _ in range(5000)]  # inside [T_l, T_h] = [80, 100]
    for mode in ("tp", "ep"):
        p = ThresholdPolicy(Thresholds.of("interactive", 100, cooldown=0))
        assert run(p, counts, mode=mode)[0] == []


def test_cooldown_bounds_the_switching_rate() -> None:
    p = ThresholdPolicy(Thresholds(high=10, low=10, window=1, cooldown=1.0))
    counts = [20, 0] * 50  # would flip every step without a cooldown
    switches, _ = run(p, counts, dt=0.1)
    steps = [i for i, _ in switches]
    assert len(switches) >= 5 and all(b - a >= 10 for a, b in zip(steps, steps[1:], strict=False))


def test_refused_switch_is_retried_after_the_cooldown() -> None:
    p = ThresholdPolicy(Thresholds(high=10, low=8, window=1, cooldown=2.0))
    assert p.observe(0.0, "tp", 50).target == "ep"
    p.refused(0.0)  # the target could not hold the live requests
    assert p.observe(1.0, "tp", 50) is None and p.observe(1.99, "tp", 50) is None
    d = p.observe(2.0, "tp", 50)
    assert d is not None and d.target == "ep" and "T_h" in d.reason


def test_rollout_profile_switches_once_on_a_draining_batch() -> None:
    counts = list(range(2048, 0, -7))  # one burst, then a monotone drain
    p = ThresholdPolicy(Thresholds.of("rollout", 256))
    switches, mode = run(p, counts, mode="ep", dt=1.0)
    assert [t for _, t in switches] == ["tp"] and mode == "tp"
    assert counts[switches[0][0]] < 256 <= counts[switches[0][0] - 1]  # at the crossover, not later


def test_crossover_is_interpolated_and_says_when_one_layout_wins_everywhere() -> None:
    b = (1, 8, 64, 256)
    assert crossover(StepCurve(b, (1, 2, 4, 8)), StepCurve(b, (2, 3, 3.5, 6))) == pytest.approx(8 + 56 * 1 / 1.5)
    assert crossover(StepCurve(b, (1, 2, 4, 8)), StepCurve(b, (2, 3, 5, 9))) is None  # TP everywhere
    assert crossover(StepCurve(b, (3, 3, 5, 9)), StepCurve(b, (2, 2, 4, 8))) == 0.0  # EP everywhere
    # EP wins once but TP again above: the crossover is where EP wins for good
    assert crossover(StepCurve(b, (1, 5, 4, 8)), StepCurve(b, (2, 3, 5, 6))) == pytest.approx(64 + 192 / 3)


def test_calibration_is_kept_and_reused(tmp_path: object) -> None:
    key = CalibrationKey("qwen3-30b-a3b", 48, 2, "NVIDIA H200", "bfloat16")
    cal = Calibration(key, 256, [1, 64, 256], [2.0, 10.0, 12.5], [3.0, 10.2, 12.0], {"tp": 90.0, "ep": 88.0})
    assert store.load(str(tmp_path), key) is None
    path = store.save(str(tmp_path), cal)
    assert path.endswith(key.file_name()) and store.load(str(tmp_path), key) == cal
    other = CalibrationKey("qwen3-30b-a3b", 48, 4, "NVIDIA H200", "bfloat16")
    assert store.load(str(tmp_path), other) is None  # another key: measured anew
    graphs = CalibrationKey("qwen3-30b-a3b", 48, 2, "NVIDIA H200", "bfloat16", "budget 8192, eager, experts triton")
    assert store.load(str(tmp_path), graphs) is None  # the same model run another way: its steps take other times
    with open(path, "w") as f:
        f.write("{not json")
    assert store.load(str(tmp_path), key) is None  # a broken file is measured anew, not an error
    assert "EP is faster from batch" in cal.summary()
    assert cal.mixed_curves() is None  # a profile without mixed steps (format 1 files too)
    with_mixed = Calibration(key, 256, [1, 64], [2.0, 10.0], [3.0, 10.2], {"tp": 90.0, "ep": 88.0}, [1, 64],
                             [20.0, 30.0], [21.0, 31.0])
    path = store.save(str(tmp_path), with_mixed)
    assert store.load(str(tmp_path), key) == with_mixed and "256-token prompt beside them" in with_mixed.summary()
    tp, ep = with_mixed.mixed_curves()
    assert tp.batches == (257, 320) and ep.at(320) == pytest.approx(31.0)  # by the step's tokens
    old = {k: v for k, v in with_mixed.to_json().items() if "mixed" not in k} | {"format": 1}
    assert Calibration.from_json(old) == cal.__class__(key, 256, [1, 64], [2.0, 10.0], [3.0, 10.2],
                                                       {"tp": 90.0, "ep": 88.0})


def test_cost_policy_predicts_the_drain_and_weighs_the_switch() -> None:
    b = (1, 8, 64, 256)
    tp, ep = StepCurve(b, (1.0, 2.0, 4.0, 16.0)), StepCurve(b, (2.0, 3.0, 5.0, 8.0))
    cost = CostPolicy(tp, ep, {"tp": 50.0, "ep": 50.0}, cooldown=0.0, margin=0.0)
    # 3 requests with 10, 10 and 20 tokens left: 10 steps at 3 running, then 10 at 1
    assert cost.predict("tp", [10, 10, 20]) == pytest.approx(10 * tp.at(3) + 10 * tp.at(1))
    assert cost.predict("ep", []) == 0.0
    many = [400] * 256  # a big batch with a long way to go: EP saves more than the switch costs
    d = cost.decide(0.0, "tp", many)
    assert d is not None and d.target == "ep"
    assert cost.decide(0.0, "ep", many) is None
    few = [3] * 256  # almost done: the switch would cost more than it saves
    assert cost.decide(0.0, "tp", few) is None
    assert tp.at(512) == pytest.approx(32.0) and math.isclose(float(tp.at(4.5)), 1.5)


def test_predicted_remaining_caps_by_the_lengths_seen() -> None:
    finished = sorted([100] * 10 + [1000] * 10)
    # no history beyond what it produced: max_tokens decides; enough history: the median of the longer ones
    assert predicted_remaining([5000], [2000], finished) == [5000]
    assert predicted_remaining([5000], [50], finished) == [1000 - 50]
    assert predicted_remaining([30], [50], finished) == [30]
    assert predicted_remaining([0], [10], []) == [1]
