"""Running the ranks: in this process (P = 1), as spawned processes on one machine (--num-ranks P, or one with
--rank-process on: `moebius serve` does so, since its HTTP side would share the GIL with the launches), or under
torchrun (env:// rendezvous, possibly across machines) with the front end in rank 0's process.

Every step is lockstep: rank 0 broadcasts the StepPlan (or a benchmark's probe; JSON on the CPU group), every rank
applies it (`Rank.report`), and rank 0 gathers the reports (token deltas, KV statistics, switch outcome, query
answers) into one. The front end only ever talks to rank 0.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import signal
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any, NoReturn

import torch
import torch.multiprocessing as mp

from moebius.config import ConfigError
from moebius.link.codec import decode, encode
from moebius.link.messages import DecodeProbe, PrefillProbe, Probe, StepPlan, StepReport
from moebius.parallel.groups import Groups, LoopbackRendezvous, broadcast_json, gather_json, init_groups
from moebius.worker import diagnostics, probes
from moebius.worker.build import build_rank, prepare_rank
from moebius.worker.rank import Rank, RankSpec

log = logging.getLogger("moebius")


Message = StepPlan | Probe  # what rank 0 hands every rank
_KINDS: dict[str, type] = {c.__name__: c for c in (StepPlan, DecodeProbe, PrefillProbe)}


def local_report(rank: Rank, msg: Message) -> StepReport:
    """Apply a plan on this rank (with the answer to its query), or time a probe's steps."""
    if isinstance(msg, StepPlan):
        report = rank.report(msg)
        if msg.query is not None:
            report.answers = [diagnostics.answer(rank, msg.query)]
        return report
    return StepReport([], [rank.kv_stats()], answers=[probes.run(rank, msg)])


def rank_step(rank: Rank, groups: Groups, msg: Message | None) -> tuple[bool, StepReport | None]:
    """One lockstep iteration on any rank. `msg` matters on rank 0 only, where None means shut down.
    Returns (still running, the merged report on rank 0 / None elsewhere)."""
    if groups.world_size == 1:  # a rank of its own (--rank-process on): no peers, so no JSON round trips
        return (False, None) if msg is None else (True, local_report(rank, msg))
    wire = broadcast_json(None if msg is None else [type(msg).__name__, encode(msg)], groups)
    if wire is None:
        return False, None
    report = local_report(rank, decode(_KINDS[wire[0]], wire[1]))
    gathered = gather_json(encode(report), groups)
    if gathered is None:
        return True, None
    return True, StepReport.merge([decode(StepReport, r) for r in gathered])


def _start_rank(spec: RankSpec, groups: Groups) -> tuple[Rank | None, list[dict[str, Any]]]:
    """Build this rank; all ranks learn whether every rank succeeded (errors listed on rank 0)."""
    rank, error = None, None
    try:
        rank = build_rank(spec, groups)
    except Exception as e:  # reported to the front end, which raises it there
        error = {"rank": groups.rank, "type": type(e).__name__, "message": str(e)}
        log.debug(traceback.format_exc())
    errors = gather_json(error, groups)
    errors = broadcast_json([e for e in errors if e] if errors is not None else None, groups)
    if not errors:
        assert rank is not None
        prepare_rank(rank)
    return rank, errors


def _rank_device(spec: RankSpec, local_rank: int) -> str:
    if spec.device.startswith("cuda"):
        torch.cuda.set_device(local_rank)
        return f"cuda:{local_rank}"
    return spec.device


def _serve(rank: Rank, groups: Groups, conn: Connection | None) -> None:
    """The step loop of a rank. Rank 0 relays plans from the front end's pipe and results back."""
    running, busy = True, False
    while running:
        t = time.perf_counter()
        try:
            plan = conn.recv() if conn is not None else None
        except (EOFError, ConnectionError):  # the front end is gone (closed without close(), or killed): shut down
            plan = None
        # rank 0's wait for the front end while it had requests (an idle rank's wait is no one's cost)
        waited = (time.perf_counter() - t) * 1e3 if busy else 0.0
        running, report = rank_step(rank, groups, plan)
        if conn is not None and running:
            assert report is not None
            busy = bool(report.running or report.waiting)
            conn.send(("ok", report.waited(waited)))


