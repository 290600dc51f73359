"""What a memory release with the weights kept pays on the host: page-locking the host copy, then the copies.

    python benchmarks/rl/pinned_host.py --gib 16 --output benchmarks/results/h200-pinned-host.json

One device buffer of --gib GiB copied to and from host memory got four ways: torch.empty then cuMemHostRegister
(4 KiB pages), an anonymous mapping with MADV_HUGEPAGE then cuMemHostRegister (what `memory/umm.py` does), torch's
pin_memory=True (cudaHostAlloc through its caching host allocator), and pageable memory. For each: the seconds to get
and pin it, D2H (first and second copy: the first into fresh pageable memory faults its pages in) and H2D rates.
"""

from __future__ import annotations

import argparse
import functools
import mmap
import time
from collections.abc import Callable
from typing import Any

import torch

from moebius.bench import results


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(prog="python benchmarks/rl/pinned_host.py", description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=16)
    ap.add_argument("--output", default=None)
    args = ap.parse_args()
    from cuda.bindings import driver as drv

    n = int(args.gib * 2**30)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")

    def registered(host: torch.Tensor) -> torch.Tensor:
        drv.cuMemHostRegister(host.data_ptr(), n, 0)
        return host

    def huge() -> torch.Tensor:
        anon = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        anon.madvise(mmap.MADV_HUGEPAGE)
        return registered(torch.frombuffer(anon, dtype=torch.uint8))

    ways: list[tuple[str, Callable[[], torch.Tensor], bool]] = [
        ("torch.empty + cuMemHostRegister", lambda: registered(torch.empty(n, dtype=torch.uint8)), True),
        ("mmap MADV_HUGEPAGE + cuMemHostRegister", huge, True),
        ("torch pin_memory=True", lambda: torch.empty(n, dtype=torch.uint8, pin_memory=True), False),
        ("pageable", lambda: torch.empty(n, dtype=torch.uint8), False),
    ]
    rows = []
    for what, get, unregister in ways:
        host, pin_s = _timed(get)
        _, d2h_first = _timed(functools.partial(host.copy_, dev, non_blocking=True))
        _, d2h = _timed(functools.partial(host.copy_, dev, non_blocking=True))
        _, h2d = _timed(functools.partial(dev.copy_, host, non_blocking=True))
        if unregister:
            drv.cuMemHostUnregister(host.data_ptr())
        rows.append(dict(what=what, gib=args.gib, get_and_pin_s=pin_s, d2h_first_gb_per_s=n / d2h_first / 1e9,
                         d2h_gb_per_s=n / d2h / 1e9, h2d_gb_per_s=n / h2d / 1e9))
        print(f"{what:40s} get+pin {pin_s:6.2f} s  D2H {n / d2h_first / 1e9:6.1f} / {n / d2h / 1e9:6.1f} GB/s  "
              f"H2D {n / h2d / 1e9:6.1f} GB/s", flush=True)
        host = None  # (its memory back before the next way)
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
        thp = f.read().strip()
    if args.output:
        results.write_result(args.output, rows, params=vars(args) | {"transparent_hugepage": thp}, num_gpus=1,
                             note="Host memory for a release's weight copy: seconds to get and page-lock --gib GiB, "
                                  "then copy rates from and to one device buffer (first D2H into fresh memory, "
                                  "then again).")


if __name__ == "__main__":
    main()
