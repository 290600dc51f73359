"""The engine model of `moebius bench simulate`: exact on a hand-counted case, the policy's code deciding its
switches, and the command end to end from the floor model (a projection) and from a measured profile (validated
against a real run's result)."""

from __future__ import annotations

from typing import Any

import pytest

from moebius.bench.results import load_result, summary_of, table
from moebius.bench.simulate import simulate
from moebius.bench.workload import Job
from moebius.entrypoints.cli import main
from moebius.switch.auto import AutoMode
from moebius.switch.policy import StepCurve, ThresholdPolicy, Thresholds

FLAT = StepCurve((1, 1000), (10.0, 10.0))  # 10 ms a step at any batch


def test_simulated_steps_by_hand() -> None:
    jobs = [Job(0.0, [0], n) for n in (2, 3, 5)]
    run = simulate(jobs, {"tp": FLAT, "ep": FLAT}, {"tp": 1.0, "ep": 1.0}, "tp", None, budget=64, max_running=8,
                   system="tp")
    # step 1 prefills all three (their first tokens), then one token a step: the longest needs 4 more
    assert run.wall_s == pytest.approx(0.05) and run.seconds == {"tp": pytest.approx(0.05), "ep": 0.0}
    assert [x for _, x in run.ttft] == [pytest.approx(0.01)] * 3
    assert [n for _, _, n in run.steps] == [0, 3, 2, 1, 1]  # tokens decoded a step (the prefill samples, decodes 0)
    # a budget of 2 tokens a step: the second prompt waits a step
    run = simulate([Job(0.0, [0, 0], 1), Job(0.0, [0], 1)], {"tp": FLAT, "ep": FLAT}, {}, "tp", None, budget=2,
                   max_running=8, system="tp")
    assert run.wall_s == pytest.approx(0.02) and [x for _, x in run.ttft] == [pytest.approx(0.01),
                                                                               pytest.approx(0.02)]


def test_simulated_mixed_steps_take_the_mixed_curve() -> None:
    """A profile with mixed steps (eager in the engine): a step holding a prompt chunk takes the mixed time."""
    jobs = [Job(0.0, [0], n) for n in (2, 3, 5)] + [Job(0.035, [0, 0], 1)]
    mixed = StepCurve((1, 1000), (30.0, 30.0))
    run = simulate(jobs, {"tp": FLAT, "ep": FLAT}, {}, "tp", None, budget=64, max_running=8, system="tp",
                   mixed={"tp": mixed, "ep": mixed})
    # the first step prefills three prompts (30 ms), decodes follow at 10 ms, and the prompt arriving at 35 ms is
    # prefilled beside the decodes of the step from 40 ms (30 ms more)
    assert [x for _, x, _ in run.steps] == pytest.approx([0.03, 0.01, 0.03, 0.01, 0.01])
    assert run.ttft[-1] == (0.035, pytest.approx(0.035))


def test_simulated_auto_switches_where_the_policy_says() -> None:
    tp, ep = StepCurve((1, 64), (1.0, 64.0)), StepCurve((1, 64), (10.0, 12.0))  # EP ahead from ~10 requests
    jobs = [Job(0.0, [0], n) for n in range(1, 41)]  # a burst draining one request a step
    auto = AutoMode(ThresholdPolicy(Thresholds.of("rollout", 10, cooldown=0)), "test")
    run = simulate(jobs, {"tp": tp, "ep": ep}, {"tp": 1.0, "ep": 1.0}, "ep", auto, budget=64, max_running=64,
                   system="auto")
    assert [(s["source"], s["target"]) for s in run.switches] == [("ep", "tp")]
    static = {m: simulate(jobs, {"tp": tp, "ep": ep}, {}, m, None, 64, 64, m).wall_s for m in ("tp", "ep")}
    assert run.wall_s < min(static.values())  # the drain in TP, the burst in EP
    # KV in flight makes the switch longer: 0.5 ms for each token the running requests hold (prompt + outputs)
    auto = AutoMode(ThresholdPolicy(Thresholds.of("rollout", 10, cooldown=0)), "test")
    slow = simulate(jobs, {"tp": tp, "ep": ep}, {"tp": 1.0, "ep": 1.0}, "ep", auto, budget=64, max_running=64,
                    system="auto", kv_ms_per_token=0.5)
    # after step 31 the 9 requests left (outputs 32..40) hold 1 prompt + 31 output tokens each
    held = 9 * 32
    assert len(slow.steps) > 31 and slow.switches[0]["t"] == pytest.approx(slow.steps[30][0])
    assert slow.switches[0]["ms"] == pytest.approx(1.0 + 0.5 * held)
    assert slow.wall_s == pytest.approx(run.wall_s + 0.5 * held / 1e3)


