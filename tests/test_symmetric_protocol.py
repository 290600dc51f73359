"""The flag / slot protocol of the symmetric-memory kernels (moebius/kernels/symmetric.py), run on the CPU under the
Triton interpreter with P "ranks" as forked processes sharing memory (a fork keeps the shared buffers at the same
addresses, so the kernels' address tables hold in every rank). Each case runs in a fresh interpreter (this file as a
script, TRITON_INTERPRET=1), since Triton reads that variable when the kernels are defined. Covers P = 2 and 3,
grids smaller than the rows (programs loop), one- and two-shot calls and the low-latency protocol mixed, ranks with
no tokens and changing sizes between calls. Needs Triton (the `gpu` extra); skipped without it. The same kernels run
on GPUs in tests/test_gpu.py."""

from __future__ import annotations

import importlib.util
import multiprocessing
import os
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton"),
              pytest.mark.skipif(sys.platform != "linux", reason="needs fork")]


def _shared(numel: int, dtype: torch.dtype, P: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    ts = [torch.zeros(numel, dtype=dtype).share_memory_() for _ in range(P)]
    return ts, torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64)


FIRST, LOCAL = 4, 8  # pair cases: experts 4..11 are this rank's (ids run 0..15)
# Call numbers start near the int32 limit, so every case runs across the wrap; the flags as the engine leaves them
# (every program's flag at its call number: the call before is done)
WRAP_START = 2 ** 31 - 3


