"""GPU fast paths. Each op here has its torch reference in `moebius.layers` (CPU and tests use the reference; the
GPU tests compare the two). Triton is imported only when a CUDA tensor reaches a kernel."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


# Programmatic dependent launch (kernels/pdl.py): a kernel lets the next one launch before / after it waits for the
# one before it
EARLY, LATE = 1, 2
_order = EARLY


@contextlib.contextmanager
def release_order(order: int) -> Iterator[None]:
    """Kernels launched inside release the next one in this order. EARLY: every kernel of a chain may launch
    (and wait) a few kernels ahead. LATE: one ahead, so a kernel that loads its weights before it waits
    (kernels/linear.py) loads them during the kernel just before it, not while expert kernels three launches back
    need the SMs (one token a rank: 2.44 -> 2.21 ms a 48-layer TP step on 2 H200s; with cuBLAS projections EARLY
    is ~2% faster, h200x2-linear-pdl.json)."""
    global _order
    before, _order = _order, order
    try:
        yield
    finally:
        _order = before


def release_order_now() -> int:
    return _order


PREFETCH_ROWS = 1  # steps of up to this many tokens a rank: prefetching projections (kernels/linear.py), LATE order


def release_order_for(tokens: int) -> int:
    return LATE if tokens <= PREFETCH_ROWS else EARLY