def test_kv_switch_time_per_token() -> None:
    from moebius.bench.simulate import kv_switch_ms_per_token
    from moebius.config import PRESETS
    from moebius.models.registry import model_config

    cfg = model_config(PRESETS["qwen3-235b-a22b"])
    assert kv_switch_ms_per_token(cfg, 1, 2.0) == 0.0  # one rank: no KV changes owner
    one = kv_switch_ms_per_token(cfg, 8, 1.0)
    assert one > 0 and kv_switch_ms_per_token(cfg, 8, 2.0) == pytest.approx(2 * one)


def test_simulate_command_projects_and_validates(tmp_path: Any) -> None:
    out = f"{tmp_path}/sim.json"
    assert main(["bench", "simulate", "rollout", "--floor-model", "qwen3-235b-a22b", "--floor-ranks", "8",
                 "--requests", "256", "--scale", "0.2", "--output", out]) == 0
    result = load_result(out)
    rows = {r["system"]: r for r in table(result, "system")}
    assert rows["auto"]["switches"] >= 1 and summary_of(result)["speedup_over_worse_static"] >= 1.0
    # from a measured profile, compared with a real run of the same trace (here a tiny CPU one)
    real = f"{tmp_path}/real.json"
    trace = ["--requests", "16", "--scale", "0.02", "--seed", "3"]
    engine = ["--num-ranks", "2", "--device", "cpu", "--switch-high", "4", "--switch-cooldown", "0",
              "--calibration-dir", str(tmp_path)]
    assert main(["bench", "rollout", *trace, *engine, "--no-warmup", "--output", real]) == 0
    assert main(["calibrate", "--num-ranks", "2", "--device", "cpu", "--calibration-dir", str(tmp_path),
                 "--batches", "1,4,16", "--context", "8"]) == 0
    profile = next(p for p in tmp_path.iterdir() if "-p2-" in p.name)  # the kept calibration
    assert main(["bench", "simulate", "rollout", *trace, "--profile", str(profile), "--switch-high", "4",
                 "--switch-cooldown", "0", "--validate", real, "--output", out]) == 0
    rows = {r["system"]: r for r in table(load_result(out), "system")}
    assert all(r["sim_over_real"] > 0 and r["real_completion_s"] > 0 for r in rows.values())


# ---- KV capacity: TP holds every request's KV on every rank (MLA: the whole latent cache), EP each once ---------


