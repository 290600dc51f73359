"""--mode auto on the CPU: under a burst then a drain the engine switches TP -> EP and back by itself (small
thresholds), every request's tokens equal a static run's, and the mode timeline records it all."""

from __future__ import annotations

from typing import Any

import pytest
from conftest import PROMPTS, make_llm, run_to_completion

from moebius.config import ConfigError
from moebius.sampling_params import SamplingParams
from moebius.switch import calibration

AUTO = dict(mode="auto", switch_high=4, switch_low=2, switch_window=1, switch_cooldown=0)
ENGINE = dict(max_running_requests=16, max_num_batched_tokens=16, max_total_tokens=1024)


def burst(llm: Any) -> dict[str, Any]:
    """Ten requests at once (greedy and seeded-sampled, 3 to 30 tokens), then the drain."""
    ids = []
    for i in range(10):
        sp = (SamplingParams(temperature=0, max_tokens=3 + 3 * i, ignore_eos=True) if i % 2 else
              SamplingParams(temperature=0.9, top_p=0.9, seed=i, max_tokens=3 + 3 * i, ignore_eos=True))
        ids.append(llm.add_request(list(PROMPTS[i % len(PROMPTS)]), sp))
    outs = run_to_completion(llm)
    return {i: [c.token_ids for c in outs[i].outputs] for i in ids}


@pytest.mark.parametrize("P", [2, 4])
def test_auto_switches_on_a_burst_and_back_on_the_drain_with_static_tokens(ckpt: Any, P: int) -> None:
    path = ckpt("tied_mha_nonorm")
    with make_llm(path, num_ranks=P, mode="tp", **ENGINE) as static:
        want = burst(static)
    with make_llm(path, num_ranks=P, **AUTO, **ENGINE) as llm:
        assert llm.mode == "tp" and llm.engine.auto is not None
        got = burst(llm)
        assert got == want
        events = list(llm.engine.timeline.switches)
        assert [(e.source, e.target, e.done) for e in events] == [("tp", "ep", True), ("ep", "tp", True)], events
        assert "T_h" in events[0].reason and "T_l" in events[1].reason
        samples = list(llm.engine.timeline.samples)
        assert max(s.running + s.waiting for s in samples) == 10 and samples[-1].mode == "tp"
        assert {s.mode for s in samples} == {"tp", "ep"}
        assert llm.mode == "tp"
        held = llm.engine.query("requests")
        assert held == [{"running": [], "waiting": [], "others": []}] * P


def test_auto_is_the_default_with_several_ranks_and_calibrates(ckpt: Any, tmp_path: Any) -> None:
    """No thresholds given: the crossover comes from a calibration at start-up, kept in a file that the next start
    reuses (no second calibration)."""
    path = ckpt("tied_mha_nonorm")
    kw = dict(num_ranks=2, calibration_dir=str(tmp_path), **ENGINE)
    with make_llm(path, **kw) as llm:
        assert llm.engine.auto is not None
        cal = llm.engine.calibration()
        assert cal.batches and len(cal.tp_ms) == len(cal.ep_ms) == len(cal.batches)
        assert set(cal.switch_ms) == {"tp", "ep"}
        # each layout's KV tokens engine-wide, as the engine's pools hold them (kept in the file below)
        assert cal.kv_tokens == llm.engine.kv_capacity_by_layout and min(cal.kv_tokens.values()) > 0
        events = [(e.source, e.target, e.reason) for e in llm.engine.timeline.switches]
        assert events == [("tp", "ep", "calibration"), ("ep", "tp", "calibration")]
        assert llm.mode == "tp"
    assert calibration.load(str(tmp_path), cal.key) == cal  # kept where the next start looks for it
    with make_llm(path, **kw) as llm:
        assert list(llm.engine.timeline.switches) == []  # the kept profile: no switches at start
        assert llm.engine.calibration() == cal


def test_auto_refuses_a_static_layout() -> None:
    with pytest.raises(ConfigError, match="static-layout"):
        make_llm(None, num_ranks=2, mode="auto", static_layout=True)


def test_a_quantized_engine_calibrates_apart(tmp_path: Any) -> None:
    """The kept profile is keyed by the engine's --quantization too: after a bf16 start kept its profile, an MXFP4
    start of the same checkpoint measures its own (its steps and switches move other bytes), and a second MXFP4
    start reuses that."""
    from conftest import write_checkpoint

    path = write_checkpoint(str(tmp_path / "wide"), dict(moe_intermediate_size=128))
    kw = dict(num_ranks=2, calibration_dir=str(tmp_path / "profiles"), **ENGINE)
    keys = []
    for quant in (None, "mxfp4", "mxfp4"):
        with make_llm(path, quantization=quant, **kw) as llm:
            keys.append(llm.engine.calibration().key)
            events = [e.reason for e in llm.engine.timeline.switches]
            assert events == ([] if quant is not None and len(keys) == 3 else ["calibration"] * 2), (quant, events)
    assert keys[0].dtype == "float32" and keys[1].dtype == keys[2].dtype == "float32+mxfp4"
    assert len({k.file_name() for k in keys}) == 2


def test_fp8_profiles_tell_w8a8_from_the_default_w8a16() -> None:
    """FP8's two GEMM forms take other times, and so do its dense weights in the dtype: their profiles are apart
    (the default W8A16 with FP8 dense weights the bare label)."""
    label = calibration.weights_label
    assert label("bfloat16", None) == "bfloat16" and label("bfloat16", "mxfp4", True) == "bfloat16+mxfp4"
    assert label("bfloat16", "fp8") == "bfloat16+fp8" and label("bfloat16", "fp8", True) == "bfloat16+fp8-w8a8"
    assert label("bfloat16", "fp8", False, "experts") == "bfloat16+fp8-experts"
    assert label("bfloat16", "mxfp4", False, "experts") == "bfloat16+mxfp4"  # (MXFP4 holds the experts alone)
