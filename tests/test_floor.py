"""The project's decode-step floor agrees with the reference floor model in ../shared/tools/floor.py."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

from moebius.bench.floor import decode_step_floor_ms, switch_floor_ms
from moebius.bench.sweep import crossover
from moebius.config import PRESETS, ModelConfig

REF = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "tools", "floor.py")


@pytest.mark.skipif(not os.path.isfile(REF), reason="../shared/tools/floor.py is not beside this checkout")
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_floor_agrees_with_reference(preset: str) -> None:
    spec = importlib.util.spec_from_file_location("ref_floor", REF)
    ref = importlib.util.module_from_spec(spec)
    sys.modules["ref_floor"] = ref  # its dataclasses look their module up while being built
    spec.loader.exec_module(ref)
    cfg = ModelConfig.from_hf(PRESETS[preset])
    shape = ref.Shape(**ref.PRESETS[preset])
    for P in (1, 2, 4, 8):
        for mode in ("tp", "ep"):
            for batch in (1, 3, 64, 256, 2048):
                for context in (1, 512, 4096):
                    want = ref.step_floor(shape, P, mode, batch, context)["floor_ms"]
                    assert decode_step_floor_ms(cfg, P, mode, batch, context) == pytest.approx(want, rel=1e-9)
        for kv_tokens in (0, 1000, 200_000):
            want = ref.switch_floor(shape, P, kv_tokens)["floor_ms"]
            assert switch_floor_ms(cfg, P, kv_tokens) == pytest.approx(want, rel=1e-9)


def test_switch_floor_by_hand() -> None:
    """Qwen3-30B-A3B on 2 ranks, no KV: half a rank's experts cross the link, the other half is copied in HBM."""
    cfg = ModelConfig.from_hf(PRESETS["qwen3-30b-a3b"])
    rank = 48 * 128 * 3 * 2048 * 768 * 2 / 2  # bytes of a rank's experts (bf16)
    want = (rank / 2 / 395e9 + 2 * rank / 2 / 4.28e12) * 1e3
    assert switch_floor_ms(cfg, 2, 0) == pytest.approx(want)
    assert switch_floor_ms(cfg, 2, 1000) > want


def test_floor_shape_tp_wins_small_ep_wins_large_on_8_ranks() -> None:
    cfg = ModelConfig.from_hf(PRESETS["qwen3-235b-a22b"])
    f = {m: [decode_step_floor_ms(cfg, 8, m, b, 1024) for b in (8, 2048)] for m in ("tp", "ep")}
    assert f["tp"][0] < f["ep"][0] and f["ep"][1] < f["tp"][1]


def test_crossover_is_where_ep_stays_ahead() -> None:
    series = {"tp": {1: 1.0, 2: 2.0, 4: 3.0, 8: 4.0}, "ep": {1: 1.5, 2: 1.9, 4: 3.5, 8: 3.0}}
    pts = [dict(mode=m, batch=b, step_ms=t) for m, s in series.items() for b, t in s.items()]
    assert crossover(pts) == 8
