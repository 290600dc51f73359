"""The engine loop in a process of its own (`moebius serve --engine-process on`): the HTTP side (uvicorn, each streamed
chunk's JSON and write) and the front end (plans, outputs, detokenizing) then each have a core. In one process they
share one GIL, and at a few hundred streams the two together took more CPU a step than the device's step
(benchmarks/results/h200-p1-serve-steady768-engine-{on,off}.json, docs/performance.md "Serving").

The HTTP side holds an `EngineClient`, which has the engine loop's surface (submit, abort, call, stop, the request
counts, health); the engine process runs `run_engine`: an `EngineLoop` whose sinks (`RemoteSink`) and metrics
(`MetricsRelay`) send what they get through one `Channel`, and a thread taking the HTTP side's commands. Messages
are pickled over a multiprocessing Pipe, a socket pair between this server's own two processes (nothing from the
network). A step's events go in one message, with the engine's request counts and the metrics recorded since the
last; an update is sent as plain tuples (cheaper to pickle than dataclasses).
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing as mp
import os
import signal
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from moebius.entrypoints.openai.engine_loop import (
    Accepted,
    Admission,
    EngineInfo,
    EngineLoop,
    Event,
    Failure,
    SampleDelta,
    Sink,
    Update,
    make_request_ids,
    parse_request_id,
    post,
)
from moebius.entrypoints.openai.protocol import APIError

if TYPE_CHECKING:
    from moebius.config import EngineConfig
    from moebius.entrypoints.openai.metrics import ServerMetrics
    from moebius.frontend.core import Prompt
    from moebius.sampling_params import SamplingParams

log = logging.getLogger("moebius")

START_TIMEOUT_S = 3600.0  # a large model's weights load and its warm-up compile before "ready"


def _pack(ev: Event) -> Any:
    if isinstance(ev, Update):
        return (ev.prompt_index, ev.finished, [(d.index, d.token_ids, d.text, d.finish_reason, d.stop_reason,
                                                d.logprobs, d.cached_tokens, d.error, d.routed_experts,
                                                d.prompt_routed_experts) for d in ev.samples],
                ev.weight_version)
    return ev


def _unpack(ev: Any) -> Event:
    if isinstance(ev, tuple):
        index, finished, samples, version = ev
        return Update(index, [SampleDelta(*d) for d in samples], finished, version)
    return ev


# ---- the engine process ----
class Channel:
    """The engine process's end of the pipe. The engine thread and the command thread both send: one at a time."""

    def __init__(self, conn: Connection) -> None:
        self._conn, self._lock = conn, threading.Lock()
        self._metrics: list[tuple[str, tuple[Any, ...]]] = []
        self._loop: EngineLoop | None = None

    def watch(self, loop: EngineLoop) -> None:
        """Send this loop's state with every message: its request counts, and its error, so that a failure's 500s
        arrive with the error the HTTP side then reports (/health)."""
        self._loop = loop

    def _state(self) -> tuple[int, int, int, str | None]:
        loop = self._loop
        return (0, 0, 0, None) if loop is None else (loop.waiting, loop.in_flight, loop.running, loop.error)

    def send(self, msg: tuple[Any, ...]) -> None:
        with self._lock:
            self._conn.send(msg)

    def record(self, name: str, args: tuple[Any, ...]) -> None:
        with self._lock:
            self._metrics.append((name, args))

    def flush(self, events: list[tuple[int, Any]] | None = None) -> None:
        """Events (sink id, packed event), the loop's state and the metrics recorded since the last flush."""
        with self._lock:
            metrics, self._metrics = self._metrics, []
            if events or metrics:
                self._conn.send(("events", events or [], self._state(), metrics))

    def call_soon_threadsafe(self, fn: Callable[..., Any], batch: list[tuple[RemoteSink, Event]]) -> None:
        """As the sinks' event loop: `engine_loop.post` hands over a step's events in one call."""
        try:
            self.flush([(sink.sid, _pack(ev)) for sink, ev in batch])
        except OSError:  # the HTTP side is gone (as a closed event loop: nobody listens); this process stops next
            pass


class RemoteSink:
    """A sink of the HTTP side, by id: what the engine loop posts to it goes through the channel."""

    def __init__(self, sid: int, request_ids: list[str], channel: Channel) -> None:
        self.sid, self.request_ids, self.loop = sid, request_ids, channel


class MetricsRelay:
    """ServerMetrics' recording methods (the engine loop's: any name but flush), each call buffered as (name, args)
    for the next message; the HTTP side calls the same method of its ServerMetrics."""

    def __init__(self, channel: Channel) -> None:
        self._channel = channel

    def __getattr__(self, name: str) -> Callable[..., None]:
        if name == "flush":
            return lambda: self._channel.flush()
        return lambda *args: self._channel.record(name, args)


