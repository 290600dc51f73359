"""Running the ranks: in this process (P = 1), as spawned processes on one machine (--num-ranks P), or under
torchrun (env:// rendezvous, possibly across machines) with the front end in rank 0's process.

Every step is lockstep: rank 0 broadcasts the StepPlan (JSON on the CPU group), every rank runs `Worker.step`,
and rank 0 gathers the token deltas and KV statistics. The front end only ever talks to rank 0.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import socket
import traceback
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.multiprocessing as mp

from moebius.engine.request import RequestSpec
from moebius.engine.worker import StepPlan, TokenDelta, Worker, WorkerSpec
from moebius.parallel.groups import Groups, broadcast_json, gather_json, init_groups, tensor_from_json, tensor_to_json

log = logging.getLogger("moebius")

# ---- JSON forms of the control messages ----
def plan_to_json(plan: StepPlan) -> dict[str, Any]:
    return dict(new=[spec.to_json() for spec in plan.new], owners=plan.owners, aborts=plan.aborts,
                retired=plan.retired, switch_to=plan.switch_to, run=plan.run, query=plan.query)


def plan_from_json(msg: dict[str, Any]) -> StepPlan:
    return StepPlan([RequestSpec.from_json(d) for d in msg["new"]], msg["owners"], msg["aborts"], msg["retired"],
                    msg["switch_to"], msg["run"], msg["query"])


def delta_to_json(d: TokenDelta) -> dict[str, Any]:
    return dict(request_id=d.request_id, new_token_ids=d.new_token_ids, finish_reason=d.finish_reason,
                stop_reason=d.stop_reason, prompt_logits=tensor_to_json(d.prompt_logits))


def delta_from_json(m: dict[str, Any]) -> TokenDelta:
    return TokenDelta(m["request_id"], m["new_token_ids"], m["finish_reason"], m["stop_reason"],
                      tensor_from_json(m["prompt_logits"]))


@dataclasses.dataclass
class StepResult:
    deltas: list[TokenDelta]
    kv: list[dict[str, int]]  # per rank: free_tokens, total_tokens
    switch: dict[str, Any] | None = None  # rank 0's switch outcome, when the plan asked for a switch
    query: list[Any] | None = None  # per rank answers, when the plan asked a query
    # rank 0's device times of a switch that rode on the step before (Switcher.pass_times): they come a step late
    switch_times: dict[str, Any] | None = None


def _kv(worker: Worker) -> dict[str, int]:
    a = worker.allocator
    return {"free_tokens": a.free_tokens, "total_tokens": a.total_tokens}


def local_step(worker: Worker, plan: StepPlan) -> tuple[list[TokenDelta], dict[str, Any]]:
    """Run a plan on this rank; returns the deltas it reports and its report (KV stats, switch outcome, query).

    In TP every rank computes the same tokens and only rank 0 reports them; in EP each rank reports its own. Deltas
    from before a switch (aborts) are reported by the old layout's rule, those of the step by the new one's."""
    first = worker.mode == "ep" or worker.groups.rank == 0
    before, after, outcome = worker.step(plan)
    second = worker.mode == "ep" or worker.groups.rank == 0
    report = {"kv": _kv(worker), "switch": outcome, "query": worker.query(plan.query) if plan.query else None,
              "switch_times": worker.late_switch_times}
    return (before if first else []) + (after if second else []), report


def rank_step(worker: Worker, groups: Groups, plan: StepPlan | None) -> tuple[bool, StepResult | None]:
    """One lockstep iteration on any rank. `plan` matters on rank 0 only, where None means shut down.
    Returns (still running, the gathered result on rank 0 / None elsewhere)."""
    msg = broadcast_json(None if plan is None else plan_to_json(plan), groups)
    if msg is None:
        return False, None
    deltas, report = local_step(worker, plan_from_json(msg))
    report["deltas"] = [delta_to_json(d) for d in deltas]
    gathered = gather_json(report, groups)
    if gathered is None:
        return True, None
    return True, StepResult([delta_from_json(d) for r in gathered for d in r["deltas"]], [r["kv"] for r in gathered],
                            gathered[0]["switch"], [r["query"] for r in gathered], gathered[0]["switch_times"])


def _start_rank(spec: WorkerSpec, groups: Groups) -> tuple[Worker | None, list[str]]:
    """Build this rank's worker; all ranks learn whether every rank succeeded (errors listed on rank 0)."""
    worker, error = None, None
    try:
        worker = Worker(spec, groups)
    except Exception as e:  # reported to the front end, which raises it there
        error = f"rank {groups.rank}: {type(e).__name__}: {e}"
        log.debug(traceback.format_exc())
    errors = gather_json(error, groups)
    errors = broadcast_json([e for e in errors if e] if errors is not None else None, groups)
    if not errors:
        assert worker is not None
        worker.prepare_runtime()
    return worker, errors


def _rank_device(spec: WorkerSpec, local_rank: int) -> str:
    if spec.device.startswith("cuda"):
        torch.cuda.set_device(local_rank)
        return f"cuda:{local_rank}"
    return spec.device


