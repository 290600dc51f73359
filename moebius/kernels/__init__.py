"""GPU fast paths. Each op here has its torch reference in `moebius.layers` (CPU and tests use the reference; the
GPU tests compare the two). Triton is imported only when a CUDA tensor reaches a kernel."""

from __future__ import annotations

import functools


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