def run_engine(conn: Connection, config: EngineConfig, metrics: bool, parent: int | None = None) -> None:
    """The engine process: build the engine, answer "ready" (or why it could not start), then serve commands until
    "stop" (or the HTTP side is gone: its pipe's end closed, or `parent`, the HTTP process, no longer this one's, as
    when it is killed while the engine builds)."""
    # Ctrl+C, or a SIGTERM to the whole process group (systemd's stop), is the HTTP process's to handle: it drains
    # its requests, then stops this one (as the rank processes do; if it dies, its end of the pipe closes)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from moebius.frontend.core import EngineCore
    from moebius.worker.launch import exit_with_parent

    if parent is not None:
        exit_with_parent(parent)
    channel = Channel(conn)
    try:
        engine = EngineCore(config)
    except BaseException as e:  # noqa: BLE001 - the HTTP side raises it again (a bad flag, a missing file)
        kind = next((k for k in (FileNotFoundError, ValueError, TypeError) if isinstance(e, k)), RuntimeError)
        conn.send(("failed", kind.__name__, str(e) if kind is not RuntimeError else f"{type(e).__name__}: {e}"))
        return
    loop = EngineLoop(engine, MetricsRelay(channel) if metrics else None)  # type: ignore[arg-type]
    channel.watch(loop)
    conn.send(("ready", loop.info, engine.mode))
    loop.start()
    reported = False
    try:
        while True:
            if not reported and loop.error is not None:  # the loop failed: the HTTP side answers 503 from now on
                channel.send(("error", loop.error))
                reported = True
            try:
                if not conn.poll(0.2):
                    continue
                msg = conn.recv()
            except (EOFError, OSError):  # the HTTP side is gone
                return
            kind = msg[0]
            if kind == "add":
                _, sid, rids, items, param = msg
                loop.enqueue(items, RemoteSink(sid, rids, channel), param)
            elif kind == "abort":
                loop.abort(msg[1])
            elif kind == "call":
                _, cid, fn, args, admit = msg
                loop.call(fn, *args, admit_while_draining=admit).add_done_callback(
                    lambda f, cid=cid: _answer(channel, cid, f))
            elif kind == "stop":
                return
    finally:
        loop.stop()
        try:
            if loop.error is not None and not reported:
                channel.send(("error", loop.error))
            channel.flush()
            channel.send(("stopped",))
        except OSError:  # nobody is listening any more
            pass


def _answer(channel: Channel, cid: int, fut: Future) -> None:
    e = fut.exception()
    try:
        channel.send(("result", cid, e is None, fut.result() if e is None else e))
    except Exception as pe:  # noqa: BLE001 - an answer that does not pickle: its error instead
        channel.send(("result", cid, False, RuntimeError(f"{type(pe).__name__}: {pe}")))


