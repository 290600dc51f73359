"""A spawned rank, or a server's engine process, outlives no front end: once the process that spawned it is gone it
exits, whatever it was doing (`launch.exit_with_parent`; a killed front end cannot close what it started). Each test
kills a real front end (`LLM` with spawned ranks, `EngineClient`) at a point where nothing else would end its child."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import pytest
from conftest import Checkpoints

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the processes through /proc")


def _llm_with_two_ranks(ready: Any) -> None:
    """A front end with two spawned ranks, idle: rank 0 waits on its pipe, rank 1 on rank 0's next plan."""
    from moebius import LLM

    llm = LLM(num_ranks=2)  # noqa: F841 - held until this process is killed
    ready.put(True)
    time.sleep(600)


def _http_side(model: str, ready: Any) -> None:
    """A server's HTTP side starting its engine process on `model`; EngineClient waits for it to be ready."""
    from moebius.config import EngineConfig
    from moebius.entrypoints.openai.engine_process import EngineClient

    ready.put(True)
    EngineClient(EngineConfig(model=model, device="cpu"))
    time.sleep(600)


def _spawned_children(pid: int) -> list[int]:
    """The processes `pid` spawned (multiprocessing's spawn_main)."""
    kids = []
    for d in os.listdir("/proc"):
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{d}/cmdline", "rb") as f:
                spawned = b"spawn_main" in f.read()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid and spawned:
            kids.append(int(d))
    return kids


def _running(pid: int) -> bool:
    """Whether the process runs (a zombie, exited but not yet reaped by its new parent, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _kill_front_end(target: Callable[..., None], args: tuple, children: int,
                    freeze: Callable[[list[int]], list[int]]) -> None:
    """Start the front end `target`, wait for its `children` spawned processes, `freeze` some of them (SIGSTOP;
    it returns the ones left running), SIGKILL the front end: those left running must be gone within 20 s."""
    ctx = mp.get_context("spawn")
    ready = ctx.Queue()
    front = ctx.Process(target=target, args=(*args, ready))
    front.start()
    kids: list[int] = []
    try:
        ready.get(timeout=180)
        deadline = time.monotonic() + 60
        while len(kids := _spawned_children(front.pid)) < children:
            assert time.monotonic() < deadline and front.is_alive(), f"{len(kids)} of {children} children started"
            time.sleep(0.2)
        time.sleep(3.0)  # (the children past their imports, in their build or their wait)
        watched = freeze(kids)
        assert all(_running(k) for k in watched)  # (the watch leaves a live parent's children alone)
        os.kill(front.pid, signal.SIGKILL)
        front.join(30)
        deadline = time.monotonic() + 20
        while any(_running(k) for k in watched):
            assert time.monotonic() < deadline, f"{watched} outlived their killed front end"
            time.sleep(0.2)
    finally:
        front.kill()
        for k in kids:  # (a failed run leaves nothing behind; a stopped process dies by SIGKILL too)
            if _running(k):
                os.kill(k, signal.SIGKILL)


def test_a_rank_waiting_on_a_stopped_peer_exits_when_its_front_end_is_killed() -> None:
    """One rank stopped (SIGSTOP, as a hung peer): the other waits on it in a collective (rank 1 for its next plan,
    or rank 0 leaving after its pipe's EOF), so only the watch can end it once the front end is killed."""
    def stop_first(kids: list[int]) -> list[int]:
        os.kill(kids[0], signal.SIGSTOP)
        return kids[1:]

    _kill_front_end(_llm_with_two_ranks, (), 2, stop_first)


def test_an_engine_process_still_building_exits_when_the_http_side_is_killed(ckpt: Checkpoints) -> None:
    """The engine process blocked in its build (the checkpoint's weights a FIFO nobody writes: a long load): it reads
    its pipe's EOF only once it serves, so only the watch can end it once the HTTP side is killed."""
    model = ckpt.copy("base", "weights_never_arrive")
    for f in os.listdir(model):
        if f.endswith(".safetensors"):
            os.remove(os.path.join(model, f))
            os.mkfifo(os.path.join(model, f))
    _kill_front_end(_http_side, (model,), 1, lambda kids: kids)
