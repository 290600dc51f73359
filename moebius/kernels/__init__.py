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


# Steps of up to this many tokens a rank run their projections through kernels/linear.py in the LATE order; two
# tokens only where the rank's qkv weight has at most PREFETCH_TWO_MAX_ELEMS elements: each program sums twice the
# products, which paid at the 30B TP shard (2560 x 2048: batch 2 2.856 -> 2.804 ms a 48-layer step on 2 H200s) and
# not at EP's whole one (5120 x 2048, two tokens a rank: 4.487 -> 4.616 ms; h200x2-prefetch-rows.json).
PREFETCH_ROWS = 2
PREFETCH_TWO_MAX_ELEMS = 4096 * 2048


def prefetch_rows(qkv_elems: int) -> int:
    return PREFETCH_ROWS if qkv_elems <= PREFETCH_TWO_MAX_ELEMS else 1


# Steps of MMA_MIN_ROWS to MMA_MAX_ROWS tokens a rank run their projections through kernels/linear.py's tensor-core
# kernel, also in the LATE order (against cuBLAS in the EARLY order, at 4-32 tokens on one H200: -1.4 to +0.4% with
# the kernel in the EARLY order, -0.4 to -2.0% in the LATE one; h200-few-row-projections.json). Two tokens with a
# large qkv keep cuBLAS (the kernel there: +1.6%).
MMA_MIN_ROWS, MMA_MAX_ROWS = 3, 32


def release_order_for(tokens: int, qkv_elems: int) -> int:
    """The release order of a forward of `tokens` tokens on this rank whose qkv weight has `qkv_elems` elements."""
    return LATE if tokens <= prefetch_rows(qkv_elems) or MMA_MIN_ROWS <= tokens <= MMA_MAX_ROWS else EARLY
