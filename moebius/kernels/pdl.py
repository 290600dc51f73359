"""Programmatic dependent launch (Hopper+): a kernel launched with it may start while the kernel before it in the
stream is finishing, so its launch overlaps the other's tail; it waits for that kernel (all of its writes) before
reading anything. Every Triton kernel of the step does this, and lets the next one launch as soon as its own
programs have all started (EARLY order) or, in the LATE order the runner picks for steps of a few tokens a rank,
once it has waited (`KernelConfig.release`, `moebius.kernels.release_order_for`). It shortens every boundary between
two small kernels, inside CUDA graphs too (benchmarks/results/h200-pdl.json). Kernels other than ours (cuBLAS, torch)
launch and wait as usual."""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from moebius.kernels import KernelConfig

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # an older Triton: no PDL
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def release(PDL: tl.constexpr):
    """In the EARLY order (`KernelConfig.release`): let the next kernel in the stream launch now (its
    programs then wait in `wait`)."""
    if PDL == 1:
        gdc_launch_dependents()


@triton.jit
def wait(PDL: tl.constexpr):
    """Wait for the previous kernel to finish, all of its writes visible (nothing read before this may depend on
    it: a kernel may load its weights first); in the LATE order, then let the next kernel launch."""
    if PDL != 0:
        gdc_wait()
    if PDL == 2:
        gdc_launch_dependents()


@triton.jit
def enter(PDL: tl.constexpr):
    """First thing in a kernel."""
    release(PDL)
    wait(PDL)


@functools.cache
def _capable(device_index: int) -> bool:
    """Whether kernels on this device can launch with PDL: Hopper or newer, a Triton that has it, and not Triton's
    interpreter (TRITON_INTERPRET, Triton's own setting: its kernels are Python, nothing to overlap)."""
    return (gdc_wait is not None and os.environ.get("TRITON_INTERPRET") != "1"
            and torch.cuda.get_device_capability(device_index) >= (9, 0))


def pdl(t: torch.Tensor, kc: KernelConfig) -> dict[str, int | bool]:
    """Launch arguments of a kernel working on `t` (its `PDL` constexpr: 0 or kc's release order, and Triton's
    launch_pdl): PDL where kc asks for it and the device can."""
    on = kc.pdl and t.is_cuda and _capable(t.device.index if t.device.index is not None
                                           else torch.cuda.current_device())
    return {"PDL": kc.release if on else 0, "launch_pdl": on}
