"""The engine loop: one thread owns the EngineCore (it is not thread-safe). HTTP handlers never touch it; they send
commands through a thread-safe queue (add requests with their sink, abort, a call such as a switch or a status
snapshot), which the thread takes at step boundaries. It steps while there is work and blocks on the queue when idle
(no busy loop). The engine returns each request's outputs as deltas (`RequestOutputKind.DELTA`: new tokens and
text, never retracted); they go to the sink of their request, all of a step's in one `loop.call_soon_threadsafe`
(`post`), so nothing the engine mutates later is shared with the event loop.

If the engine raises, the loop fails every request in flight (500), answers later ones with 503, reports itself
unhealthy, closes the engine and ends: the server stays up to say so.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from moebius.entrypoints.openai.protocol import APIError
from moebius.link.lifecycle import ContextLengthError
from moebius.models.registry import family_of
from moebius.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from moebius.entrypoints.openai.metrics import ServerMetrics
    from moebius.frontend.core import EngineCore, Prompt
    from moebius.outputs import RequestOutput
    from moebius.tokenizer import Tokenizer

log = logging.getLogger("moebius")

STATS_EVERY_S = 10.0  # the stats line's period while the engine is busy



@dataclass(frozen=True)
class EngineInfo:
    """Facts about the engine that do not change while it serves, read by the HTTP side."""

    tokenizer: Tokenizer | None
    max_model_len: int
    vocab_size: int
    world_size: int
    moe_layers: tuple[bool, ...] = ()  # per decoder layer: whether it routes (routed experts' -1 rows otherwise)
    top_k: int = 0  # experts a token is routed to
    reasoning_parser: str | None = None  # the family's (`Family.reasoning_parser`)


# ---- events: engine thread -> one HTTP request ----
@dataclass(frozen=True)
class Accepted:
    request_ids: list[str]
    prompt_token_ids: list[list[int]]


@dataclass(frozen=True)
class SampleDelta:
    """What one sample got since its last update (the engine's DELTA output)."""

    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None
    stop_reason: int | str | None
    logprobs: list[dict[int, float]] | None = None  # of the new tokens (SamplingParams.logprobs)
    cached_tokens: int = 0  # its prompt tokens found in the prefix cache (known from its first token on)
    error: str | None = None  # with finish_reason "error": why it failed (the engine serves on)
    # (return_routed_experts) per new token, per MoE layer, the router's top-k ids; and the prompt's (all of it so
    # far, sent until the first token: a receiver replaces, never appends)
    routed_experts: list[list[list[int]]] | None = None
    prompt_routed_experts: list[list[list[int]]] | None = None


@dataclass(frozen=True)
class Update:
    prompt_index: int
    samples: list[SampleDelta]
    finished: bool
    weight_version: str | None = None  # of the weights the engine held when these tokens came (update_weights)


@dataclass(frozen=True)
class Failure:
    error: APIError


Event = Accepted | Update | Failure


class Sink:
    """The HTTP side's end of one request: the engine thread posts events (`post`), the event loop reads them."""

    def __init__(self, request_ids: list[str]) -> None:
        self.request_ids = request_ids  # the engine requests' ids, known before the engine admits them
        self.loop = asyncio.get_running_loop()
        # (a deque and one future: an asyncio.Queue's bookkeeping showed in the event loop's profile when streaming)
        self._events: collections.deque[Event] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None

    def receive(self, event: Event) -> None:
        """On the event loop: queue an event for the reader."""
        self._events.append(event)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def _ready(self) -> None:
        while not self._events:
            self._waiter = self.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    async def get(self) -> Event:
        """The next event (waits for one)."""
        await self._ready()
        return self._events.popleft()

    async def get_all(self) -> list[Event]:
        """Every event queued, in order (waits for at least one)."""
        await self._ready()
        out = list(self._events)
        self._events.clear()
        return out


class EventSink(Protocol):
    """Where the engine thread posts a request's events: a Sink, or (the engine in a process of its own) a sink of
    the HTTP side by id, whose `loop` is the pipe (engine_process.RemoteSink)."""

    request_ids: list[str]
    loop: Any  # has call_soon_threadsafe(fn, batch): _receive_all on an event loop, or the pipe's send


def _receive_all(events: list[tuple[Sink, Event]]) -> None:
    for sink, event in events:
        sink.receive(event)


def post(events: Sequence[tuple[EventSink, Event]]) -> None:
    """From the engine thread: hand events to their sinks, in order, with one wake-up of each event loop however many
    there are. A wake-up writes to the loop's socket and gives up the GIL, so that the HTTP side, busy streaming, may
    hold it for a switch interval: one a request each step (256 a step at 256 streams) held the engine for
    milliseconds."""
    by_loop: dict[Any, list[tuple[EventSink, Event]]] = {}
    for sink, event in events:
        by_loop.setdefault(sink.loop, []).append((sink, event))
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_receive_all, batch)
        except RuntimeError:  # the event loop is closed (shut down): nobody is listening any more
            pass


