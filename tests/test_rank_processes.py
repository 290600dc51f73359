"""A spawned rank outlives no front end: once the process that spawned it is gone it exits, whatever it was doing
(`launch.exit_with_parent`; a killed front end cannot close its ranks)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from typing import Any

import pytest

from moebius.worker.launch import exit_with_parent


def _watched_sleeper(parent: int) -> None:
    """A rank stand-in busy for ten minutes (building, or waiting in a collective), watching its parent."""
    exit_with_parent(parent, period=0.1)
    time.sleep(600)


def _front_end(pids: Any) -> None:
    """A front-end stand-in: spawns the sleeper as SpawnedRanks spawns a rank, then waits to be killed."""
    child = mp.get_context("spawn").Process(target=_watched_sleeper, args=(os.getpid(),), daemon=True)
    child.start()
    pids.put(child.pid)
    time.sleep(600)


def _running(pid: int) -> bool:
    """Whether the process runs (a zombie, exited but not yet reaped by its new parent, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads the processes' states through /proc")
def test_a_rank_exits_when_its_front_end_is_killed() -> None:
    ctx = mp.get_context("spawn")
    pids = ctx.Queue()
    front = ctx.Process(target=_front_end, args=(pids,))
    front.start()
    rank = None
    try:
        rank = pids.get(timeout=120)
        time.sleep(0.5)
        assert _running(rank)  # (the watch leaves a live parent's child alone)
        os.kill(front.pid, signal.SIGKILL)
        front.join(30)
        deadline = time.monotonic() + 20
        while _running(rank):
            assert time.monotonic() < deadline, f"the rank {rank} outlived its killed front end"
            time.sleep(0.1)
    finally:
        front.kill()
        if rank is not None and _running(rank):  # (a failed run leaves no sleeper behind)
            os.kill(rank, signal.SIGKILL)
