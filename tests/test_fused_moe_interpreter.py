"""The fused-MoE Triton kernels (moebius/kernels/fused_moe.py) on the CPU under the Triton interpreter, against the
torch reference: direct blocks (a handful of pairs, no sort), the one-program align and the chunked align passes,
all local experts and a slice of them (EP). float32, since the interpreter's bf16 dots are not exact. The
interpreter is chosen when Triton defines the kernels, so the cases run in a fresh interpreter (this file as a
script). Needs Triton (the `gpu` extra); skipped without it. tests/test_gpu.py runs them compiled, in bf16."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")

# (tokens, experts of the model, local experts, first local expert): top-4, so 4 * tokens pairs
CASES = [(1, 16, 16, 0), (6, 16, 8, 8), (8, 16, 16, 0), (40, 16, 8, 8), (300, 16, 16, 0), (700, 8, 8, 0)]


def run_cases() -> None:
    from moebius.kernels import fused_moe as fm
    from moebius.layers.moe import experts_ref

    g = torch.Generator().manual_seed(0)
    K, D, I = 4, 64, 32
    for T, E_all, E, first in CASES:
        x = torch.randn(T, D, generator=g)
        ids = torch.stack([torch.randperm(E_all, generator=g)[:K] for _ in range(T)])
        w = torch.rand(T, K, generator=g).softmax(-1)
        w13 = torch.randn(E, 2 * I, D, generator=g) * 0.1
        w2 = torch.randn(E, D, I, generator=g) * 0.1
        out = fm.fused_experts(x, w, ids, w13, w2, first, E_all)
        ref = experts_ref(x, w, ids, w13, w2, first)
        err = ((out - ref).norm() / ref.norm()).item()
        assert err < 1e-5, (T, E, first, err)


def test_fused_experts_under_the_interpreter() -> None:
    from moebius.kernels import fused_moe as fm

    pairs = [4 * c[0] for c in CASES]
    assert min(pairs) <= fm.DIRECT_MAX_PAIRS < max(pairs)  # both block kinds
    assert max(pairs) > 1024  # the chunked align passes (one program takes up to 1024 pairs)
    env = dict(os.environ, TRITON_INTERPRET="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env, capture_output=True, text=True,
                       timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


if __name__ == "__main__":
    run_cases()
