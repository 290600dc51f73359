"""The launch release order a forward runs in (moebius/kernels/__init__.py): LATE where the projections prefetch
their weights (kernels/linear.py takes them only then) and where they run as tensor-core tiles (3-32 tokens), EARLY
otherwise (cuBLAS). Pure Python: no GPU, no Triton."""

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


def test_late_order_for_the_tensor_core_projections_early_beyond() -> None:
    for qkv in (TP_30B_QKV, EP_30B_QKV):
        assert release_order_for(kernels.MMA_MIN_ROWS, qkv) == LATE
        assert release_order_for(16, qkv) == LATE
        assert release_order_for(kernels.MMA_MAX_ROWS, qkv) == LATE
        assert release_order_for(kernels.MMA_MAX_ROWS + 1, qkv) == EARLY  # cuBLAS
        assert release_order_for(2048, qkv) == EARLY


def test_release_order_is_restored_after_an_error() -> None:
    assert release_order_now() == EARLY
    with pytest.raises(RuntimeError), release_order(LATE):
        assert release_order_now() == LATE
        raise RuntimeError("a failing forward")
    assert release_order_now() == EARLY