def _serve(worker: Worker, groups: Groups, conn: Connection | None) -> None:
    """The step loop of a rank. Rank 0 relays plans from the front end's pipe and results back."""
    running = True
    while running:
        plan = conn.recv() if conn is not None else None
        running, result = rank_step(worker, groups, plan)
        if conn is not None and running:
            conn.send(("ok", result))


def _rank_main(rank: int, world_size: int, spec: WorkerSpec, init_method: str | None,
               conn: Connection | None) -> None:
    """Entry of a rank process (spawned, or a torchrun rank other than 0)."""
    logging.basicConfig(level=logging.INFO, format=f"%(levelname)s rank{rank}: %(message)s")
    local_rank = rank if init_method is not None else int(os.environ.get("LOCAL_RANK", 0))
    spec = dataclasses.replace(spec, rank=rank, world_size=world_size, device=_rank_device(spec, local_rank))
    groups = init_groups(rank, world_size, torch.device(spec.device), init_method)
    worker, errors = _start_rank(spec, groups)
    if conn is not None:
        conn.send(("error", errors) if errors else ("ready", worker.kv_capacity if worker else 0))
    if not errors:
        assert worker is not None
        _serve(worker, groups, conn)
        worker.destroy_graphs()
    _leave(groups)


def _leave(groups: Groups) -> None:
    """Leave the process groups together: a rank tearing down its gloo pairs while a peer still uses them can abort
    the peer ("terminate called without an active exception")."""
    if groups.world_size > 1:
        torch.distributed.barrier(group=groups.cpu)
        torch.distributed.destroy_process_group()
        gc.collect()


def serve_torchrun_rank(spec: WorkerSpec) -> None:
    """A torchrun rank other than 0: join, build, follow rank 0's plans until it shuts down."""
    rank, world, _ = torchrun_env() or (0, 1, 0)
    _rank_main(rank, world, spec, None, None)


class RankError(RuntimeError):
    """A rank failed (at start-up or during a step)."""


class LocalRanks:
    """P = 1: the one rank lives in this process."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.worker = Worker(spec)
        self.worker.prepare_runtime()
        self.world_size = 1
        self.kv_capacity = self.worker.kv_capacity

    def step(self, plan: StepPlan) -> StepResult:
        deltas, report = local_step(self.worker, plan)
        return StepResult(deltas, [report["kv"]], report["switch"], [report["query"]], report["switch_times"])

    def close(self) -> None:
        self.worker.destroy_graphs()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SpawnedRanks:
    """P rank processes on this machine (spawned), joined over a local TCP rendezvous; pipe to rank 0."""

    def __init__(self, spec: WorkerSpec, world_size: int) -> None:
        ctx = mp.get_context("spawn")
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        self.world_size = world_size
        self._conn, child = ctx.Pipe()
        self._procs = [ctx.Process(target=_rank_main, args=(r, world_size, spec, init_method,
                                                             child if r == 0 else None), daemon=True)
                       for r in range(world_size)]
        for p in self._procs:
            p.start()
        child.close()  # only rank 0 holds that end now, so its death reads as EOF here instead of a hang
        try:
            kind, payload = self._recv()
        except RankError:
            self._kill()  # the survivors wait in the rendezvous for a rank that is gone
            raise
        if kind == "error":
            self.close()  # every rank saw the errors and is leaving on its own
            raise RankError("; ".join(payload))
        self.kv_capacity = int(payload)

    def _recv(self) -> tuple[str, Any]:
        try:
            return self._conn.recv()
        except (EOFError, ConnectionError):
            dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
            raise RankError(f"rank process(es) {dead or [0]} exited unexpectedly (see their log above)") from None

    def step(self, plan: StepPlan) -> StepResult:
        try:
            self._conn.send(plan)
        except (BrokenPipeError, ConnectionError, OSError):
            dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
            raise RankError(f"rank process(es) {dead or [0]} exited unexpectedly (see their log above)") from None
        _, result = self._recv()
        return result

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


class TorchrunRanks:
    """Under torchrun: rank 0 lives in the front end's process; the other ranks run `serve_torchrun_rank`."""

    def __init__(self, spec: WorkerSpec) -> None:
        rank, world, local = torchrun_env() or (0, 1, 0)
        if rank != 0:
            raise RankError("the front end runs on torchrun rank 0 only")
        spec = dataclasses.replace(spec, rank=0, world_size=world, device=_rank_device(spec, local))
        self.groups = init_groups(0, world, torch.device(spec.device), None)
        self.world_size = world
        worker, errors = _start_rank(spec, self.groups)
        if errors:
            raise RankError("; ".join(errors))
        assert worker is not None
        self.worker = worker
        self.kv_capacity = worker.kv_capacity

    def step(self, plan: StepPlan) -> StepResult:
        _, result = rank_step(self.worker, self.groups, plan)
        assert result is not None
        return result

    def close(self) -> None:
        if self.worker is not None:
            rank_step(self.worker, self.groups, None)
            self.worker.destroy_graphs()
            _leave(self.groups)
            self.worker = None


def torchrun_env() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) when started by torchrun, else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))
    return None