def _flags(numel: int, P: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    ts, ptrs = _shared(numel, torch.int32, P)
    for t in ts:
        t.fill_(WRAP_START)
    return ts, ptrs


def _pair_sum(y_ND: torch.Tensor, ids_TK: torch.Tensor) -> torch.Tensor:
    """The reference of the kernels' sum over each token's local pairs."""
    T, K = ids_TK.shape
    local = ((ids_TK >= FIRST) & (ids_TK < FIRST + LOCAL)).float()
    return (y_ND.view(T, K, -1) * local[:, :, None]).sum(1)


def _allreduce_rank(r: int, P: int, bufs: torch.Tensor, flags: torch.Tensor, ll_bufs: torch.Tensor, calls: list,
                    max_numel: int, ll_numel: int, programs: int) -> None:
    from moebius.kernels.symmetric import FLAG_STRIDE, _allreduce_add_rmsnorm

    count = torch.full((programs,), WRAP_START, dtype=torch.int32)
    for xs, ids, res0, w, mode in calls:
        T, N = res0.shape
        res, out = res0.clone(), torch.empty(T, N)
        two, ll = mode == "two", mode == "ll"
        grid = programs if ll else min(-(-T // P) if two else T, programs)  # ll: the same grid every call
        K = ids[r].shape[1] if ids else 1
        _allreduce_add_rmsnorm[(grid,)](xs[r], ids[r] if ids else xs[r], res, w, out, bufs, flags, count, T, N,
                                        max_numel, FIRST, LOCAL, 1e-6, ll_bufs, ll_numel, RANK=r, P=P,
                                        MAX_PROGRAMS=programs, STRIDE=FLAG_STRIDE, ROWS=2 if T > programs else 1,
                                        BLOCK=N, TWO_SHOT=two, K=K, PAIRS=bool(ids), LL=ll, PDL=False)
        want_res = res0 + sum(_pair_sum(x, i) for x, i in zip(xs, ids, strict=True)) if ids else res0 + sum(xs)
        want = w * (want_res * torch.rsqrt(want_res.pow(2).mean(-1, keepdim=True) + 1e-6))
        assert torch.allclose(res, want_res, atol=1e-5) and torch.allclose(out, want, atol=1e-4), (r, T, two)


def _ep_rank(r: int, P: int, ptrs: dict, xw: list, idb: list, calls: list, cmax: int, programs: int) -> None:
    from moebius.kernels.symmetric import FLAG_STRIDE, _ep_combine_add_rmsnorm, _ep_dispatch

    count = torch.full((2, programs), WRAP_START, dtype=torch.int32)
    for Ts, C, xs, ws, ids, ys, res0, wn in calls:
        D, K = xs[0].shape[1], ws[0].shape[1]
        w_off = P * cmax * D
        _ep_dispatch[(min(C, programs),)](xs[r], ws[r], ids[r], Ts[r], C, D, ptrs["xw"], ptrs["ids"], ptrs["flags"],
                                          count[0], w_off, RANK=r, P=P, K=K, MAX_PROGRAMS=programs,
                                          STRIDE=FLAG_STRIDE, ROWS=2, BLOCK=D, KB=K, PDL=False)
        n = P * C
        gx, gw, gi = xw[r][: n * D].view(n, D), xw[r][w_off: w_off + n * K].view(n, K), idb[r][: n * K].view(n, K)
        for q in range(P):  # rank q's rows at q * C, padded: zero rows and weights, expert id -1
            s, e, T = q * C, (q + 1) * C, Ts[q]
            assert torch.equal(gx[s: s + T], xs[q]) and not gx[s + T: e].any(), (r, q, "x")
            assert torch.equal(gw[s: s + T], ws[q]) and not gw[s + T: e].any(), (r, q, "w")
            assert torch.equal(gi[s: s + T], ids[q]) and (gi[s + T: e] == -1).all(), (r, q, "ids")
        res, out = res0[r].clone(), torch.empty_like(res0[r])
        pairs = ys[r].shape[0] > P * C  # expert outputs per (token, k) pair of the dispatched ids
        y_sum = [_pair_sum(ys[q], gi) if pairs else ys[q] for q in range(P)]
        _ep_combine_add_rmsnorm[(min(C, programs),)](ys[r], gi, res, wn, out, Ts[r], C, D, ptrs["y"], ptrs["flags"],
                                                     count[1], FIRST, LOCAL, 1e-6, RANK=r, P=P,
                                                     MAX_PROGRAMS=programs, STRIDE=FLAG_STRIDE, ROWS=2, BLOCK=D, K=K,
                                                     PAIRS=pairs, PDL=False)
        want_res = res0[r] + sum(y_sum[q][r * C: r * C + Ts[r]] for q in range(P))
        want = wn * (want_res * torch.rsqrt(want_res.pow(2).mean(-1, keepdim=True) + 1e-6))
        assert torch.allclose(res, want_res, atol=1e-5) and torch.allclose(out, want, atol=1e-4), (r, Ts, C)


def _run_ranks(target, P: int, *args) -> None:
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=target, args=(r, P, *args)) for r in range(P)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0] * P, [p.exitcode for p in procs]


def allreduce_case(P: int) -> None:
    from moebius.kernels.symmetric import FLAG_STRIDE

    N, programs, max_numel, ll_numel = 32, 3, 20 * 32, 8 * 32
    keep, bufs = _shared(2 * 2 * P * max_numel, torch.float32, P)  # keep: the tables hold raw addresses
    keep_flags, flags = _flags(2 * P * programs * FLAG_STRIDE, P)
    keep_ll, ll_bufs = _shared(2 * P * ll_numel, torch.int64, P)  # zero words: no tag is 0
    g = torch.Generator().manual_seed(P)
    calls = []
    # K: pair rows, summed inside. "ll": the low-latency protocol, mixed with the flag protocol's one- and two-shot
    # calls; grids smaller than the rows, calls of fewer rows than programs, the same parity twice in a row
    for T, mode, K in [(3, "one", 0), (5, "two", 0), (1, "ll", 0), (2, "ll", 3), (7, "two", 3), (20, "one", 0),
                       (8, "ll", 0), (2, "two", 0), (1, "ll", 0), (9, "one", 0), (6, "ll", 3), (6, "one", 3),
                       (11, "two", 3), (3, "ll", 0), (4, "one", 0), (5, "ll", 0)]:
        xs = [torch.randn(T * max(K, 1), N, generator=g) for _ in range(P)]
        ids = [torch.randint(0, 16, (T, K), generator=g) for _ in range(P)] if K else []
        calls.append((xs, ids, torch.randn(T, N, generator=g), torch.randn(N), mode))
    _run_ranks(_allreduce_rank, P, bufs, flags, ll_bufs, calls, max_numel, ll_numel, programs)
    del keep, keep_flags, keep_ll


def ep_case(P: int) -> None:
    from moebius.kernels.symmetric import FLAG_STRIDE

    D, K, cmax, programs = 32, 4, 12, 3
    xw, xw_ptrs = _shared(P * cmax * (D + K), torch.float32, P)
    idb, id_ptrs = _shared(P * cmax * K, torch.int64, P)
    keep, y_ptrs = _shared(P * cmax * D, torch.float32, P)  # keep: the tables hold raw addresses
    keep_flags, flag_ptrs = _flags(2 * P * programs * FLAG_STRIDE, P)
    ptrs = dict(xw=xw_ptrs, ids=id_ptrs, y=y_ptrs, flags=flag_ptrs)
    g = torch.Generator().manual_seed(P)
    calls = []
    for Ts, C in [((3, 5, 2), 7), ((0, 4, 1), 4), ((1, 1, 1), 1), ((9, 2, 12), 12), ((6, 6, 0), 6)]:
        Ts = Ts[:P]
        x = [torch.randn(T, D, generator=g) for T in Ts]
        w = [torch.rand(T, K, generator=g) for T in Ts]
        ids = [torch.randint(0, 16, (T, K), generator=g) for T in Ts]
        pairs = len(calls) % 2 == 1  # every other call: expert outputs per (token, k) pair, summed in the combine
        y = [torch.randn(P * C * (K if pairs else 1), D, generator=g) for _ in range(P)]
        res = [torch.randn(T, D, generator=g) for T in Ts]
        calls.append((Ts, C, x, w, ids, y, res, torch.randn(D)))
    _run_ranks(_ep_rank, P, ptrs, xw, idb, calls, cmax, programs)
    del keep, keep_flags


@pytest.mark.parametrize("P", [2, 3])
@pytest.mark.parametrize("case", ["allreduce", "ep"])
def test_protocol_under_the_interpreter(case: str, P: int) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, os.path.abspath(__file__), case, str(P)], env=env, capture_output=True,
                       text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


if __name__ == "__main__":
    {"allreduce": allreduce_case, "ep": ep_case}[sys.argv[1]](int(sys.argv[2]))
