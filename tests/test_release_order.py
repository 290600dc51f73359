"""The launch release order a forward runs in (moebius/kernels/__init__.py): LATE where the projections prefetch
their weights (kernels/linear.py takes them only then) and where they run as tensor-core tiles (3-32 tokens), EARLY
otherwise (cuBLAS). The kernel settings travel as a frozen `KernelConfig`, which the runner derives per step and
hands to the whole forward. No GPU."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from moebius import kernels
from moebius.kernels import DEFAULT_KERNELS, EARLY, LATE, KernelConfig, release_order_for

TP_30B_QKV = 2560 * 2048  # a 30B TP rank's q|k|v shard
EP_30B_QKV = 5120 * 2048  # EP's whole attention


def test_late_order_for_one_token_and_for_two_at_small_projections() -> None:
    assert release_order_for(1, EP_30B_QKV) == LATE
    assert release_order_for(1, TP_30B_QKV) == LATE
    assert release_order_for(2, TP_30B_QKV) == LATE
    assert release_order_for(2, EP_30B_QKV) == EARLY  # two rows a program did not pay at EP's whole qkv


def test_late_order_for_the_tensor_core_projections_early_beyond() -> None:
    for qkv in (TP_30B_QKV, EP_30B_QKV):
        assert release_order_for(kernels.MMA_MIN_ROWS, qkv) == LATE
        assert release_order_for(16, qkv) == LATE
        assert release_order_for(kernels.MMA_MAX_ROWS, qkv) == LATE
        assert release_order_for(kernels.MMA_MAX_ROWS + 1, qkv) == EARLY  # cuBLAS
        assert release_order_for(2048, qkv) == EARLY


def test_kernel_config_is_frozen_and_with_release_changes_only_the_order() -> None:
    assert DEFAULT_KERNELS == KernelConfig(moe_backend="triton", pdl=True, release=EARLY, reshard_kernel=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        DEFAULT_KERNELS.release = LATE  # type: ignore[misc]
    base = KernelConfig(moe_backend="grouped_mm", pdl=False, reshard_kernel=False)
    late = base.with_release(LATE)
    assert late.release == LATE and base.release == EARLY
    assert dataclasses.replace(late, release=EARLY) == base  # everything else kept
    assert late.with_release(EARLY) == base and base.with_release(EARLY) is base
    assert base.with_release(LATE) is late  # derived once: a step's config costs the host nothing
    with pytest.raises(ValueError):
        KernelConfig(moe_backend="cutlass")
    with pytest.raises(ValueError):
        base.with_release(3)


def test_no_pdl_on_the_cpu_whatever_the_config() -> None:
    pytest.importorskip("triton")
    from moebius.kernels.pdl import pdl

    x = torch.zeros(2, 3)
    for kc in (DEFAULT_KERNELS, DEFAULT_KERNELS.with_release(LATE), KernelConfig(pdl=False)):
        assert pdl(x, kc) == {"PDL": 0, "launch_pdl": False}


def test_runner_forward_runs_the_whole_forward_in_the_steps_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """ModelRunner.forward hands the model its step's config: LATE for one token, EARLY for a large prefill, the
    runtime's other settings kept."""
    from moebius.worker.runner import ModelRunner

    seen: list[KernelConfig] = []

    def record(ids: torch.Tensor, meta: object, weights: object, kv: object, cfg: object, comm: object,
               kc: KernelConfig, routed: object = None) -> torch.Tensor:  # stands in for the model
        seen.append(kc)
        return ids

    base = KernelConfig(moe_backend="grouped_mm", pdl=False)
    runner = SimpleNamespace(kernels=base, qkv_elems=EP_30B_QKV, weights=None, kv=[], cfg=None, comm=None,
                             routed=None, model=SimpleNamespace(forward=record))  # the family's model
    runner.release_order = lambda tokens: ModelRunner.release_order(runner, tokens)  # the runner's own rule
    for tokens in (1, 2048):
        ids = torch.zeros(tokens, dtype=torch.int64)
        assert ModelRunner.forward(runner, ids, None) is ids  # type: ignore[arg-type]
    assert [kc.release for kc in seen] == [LATE, EARLY]
    assert all(kc.moe_backend == "grouped_mm" and not kc.pdl for kc in seen)
