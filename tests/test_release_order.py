"""The launch release order a forward runs in (moebius/kernels/__init__.py): LATE where the projections prefetch
their weights (kernels/linear.py takes them only then), EARLY otherwise. Pure Python: no GPU, no Triton."""

from __future__ import annotations

import pytest

from moebius import kernels
from moebius.kernels import EARLY, LATE, release_order, release_order_for, release_order_now

TP_30B_QKV = 2560 * 2048  # a 30B TP rank's q|k|v shard
EP_30B_QKV = 5120 * 2048  # EP's whole attention


def test_late_order_for_one_token_and_for_two_at_small_projections() -> None:
    assert release_order_for(1, EP_30B_QKV) == LATE
    assert release_order_for(1, TP_30B_QKV) == LATE
    assert release_order_for(2, TP_30B_QKV) == LATE
    assert release_order_for(2, EP_30B_QKV) == EARLY  # measured slower there (h200x2-prefetch-rows.json)
    assert release_order_for(3, TP_30B_QKV) == EARLY
    assert release_order_for(kernels.PREFETCH_ROWS + 1, 1) == EARLY


def test_release_order_is_restored_after_an_error() -> None:
    assert release_order_now() == EARLY
    with pytest.raises(RuntimeError), release_order(LATE):
        assert release_order_now() == LATE
        raise RuntimeError("a failing forward")
    assert release_order_now() == EARLY