# ---- commands: HTTP side -> engine thread ----
@dataclass
class _Add:
    items: list[tuple[Prompt, SamplingParams]]
    sink: EventSink
    param: str


@dataclass
class _Abort:
    request_ids: list[str]


@dataclass
class _Call:
    fn: Callable[..., Any]  # fn(engine, loop, *args)
    args: tuple[Any, ...]
    future: Future


class _Stop:
    pass


@dataclass
class _Route:
    """Where one engine request's outputs go, and what its metrics need of them."""

    sink: EventSink
    prompt_index: int
    cached: list[int]  # per sample: prompt tokens found in the prefix cache
    started: bool = False  # its first token is out
    # the first sample's: its tokens, when its first and last came, how it ended
    first_tokens: int = 0
    first_times: tuple[float, float] | None = None
    first_reason: str | None = None


def make_request_ids(tag: int, n: int) -> list[str]:
    """The engine requests' ids of one submission: r{tag}-{prompt index}."""
    return [f"r{tag}-{i}" for i in range(n)]


def parse_request_id(rid: str) -> tuple[int, int]:
    """(tag, prompt index) of an id made by make_request_ids."""
    tag, index = rid[1:].split("-")
    return int(tag), int(index)


class Admission:
    """What the HTTP side may hand the engine, the same for the loop in this process and the client of one in its
    own: nothing once it failed or is closing (503), no new request while max_waiting wait (429), and operator
    calls that admit_while_draining (a status read) until it is closed. Subclasses keep the flags and the count of
    requests waiting."""

    error: str | None
    draining: bool
    max_waiting: int | None
    metrics: ServerMetrics | None
    _closed: bool

    @property
    def waiting(self) -> int:
        raise NotImplementedError

    def _refusal(self) -> APIError | None:
        if self.error is not None:
            return APIError(503, f"the engine failed and serves no more requests ({self.error})", code="engine_dead")
        if self._closed or self.draining:
            return APIError(503, "the server is shutting down", code="shutting_down")
        return None

    def _check_submit(self) -> None:
        """Raise the 503 or 429 a submission gets now (under the subclass's lock), counted in the metrics."""
        refusal = self._refusal()
        if refusal is None and self.max_waiting is not None and self.waiting >= self.max_waiting:
            refusal = APIError(429, f"the server is busy: {self.waiting} requests are waiting to start (limit "
                               f"{self.max_waiting}); retry later", code="rate_limit_exceeded",
                               headers={"Retry-After": "1"})
        if refusal is not None:
            if self.metrics is not None:
                self.metrics.refused(refusal.code or str(refusal.status))
            raise refusal

    def _call_refusal(self, admit_while_draining: bool) -> APIError | None:
        refusal = self._refusal()
        if refusal is not None and admit_while_draining and self.error is None and not self._closed:
            return None
        return refusal