def test_floor_profile_kv_capacity_tp_is_1_over_p_of_ep_for_a_latent_cache() -> None:
    """The floor model's profile carries each layout's KV capacity on an H200: a DeepSeek preset's latent is
    replicated in TP, so TP holds 1/P of EP's tokens; Qwen3-235B's 4 KV heads over 8 ranks, 1/2."""
    from moebius.bench.floor import kv_capacity_tokens
    from moebius.bench.simulate import floor_profile
    from moebius.config import PRESETS, ConfigError
    from moebius.models.registry import model_config

    for preset in ("deepseek-v2-lite", "moonlight-16b-a3b"):
        cap = floor_profile(preset, 4, 1024, 1.4, 2.0).kv_tokens
        assert cap["tp"] > 0 and 4 * cap["tp"] == cap["ep"]
    cap = floor_profile("qwen3-235b-a22b", 8, 1024, 1.4, 2.0).kv_tokens
    assert cap["tp"] == pytest.approx(cap["ep"] / 2, rel=1e-5)
    # by hand: 1 GiB of KV a rank over V2-Lite's 27 layers + the spare slot, 576 bf16 values a token a layer
    lite = model_config(PRESETS["deepseek-v2-lite"])
    per_rank = 2**30 // (28 * 576 * 2)
    assert kv_capacity_tokens(lite, 4, 2**30) == {"tp": per_rank, "ep": 4 * per_rank}
    # DeepSeek-V3 whole is ~160 GiB of weights a rank on 8 in bf16: refused naming it; cut, it fits
    with pytest.raises(ConfigError, match=r"a rank's weights take .* GiB \(61 layers on 8 ranks"):
        floor_profile("deepseek-v3", 8, 1024, 1.4, 2.0)
    cap = floor_profile("deepseek-v3", 8, 1024, 1.4, 2.0, num_layers=20).kv_tokens
    assert 8 * cap["tp"] == cap["ep"] > 0


def test_floor_profile_of_a_quantized_engine() -> None:
    """--floor-quantization: DeepSeek-V3 whole fits 8 H200s in FP8 (its FP8 rows' bytes in the weights), with its
    steps and switches cheaper than the 20-layer cut's per layer in bf16; Qwen3-235B in FP8 on 8 ranks is refused,
    naming the TP cut inside its scale blocks (auto mode needs both layouts)."""
    from moebius.bench.simulate import floor_profile
    from moebius.config import ConfigError

    fp8 = floor_profile("deepseek-v3", 8, 1024, 1.4, 2.0, quantization="fp8")
    cut = floor_profile("deepseek-v3", 8, 1024, 1.4, 2.0, num_layers=20)
    assert fp8.key.dtype == "bfloat16+fp8" and fp8.key.num_layers == 61
    assert 8 * fp8.kv_tokens["tp"] == fp8.kv_tokens["ep"] > 0
    assert fp8.switch_ms["tp"] / 61 < cut.switch_ms["tp"] / 20
    assert fp8.ep_ms[-1] / 61 < cut.ep_ms[-1] / 20
    with pytest.raises(ConfigError, match=r"--quantization fp8 with TP over 8 ranks would cut each expert's "
                                          r"moe_intermediate_size 1536 into 192 rows a rank"):
        floor_profile("qwen3-235b-a22b", 8, 1024, 1.4, 2.0, quantization="fp8")


def test_simulated_admission_keeps_within_the_layouts_capacity() -> None:
    """As the engine's scheduler: three requests of 1 prompt + 4 output tokens all start in TP holding 10 tokens,
    and at the fourth step (9 held, 3 more needed) the newest is preempted (its 3 freed: 8 held after the step) and
    recomputes its 4 tokens a step later;
    EP holding 100 runs all three through. Two prompts of 8 tokens: the second is admitted only once the first ends
    (8 + 8 > 10)."""
    jobs = [Job(0.0, [0], 4) for _ in range(3)]
    cap = {"tp": 10, "ep": 100}
    tp = simulate(jobs, {"tp": FLAT, "ep": FLAT}, {}, "tp", None, budget=64, max_running=8, system="tp",
                  capacity=cap)
    assert [x for _, x in tp.ttft] == [pytest.approx(0.01)] * 3
    assert tp.wall_s == pytest.approx(0.05) and tp.preemptions == 1 and tp.most_kv["tp"] == 9
    assert [n for _, _, n in tp.steps] == [0, 3, 3, 2, 0]  # step 5: the preempted one's recompute samples its last
    ep = simulate(jobs, {"tp": FLAT, "ep": FLAT}, {}, "ep", None, budget=64, max_running=8, system="ep",
                  capacity=cap)
    assert ep.wall_s == pytest.approx(0.04) and ep.preemptions == 0 and ep.most_kv["ep"] == 12
    long = [Job(0.0, [0] * 8, 2) for _ in range(2)]
    tp = simulate(long, {"tp": FLAT, "ep": FLAT}, {}, "tp", None, 64, 8, "tp", capacity=cap)
    assert [x for _, x in tp.ttft] == [pytest.approx(0.01), pytest.approx(0.03)] and tp.wall_s == pytest.approx(0.04)
    with pytest.raises(ValueError, match="job 0 needs 5 tokens of KV, more than the 4"):
        simulate(jobs, {"tp": FLAT, "ep": FLAT}, {}, "tp", None, 64, 8, "tp", capacity={"tp": 4, "ep": 100})