# ---- the HTTP side ----
class EngineClient(Admission):
    """The engine loop's surface for the HTTP side, with the loop in a process of its own (started here)."""

    def __init__(self, config: EngineConfig, metrics: ServerMetrics | None = None,
                 max_waiting: int | None = None) -> None:
        self.metrics, self.max_waiting = metrics, max_waiting
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=run_engine, args=(child, config, metrics is not None, os.getpid()),
                                 name="moebius-engine")
        self._proc.start()
        child.close()
        if not self._conn.poll(START_TIMEOUT_S):
            self._proc.kill()
            raise RuntimeError(f"the engine process did not start in {START_TIMEOUT_S:.0f} s")
        try:
            msg = self._conn.recv()
        except EOFError:
            self._proc.join(5)
            raise RuntimeError(f"the engine process died while starting (exit code {self._proc.exitcode})") from None
        if msg[0] == "failed":
            self._proc.join(10)
            raise {"FileNotFoundError": FileNotFoundError, "ValueError": ValueError,
                   "TypeError": TypeError}.get(msg[1], RuntimeError)(msg[2])
        self.info: EngineInfo = msg[1]
        self.mode: str = msg[2]  # the layout it started in
        self._lock = threading.Lock()  # guards the counts, the sinks and the calls below
        self._send_lock = threading.Lock()  # the event loop, a drain's thread and callers of stop all send
        self._sinks: dict[int, tuple[Sink, set[int]]] = {}  # sink id -> (sink, prompt indices not finished)
        self._unacked: dict[int, int] = {}  # sink id -> requests the engine has not accepted or refused yet
        self._unacked_total = 0  # their sum (read without the lock by /metrics and the drain)
        self._calls: dict[int, Future] = {}
        self._counts = (0, 0, 0)  # the engine loop's (waiting, in flight, running) as of its last message
        self._ids = itertools.count()
        self._closed = False
        self.draining = False  # set by the HTTP side (a signal): new requests are refused here
        self.error: str | None = None
        self._reader = threading.Thread(target=self._read, name="moebius-engine-client", daemon=True)

    # ---- EngineLoop's surface ----
    def start(self) -> None:
        self._reader.start()

    @property
    def healthy(self) -> bool:
        return self.error is None and self._proc.is_alive()

    @property
    def waiting(self) -> int:
        return self._counts[0] + self._unacked_total

    @property
    def in_flight(self) -> int:
        return self._counts[1] + self._unacked_total

    @property
    def running(self) -> int:
        return self._counts[2]

    def submit(self, items: Sequence[tuple[Prompt, SamplingParams]], param: str = "prompt") -> Sink:
        """As EngineLoop.submit (on the event loop that reads the sink; 503 / 429 raised here)."""
        with self._lock:
            self._check_submit()
            sid = next(self._ids)
            sink = Sink(make_request_ids(sid, len(items)))
            self._sinks[sid] = (sink, set(range(len(items))))
            self._unacked[sid] = len(items)
            self._unacked_total += len(items)
        self._send(("add", sid, sink.request_ids, list(items), param))
        return sink

    def abort(self, request_ids: Sequence[str]) -> None:
        """Abort engine requests (a client went away): nothing more is posted for them."""
        with self._lock:
            for rid in request_ids:
                sid, index = parse_request_id(rid)  # submit tags a sink's requests with its id
                entry = self._sinks.get(sid)
                if entry is not None:
                    entry[1].discard(index)
                    if not entry[1]:
                        del self._sinks[sid]
                        self._unacked_total -= self._unacked.pop(sid, 0)
        self._send(("abort", list(request_ids)))

    def call(self, fn: Callable[..., Any], *args: Any, admit_while_draining: bool = False) -> Future:
        """As EngineLoop.call: fn(engine, loop, *args) runs in the engine process (fn goes by name)."""
        fut: Future = Future()
        if (refusal := self._call_refusal(admit_while_draining)) is not None:
            fut.set_exception(refusal)
            return fut
        with self._lock:
            cid = next(self._ids)
            self._calls[cid] = fut
        self._send(("call", cid, fn, args, admit_while_draining))
        return fut

    def stop(self, timeout: float = 60.0) -> None:
        """End the engine loop (requests in flight fail with 503) and its process (rank processes end with it)."""
        with self._lock:
            self._closed = True
        self._send(("stop",))
        self._proc.join(timeout)
        if self._proc.is_alive():
            log.warning("the engine process did not stop in %.0f s: killed", timeout)
            self._proc.kill()
            self._proc.join(10)
        if self._reader.is_alive():
            self._reader.join(5)
        self._fail_all(APIError(503, "the server shut down before the request finished", code="shutting_down"))

    # ---- the reader thread ----
    def _send(self, msg: tuple[Any, ...]) -> None:
        try:
            with self._send_lock:
                self._conn.send(msg)
        except (OSError, ValueError):  # the engine process is gone: the reader reports it
            pass

    def _read(self) -> None:
        while True:
            try:
                msg = self._conn.recv()
            except (EOFError, OSError):
                if not self._closed and self.error is None:
                    self._proc.join(1)
                    self.error = f"the engine process died (exit code {self._proc.exitcode})"
                    log.error("%s", self.error)
                    if self.metrics is not None:
                        self.metrics.engine_failed()
                self._fail_all(APIError(500, f"the engine failed: {self.error}", code="engine_error")
                               if self.error else APIError(503, "the server shut down", code="shutting_down"))
                return
            except Exception:  # a message that did not unpickle (read whole: the next one is intact)
                log.exception("the engine client could not read a message from the engine process")
                continue
            try:
                if self._take(msg):
                    return
            except Exception:  # a bug here must not leave every stream waiting: log it and read on
                log.exception("the engine client could not take a message from the engine process")

    def _take(self, msg: tuple[Any, ...]) -> bool:
        """One message from the engine process; True once it has stopped."""
        kind = msg[0]
        if kind == "events":
            self._events(*msg[1:])
        elif kind == "result":
            _, cid, ok, value = msg
            with self._lock:
                fut = self._calls.pop(cid, None)
            if fut is not None and fut.set_running_or_notify_cancel():
                if ok:
                    fut.set_result(value)
                else:
                    fut.set_exception(value)
        elif kind == "error":
            self.error = msg[1]
        return kind == "stopped"

    def _events(self, events: list[tuple[int, Any]], state: tuple[int, int, int, str | None],
                metrics: list[tuple[str, tuple[Any, ...]]]) -> None:
        if state[3] is not None and self.error is None:  # before its requests' 500s go out
            self.error = state[3]
        out: list[tuple[Sink, Event]] = []
        with self._lock:
            for sid, packed in events:
                ev = _unpack(packed)
                entry = self._sinks.get(sid)
                if entry is None:
                    continue
                sink, pending = entry
                if isinstance(ev, (Accepted, Failure)):
                    self._unacked_total -= self._unacked.pop(sid, 0)
                if isinstance(ev, Update) and ev.finished:
                    pending.discard(ev.prompt_index)
                if isinstance(ev, Failure) or not pending:  # nothing more comes for this sink
                    del self._sinks[sid]
                out.append((sink, ev))
            self._counts = state[:3]
        post(out)
        if self.metrics is not None:
            for name, args in metrics:
                getattr(self.metrics, name)(*args)

    def _fail_all(self, error: APIError) -> None:
        with self._lock:
            sinks, self._sinks, self._unacked = [s for s, _ in self._sinks.values()], {}, {}
            self._unacked_total = 0
            calls, self._calls = list(self._calls.values()), {}
            self._counts = (0, 0, 0)
        post([(sink, Failure(error)) for sink in sinks])
        for fut in calls:
            if fut.set_running_or_notify_cancel():
                fut.set_exception(error)