class EngineLoop(Admission):
    def __init__(self, engine: EngineCore, metrics: ServerMetrics | None = None,
                 max_waiting: int | None = None) -> None:
        self._engine = engine
        mc = engine.model_config
        self.info = EngineInfo(engine.tokenizer, engine.max_model_len, mc.vocab_size, engine.world_size,
                               tuple(mc.is_moe_layer(i) for i in range(mc.num_layers)), mc.top_k,
                               family_of(mc).reasoning_parser)
        self.metrics, self.max_waiting = metrics, max_waiting
        self._commands: queue.SimpleQueue[_Add | _Abort | _Call | _Stop] = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards the counters and flags below, and orders puts against shutdown
        self._waiting = 0  # engine requests submitted that have no token yet
        self._in_flight = 0  # engine requests submitted and not finished
        self._running = 0  # engine requests with a token out, not finished
        self._closed = False  # no more submissions (draining, stopped or failed)
        self.draining = False
        self.error: str | None = None
        self._routes: dict[str, _Route] = {}  # engine thread only
        # engine thread only: the auto-mode settings /admin/policy last applied (None: the engine's flags so far)
        self.policy_settings: dict[str, Any] | None = None
        self._tokens_out = 0  # engine thread only: tokens delivered, for the stats line
        self._stats_at = (time.perf_counter(), 0)  # (when, tokens) of the last stats line
        self._tags = itertools.count()
        self._switches_seen = len(engine.timeline.switches)
        self._preemptions_seen = 0
        self._version_seen: str | None = None  # the weight version /metrics was last given
        self._thread = threading.Thread(target=self._run, name="moebius-engine-loop", daemon=True)
        if metrics is not None:
            metrics.set_layout(engine.mode)

    # ---- the HTTP side (any thread) ----
    def start(self) -> None:
        self._thread.start()

    @property
    def healthy(self) -> bool:
        return self.error is None and self._thread.is_alive()

    @property
    def waiting(self) -> int:
        return self._waiting

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def running(self) -> int:
        return self._running

    def submit(self, items: Sequence[tuple[Prompt, SamplingParams]], param: str = "prompt") -> Sink:
        """Queue engine requests (validated, then admitted together, or refused together with a 400 Failure).
        Must be called on the event loop that reads the sink. Raises APIError 503 / 429."""
        with self._lock:
            self._check_submit()
            sink = Sink(make_request_ids(next(self._tags), len(items)))
            self._queue_add(items, sink, param)
        return sink

    def enqueue(self, items: Sequence[tuple[Prompt, SamplingParams]], sink: EventSink, param: str = "prompt"
                ) -> None:
        """`submit` for a sink made elsewhere (an engine in a process of its own: the HTTP side checked the limits);
        a refusal is posted to the sink as a Failure."""
        with self._lock:
            if (refusal := self._refusal()) is None:
                self._queue_add(items, sink, param)
        if refusal is not None:
            post([(sink, Failure(refusal))])

    def _queue_add(self, items: Sequence[tuple[Prompt, SamplingParams]], sink: EventSink, param: str) -> None:
        self._waiting += len(items)
        self._in_flight += len(items)
        self._commands.put(_Add(list(items), sink, param))

    def abort(self, request_ids: Sequence[str]) -> None:
        """Abort engine requests (a client went away); their KV pages are freed at the next step."""
        with self._lock:
            if not self._closed:
                self._commands.put(_Abort(list(request_ids)))

    def call(self, fn: Callable[..., Any], *args: Any, admit_while_draining: bool = False) -> Future:
        """Run fn(engine, this loop, *args) on the engine thread at the next step boundary; its result or exception
        in the future. fn: a module-level function (entrypoints/openai/control.py), so that it can be sent by name."""
        fut: Future = Future()
        with self._lock:
            if (refusal := self._call_refusal(admit_while_draining)) is not None:
                fut.set_exception(refusal)
            else:
                self._commands.put(_Call(fn, args, fut))
        return fut

    def stop(self, timeout: float = 60.0) -> None:
        """End the loop (requests still in flight fail with 503) and close the engine (rank processes end)."""
        with self._lock:
            self.draining = True
            if not self._closed:
                self._commands.put(_Stop())
        if self._thread.is_alive():
            self._thread.join(timeout)
        elif not self._thread.ident:  # never started: the engine is still ours to close
            self._engine.close()

    @property
    def paused(self) -> bool:
        """Whether the engine is paused (pause_generation): requests are taken, no step runs."""
        return self._engine.paused

    def pause(self, mode: str) -> None:
        """On the engine thread (through `call`): stop stepping until `resume` (`EngineCore.pause_generation`: the
        steps already sent to the ranks are read first; mode abort ends every request, its partial tokens delivered
        now; retract frees their KV; keep leaves them; wait steps here until every request has finished, each step's
        outputs delivered as it comes, while new requests wait in the queue); requests keep coming in."""
        engine = self._engine
        if mode == "wait" and engine.has_unfinished():  # no step runs while memory is released
            engine.check_resident("pause with mode wait would wait forever")
        if mode == "wait":  # (from a pause already in place too: its requests run to their end)
            engine.resume_generation()
        while mode == "wait" and engine.has_unfinished():
            self._deliver(engine.step())
            self._publish()
        self._deliver(engine.pause_generation(mode))

    def resume(self) -> None:
        self._engine.resume_generation()

    def abort_requests(self, request_ids: list[str]) -> int:
        """On the engine thread: abort these engine requests, their answers kept (finish_reason abort, the tokens
        each had, delivered now), unlike `abort` (a client gone); how many were live."""
        live = [rid for rid in request_ids if rid in self._routes]
        if live:
            before = self._engine.settle()  # the steps in flight first: their tokens belong to the partial answers
            for rid in live:
                self._engine.abort(rid)
            self._deliver(before + self._release())
        return len(live)

    def abort_all(self) -> int:
        """On the engine thread: abort every request in flight (finish_reason abort, the tokens each had, delivered
        now); how many."""
        ids = self._engine.abort_all()
        self._deliver(self._release())
        return len(ids)

    def _release(self) -> list[RequestOutput]:
        """The outputs of what was just aborted; while paused or released (no step comes to do it) their pages are
        freed now."""
        return self._engine.step() if self._engine.held else self._engine.settle()

    # ---- the engine thread ----
    def _run(self) -> None:
        engine = self._engine
        try:
            while True:
                for cmd in self._take(block=engine.held or not engine.has_unfinished()):
                    if isinstance(cmd, _Stop):
                        return
                    self._handle(cmd)
                if engine.has_unfinished() and not engine.held:
                    self._deliver(engine.step())
                    if self.metrics is not None:
                        for times in engine.take_times():  # every step taken in, however many this call did
                            self.metrics.step(times)
                    self._log_stats()
                self._publish()
        except BaseException as e:  # noqa: B036 - reported to every request and to /health, never silent
            log.exception("the engine loop failed; the server now answers 503")
            self._fail(e)
        finally:
            self._shutdown()

    def _take(self, block: bool) -> list[_Add | _Abort | _Call | _Stop]:
        cmds = [self._commands.get()] if block else []
        while True:
            try:
                cmds.append(self._commands.get_nowait())
            except queue.Empty:
                return cmds

    def _handle(self, cmd: _Add | _Abort | _Call) -> None:
        if isinstance(cmd, _Add):
            self._add(cmd)
        elif isinstance(cmd, _Abort):
            for rid in cmd.request_ids:
                route = self._routes.pop(rid, None)
                if route is not None:
                    self._engine.abort(rid)
                    self._settle(route)
                    if self.metrics is not None:
                        self.metrics.aborted()
        elif cmd.future.set_running_or_notify_cancel():
            try:
                cmd.future.set_result(cmd.fn(self._engine, self, *cmd.args))
            except Exception as e:  # the caller's error (e.g. a bad switch target); the engine goes on
                cmd.future.set_exception(e)

    def _add(self, cmd: _Add) -> None:
        engine, many = self._engine, len(cmd.items) > 1
        checked = []
        for i, (prompt, params) in enumerate(cmd.items):
            try:
                checked.append(engine.validate(prompt, params))
            except (ValueError, TypeError) as e:
                with self._lock:
                    self._waiting -= len(cmd.items)
                    self._in_flight -= len(cmd.items)
                param = "max_tokens" if isinstance(e, ContextLengthError) and e.max_tokens_at_fault else cmd.param
                post([(cmd.sink, Failure(APIError(400, f"prompt {i}: {e}" if many else str(e), param=param)))])
                return
        ids = []
        for i, ((prompt, params), valid) in enumerate(zip(cmd.items, checked, strict=True)):
            rid = cmd.sink.request_ids[i]
            engine.add_request(prompt, params, request_id=rid, validated=valid, output_kind=RequestOutputKind.DELTA)
            self._routes[rid] = _Route(cmd.sink, i, [0] * params.n)
            ids.append(rid)
            if self.metrics is not None:
                self.metrics.admitted(len(valid[1]))
        post([(cmd.sink, Accepted(ids, [v[1] for v in checked]))])

    def _settle(self, route: _Route) -> None:
        with self._lock:
            self._in_flight -= 1
            if route.started:
                self._running -= 1
            else:
                self._waiting -= 1

    def _deliver(self, outs: list[RequestOutput]) -> None:
        m, now = self.metrics, time.perf_counter()
        events: list[tuple[EventSink, Event]] = []
        tokens_before = self._tokens_out
        for out in outs:
            route = self._routes.get(out.request_id)
            if route is None:  # aborted: its client is gone
                continue
            samples = []
            for o in out.outputs:
                route.cached[o.index] = o.num_cached_tokens
                self._tokens_out += len(o.token_ids)
                if o.index == 0:
                    route.first_reason = o.finish_reason
                    route.first_tokens += len(o.token_ids)
                    if o.token_times:
                        start = route.first_times[0] if route.first_times else o.token_times[0]
                        route.first_times = (start, o.token_times[-1])
                samples.append(SampleDelta(o.index, o.token_ids, o.text, o.finish_reason, o.stop_reason, o.logprobs,
                                           o.num_cached_tokens, o.error, o.routed_experts,
                                           o.prompt_routed_experts))
            if not route.started and any(o.token_ids for o in out.outputs):
                route.started = True
                with self._lock:
                    self._waiting -= 1
                    self._running += 1
                if m is not None and out.ttft is not None:
                    m.first_token(out.ttft)
            events.append((route.sink, Update(route.prompt_index, samples, out.finished, out.weight_version)))
            if out.finished:
                del self._routes[out.request_id]
                self._settle(route)
                if m is not None:
                    first = route.first_times
                    m.finished(route.first_reason, out.arrival_time, first[0] if first else None,
                               first[1] if first else None, route.first_tokens, now)
                    m.prefix_cache(out.num_prompt_tokens * len(route.cached), sum(route.cached))
        post(events)
        if m is not None:  # once a step: a Prometheus counter takes a lock each time
            m.generated(self._tokens_out - tokens_before)

    def _log_stats(self) -> None:
        """A line every STATS_EVERY_S seconds while busy: throughput, requests, KV use, layout."""
        now = time.perf_counter()
        t0, n0 = self._stats_at
        if now - t0 < STATS_EVERY_S:
            return
        engine, kv = self._engine, self._engine.kv_stats()
        total = int(kv["total_tokens"])  # type: ignore[call-overload]
        used = 1.0 - int(kv["free_tokens"]) / total if total else 0.0  # type: ignore[call-overload]
        log.info("%.1f tokens/s generated, %d running, %d waiting, KV %.1f%% used, layout %s%s",
                 (self._tokens_out - n0) / (now - t0), self._running, self._waiting, 100 * used, engine.mode,
                 " (paused)" if self.paused else "")
        self._stats_at = (now, self._tokens_out)

    def _publish(self) -> None:
        m = self.metrics
        if m is None:
            return
        engine = self._engine
        kv = engine.kv_stats()
        total, free = int(kv["total_tokens"]), int(kv["free_tokens"])  # type: ignore[call-overload]
        preempted = int(kv["preemptions"])  # type: ignore[call-overload]
        m.state(self._running, self._waiting, 1.0 - free / total if total else 0.0, preempted - self._preemptions_seen)
        self._preemptions_seen = preempted
        switches = engine.timeline.switches
        if len(switches) > self._switches_seen:
            for ev in itertools.islice(switches, self._switches_seen, None):
                if ev.done and ev.total_ms is None:
                    break  # its device times come with the next step: recorded then
                m.switch(ev.source, ev.target, ev.done, {"total": ev.total_ms, "weights": ev.weights_ms,
                                                         "kv": ev.kv_ms})
                self._switches_seen += 1
            m.set_layout(engine.mode)
        if engine.weight_version != self._version_seen:
            m.set_weight_version(engine.weight_version)
            self._version_seen = engine.weight_version
        m.flush()

    def _fail(self, e: BaseException) -> None:
        msg = f"{type(e).__name__}: {e}"
        with self._lock:
            self.error = msg
            self._closed = True
        if self.metrics is not None:
            self.metrics.engine_failed()
        failed = Failure(APIError(500, f"the engine failed: {msg}", code="engine_error"))
        post([(route.sink, failed) for route in self._routes.values()])
        self._routes.clear()

    def _shutdown(self) -> None:
        with self._lock:  # after this no command is queued any more
            self._closed = True
            self._waiting = self._in_flight = self._running = 0
        gone = APIError(503, "the server shut down before the request finished", code="shutting_down")
        post([(route.sink, Failure(gone)) for route in self._routes.values()])
        self._routes.clear()
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(cmd, _Add):
                post([(cmd.sink, Failure(self._refusal() or gone))])
            elif isinstance(cmd, _Call) and cmd.future.set_running_or_notify_cancel():
                cmd.future.set_exception(self._refusal() or gone)
        try:
            self._engine.close()
        except Exception:
            log.exception("closing the engine failed")