def test_auto_mode_does_not_ask_for_tp_while_the_live_kv_would_not_fit() -> None:
    """The policy's wish to go back to TP is refused while the live requests' KV exceeds TP's capacity (cooling
    down as after a refused switch), and granted once it fits; the engine's call (no kv_tokens) is unchanged."""
    from moebius.switch.policy import Decision

    auto = AutoMode(ThresholdPolicy(Thresholds.of("rollout", 10, cooldown=1.0)), "test",
                    capacity={"tp": 100, "ep": 400})
    assert auto.observe(0.0, "ep", 5, lambda: [], lambda: 150) is None and auto.refusals == 1
    assert auto.observe(0.5, "ep", 5, lambda: [], lambda: 50) is None  # cooling down
    assert auto.observe(1.5, "ep", 5, lambda: [], lambda: 50) == Decision("tp", "mean of the last 1 counts 5.0 "
                                                                                "< T_l 10")
    plain = AutoMode(ThresholdPolicy(Thresholds.of("rollout", 10, cooldown=1.0)), "test", capacity={"tp": 1})
    assert plain.observe(0.0, "ep", 5, lambda: []) is not None  # no kv_tokens: the switch's own check decides


def test_simulated_auto_waits_for_tp_to_hold_the_live_kv() -> None:
    """The drain of test_simulated_auto_switches_where_the_policy_says with TP holding 200 tokens: the policy asks
    for TP from 9 requests left (after step 31, each holding 31 tokens: 279) on, and the switch waits until the 5
    left after step 35 hold 175."""
    tp, ep = StepCurve((1, 64), (1.0, 64.0)), StepCurve((1, 64), (10.0, 12.0))
    jobs = [Job(0.0, [0], n) for n in range(1, 41)]
    auto = AutoMode(ThresholdPolicy(Thresholds.of("rollout", 10, cooldown=0)), "test", capacity={"tp": 200})
    run = simulate(jobs, {"tp": tp, "ep": ep}, {"tp": 1.0, "ep": 1.0}, "ep", auto, budget=64, max_running=64,
                   system="auto", capacity={"tp": 200, "ep": 10_000})
    assert [(s["source"], s["target"]) for s in run.switches] == [("ep", "tp")]
    assert auto.refusals == 4  # at 9, 8, 7 and 6 requests left
    assert run.switches[0]["t"] == pytest.approx(run.steps[34][0])  # after step 35: outputs 36..40 left
    assert run.most_kv["tp"] == 5 * 36 and run.preemptions == 0  # step 36: each of the 5 one token more


def test_calibration_keeps_the_kv_capacity() -> None:
    from moebius.config import EngineConfig
    from moebius.switch.auto import build
    from moebius.switch.calibration import Calibration, CalibrationKey

    cal = Calibration(CalibrationKey("m", 2, 2, "cpu", "float32"), 8, [1, 4], [1.0, 4.0], [2.0, 3.0],
                      {"tp": 1.0, "ep": 1.0}, kv_tokens={"tp": 100, "ep": 200})
    again = Calibration.from_json(cal.to_json())
    assert again == cal
    old = cal.to_json()
    del old["kv_tokens"]  # a profile kept before: capacity not known
    assert Calibration.from_json(old).kv_tokens == {}
    ecfg = EngineConfig.from_kwargs(mode="auto")
    assert build(ecfg, cal).capacity == {"tp": 100, "ep": 200}
    assert build(EngineConfig.from_kwargs(mode="auto", switch_policy="cost"), cal).capacity == {"tp": 100, "ep": 200}