def exit_with_parent(parent: int) -> None:
    """Ends this process (exit status 1) once `parent` is no longer its parent. A spawned rank's front end that is
    killed cannot close its ranks: rank 0 would see its pipe's EOF only between steps, while a rank still building,
    or waiting in a collective, would wait on, holding its memory (a GPU's too) against a restart. A thread polling
    the parent id, not prctl's PR_SET_PDEATHSIG: that fires when the spawning thread ends, not its process."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="moebius-parent-watch", daemon=True).start()


def _rank_main(rank: int, world_size: int, spec: RankSpec, rendezvous: LoopbackRendezvous | None,
               conn: Connection | None, parent: int | None = None) -> None:
    """Entry of a rank process (spawned, with its rendezvous and the front end's process id; or a torchrun rank
    other than 0, with None: torchrun's agent stops its ranks itself)."""
    logging.basicConfig(level=logging.INFO, format=f"%(levelname)s rank{rank}: %(message)s")
    if parent is not None:
        exit_with_parent(parent)
    if rendezvous is not None:  # spawned: Ctrl-C, or a SIGTERM to the whole process group (systemd's default
        # stop), is the front end's to handle: a server drains its requests, then closes the ranks (a plan of None,
        # or its end of the pipe closing when it dies)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    local_rank = rank if rendezvous is not None else int(os.environ.get("LOCAL_RANK", 0))
    spec = dataclasses.replace(spec, rank=rank, world_size=world_size, device=_rank_device(spec, local_rank))
    groups = init_groups(rank, world_size, torch.device(spec.device), rendezvous)
    rank_, errors = _start_rank(spec, groups)
    if conn is not None:
        conn.send(("error", errors) if errors else ("ready", rank_.kv_capacity if rank_ else 0))
    if not errors:
        assert rank_ is not None
        _serve(rank_, groups, conn)
        rank_.destroy_graphs()
    _leave(groups)


def _leave(groups: Groups) -> None:
    """Leave the process groups together: a rank tearing down its gloo pairs while a peer still uses them can abort
    the peer ("terminate called without an active exception")."""
    if groups.world_size > 1:
        torch.distributed.barrier(group=groups.cpu)
        torch.distributed.destroy_process_group()
        gc.collect()


def serve_torchrun_rank(spec: RankSpec) -> None:
    """A torchrun rank other than 0: join, build, follow rank 0's plans until it shuts down."""
    rank, world, _ = torchrun_env() or (0, 1, 0)
    _rank_main(rank, world, spec, None, None)


class RankError(RuntimeError):
    """A rank failed (at start-up or during a step)."""


# Start-up errors raised again as their own type: the same as one rank in this process raises.
_USER_ERRORS: dict[str, type[Exception]] = {e.__name__: e for e in (ConfigError, ValueError, MemoryError,
                                                                       FileNotFoundError)}


def startup_error(errors: list[dict[str, Any]], world_size: int) -> Exception:
    """One exception for the ranks' start-up errors: a message every rank gave once, as its own type (a ConfigError
    stays one), naming the ranks only where some did not fail; different errors listed by rank in a RankError."""
    by_error: dict[tuple[str, str], list[int]] = {}
    for e in errors:
        by_error.setdefault((e["type"], e["message"]), []).append(e["rank"])
    if len(by_error) == 1:
        (kind, message), ranks = next(iter(by_error.items()))
        where = "" if len(ranks) == world_size else f"rank{'s' * (len(ranks) > 1)} {', '.join(map(str, ranks))}: "
        cls = _USER_ERRORS.get(kind)
        return cls(where + message) if cls is not None else RankError(f"{where}{kind}: {message}")
    return RankError("; ".join(f"rank{'s' * (len(r) > 1)} {', '.join(map(str, r))}: {kind}: {message}"
                               for (kind, message), r in by_error.items()))


class _InProcess:
    """Ranks whose step runs in this process when it is received: nothing to overlap with the front end's work."""

    ahead = False  # EngineCore sends no plan before it has read the step before
    _sent: Message | None = None

    def step(self, msg: Message) -> StepReport:
        raise NotImplementedError

    def send(self, msg: Message) -> None:
        self._sent = msg

    def receive(self) -> StepReport:
        msg, self._sent = self._sent, None
        assert msg is not None, "receive() before send()"
        return self.step(msg)


class LocalRanks(_InProcess):
    """P = 1: the one rank lives in this process."""

    def __init__(self, spec: RankSpec) -> None:
        self.rank = build_rank(spec)
        prepare_rank(self.rank)
        self.world_size = 1
        self.kv_capacity = self.rank.kv_capacity

    def step(self, msg: Message) -> StepReport:
        return local_report(self.rank, msg)

    def close(self) -> None:
        self.rank.destroy_graphs()


MAIN_GUARD = ("with --num-ranks > 1 (or --rank-process on) the engine spawns one process per rank, and each of "
              "them imports the main script again: build the engine under `if __name__ == \"__main__\":` in a script")


class SpawnedRanks:
    """P rank processes on this machine (spawned), joined over a TCP rendezvous on the loopback; pipe to rank 0."""

    # EngineCore may send the next plan as soon as it has a step's result: the ranks schedule and launch that step
    # while the front end detokenizes and delivers the tokens it just got
    ahead = True

    def __init__(self, spec: RankSpec, world_size: int) -> None:
        if getattr(mp.current_process(), "_inheriting", False):
            # a spawned process importing its parent's main script, which builds an engine at import time (as
            # multiprocessing itself tells it; a spawned process building one in its target, as serve's engine
            # process does, is fine)
            raise RuntimeError(MAIN_GUARD)
        ctx = mp.get_context("spawn")
        rendezvous = LoopbackRendezvous.open()
        self.world_size = world_size
        self._watchdog = spec.engine.watchdog_timeout
        self._conn, child = ctx.Pipe()
        self._procs = [ctx.Process(target=_rank_main, args=(r, world_size, spec, rendezvous.for_rank(r),
                                                             child if r == 0 else None, os.getpid()), daemon=True)
                       for r in range(world_size)]
        try:
            for p in self._procs:
                p.start()
        finally:
            rendezvous.close()  # rank 0 has its own copy of the socket
        child.close()  # only rank 0 holds that end now, so its death reads as EOF here instead of a hang
        try:
            kind, payload = self._recv()
        except RankError as e:
            self._kill()  # the survivors wait in the rendezvous for a rank that is gone
            raise RankError(f"{e}; if they failed importing your script: {MAIN_GUARD}") from None
        if kind == "error":
            self.close()  # every rank saw the errors and is leaving on its own
            raise startup_error(payload, world_size)
        self.kv_capacity = int(payload)

    def _recv(self, timeout: float | None = None) -> tuple[str, Any]:
        """Rank 0's next message. While waiting, a rank process that dies (rank 0 itself, or a peer that rank 0
        may wait on forever inside a collective) raises RankError at once; so does no answer within `timeout`
        seconds (a stuck collective), after the ranks are killed."""
        start = time.monotonic()
        try:
            while not self._conn.poll(1.0):
                if any(not p.is_alive() for p in self._procs):
                    self._died()
                if timeout and time.monotonic() - start > timeout:
                    self._kill()
                    raise RankError(f"the ranks gave no answer in {timeout:g} s (a collective stuck on a rank that "
                                    "no longer takes part?): the rank processes were stopped (--watchdog-timeout)")
            return self._conn.recv()
        except (EOFError, ConnectionError):
            self._died()

    def _died(self) -> NoReturn:
        dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
        self._kill()  # the survivors would wait in their next collective for a rank that is gone
        raise RankError(f"rank process(es) {dead or [0]} exited unexpectedly (see their log above)") from None

    def send(self, msg: Message) -> None:
        try:
            self._conn.send(msg)
        except (BrokenPipeError, ConnectionError, OSError):
            self._died()

    def receive(self) -> StepReport:
        """The report of the oldest message sent and not yet read (they are applied in the order sent)."""
        _, report = self._recv(self._watchdog)
        return report

    def _kill(self) -> None:
        for p in self._procs:
            p.kill()
        for p in self._procs:
            p.join(timeout=10)
        self._procs = []

    def close(self) -> None:
        if not self._procs:
            return
        try:
            if self._procs[0].is_alive():
                self._conn.send(None)
        except (BrokenPipeError, OSError):
            pass
        for p in self._procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        self._procs = []


class TorchrunRanks(_InProcess):
    """Under torchrun: rank 0 lives in the front end's process; the other ranks run `serve_torchrun_rank`."""

    def __init__(self, spec: RankSpec) -> None:
        rank, world, local = torchrun_env() or (0, 1, 0)
        if rank != 0:
            raise RankError("the front end runs on torchrun rank 0 only")
        spec = dataclasses.replace(spec, rank=0, world_size=world, device=_rank_device(spec, local))
        self.groups = init_groups(0, world, torch.device(spec.device), None)
        self.world_size = world
        rank, errors = _start_rank(spec, self.groups)
        if errors:
            raise startup_error(errors, world)
        assert rank is not None
        self.rank: Rank | None = rank
        self.kv_capacity = rank.kv_capacity

    def step(self, msg: Message) -> StepReport:
        assert self.rank is not None, "the ranks were closed"
        _, report = rank_step(self.rank, self.groups, msg)
        assert report is not None
        return report

    def close(self) -> None:
        if self.rank is not None:
            rank_step(self.rank, self.groups, None)
            self.rank.destroy_graphs()
            _leave(self.groups)
            self.rank = None


def torchrun_env() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) when started by torchrun, else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))
    return None
