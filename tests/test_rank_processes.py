"""A spawned rank, or a server's engine process, outlives no front end: once the process that spawned it is gone it
exits, whatever it was doing (`launch.exit_with_parent`; a killed front end cannot close what it started)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from typing import Any

import pytest

from moebius.config import EngineConfig
from moebius.entrypoints.openai.engine_process import run_engine
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


def _engine_building_for_ten_minutes(*args: Any) -> None:
    """`run_engine` whose engine takes ten minutes to build (a large checkpoint's load, its graphs' capture)."""
    from moebius.frontend import core

    core.EngineCore.__init__ = lambda self, config: time.sleep(600)  # type: ignore[method-assign]
    run_engine(*args)


def _http_side(pids: Any) -> None:
    """A server's HTTP process stand-in: starts the engine process as `EngineClient` does, then waits to be killed."""
    ctx = mp.get_context("spawn")
    _, child = ctx.Pipe()
    engine = ctx.Process(target=_engine_building_for_ten_minutes, args=(child, EngineConfig(device="cpu"), False,
                                                                          os.getpid()), daemon=True)
    engine.start()
    pids.put(engine.pid)
    time.sleep(600)


def _running(pid: int) -> bool:
    """Whether the process runs (a zombie, exited but not yet reaped by its new parent, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _outlives_no_parent(target: Any, args: tuple, settle: float) -> None:
    """Start `target` (a front end that spawns one process and puts its pid), let it settle, kill the front end: the
    spawned process must be gone within 20 s."""
    ctx = mp.get_context("spawn")
    pids = ctx.Queue()
    front = ctx.Process(target=target, args=(*args, pids))
    front.start()
    child = None
    try:
        child = pids.get(timeout=120)
        time.sleep(settle)
        assert _running(child)  # (the watch leaves a live parent's child alone)
        os.kill(front.pid, signal.SIGKILL)
        front.join(30)
        deadline = time.monotonic() + 20
        while _running(child):
            assert time.monotonic() < deadline, f"process {child} outlived its killed front end"
            time.sleep(0.1)
    finally:
        front.kill()
        if child is not None and _running(child):  # (a failed run leaves nothing behind)
            os.kill(child, signal.SIGKILL)


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads the processes' states through /proc")
def test_a_rank_exits_when_its_front_end_is_killed() -> None:
    _outlives_no_parent(_front_end, (), 0.5)


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads the processes' states through /proc")
def test_an_engine_process_still_building_exits_when_the_http_side_is_killed() -> None:
    """Killing the HTTP side while its engine process builds ends that process too (it reads its pipe's EOF only
    once it serves)."""
    _outlives_no_parent(_http_side, (), 5.0)
