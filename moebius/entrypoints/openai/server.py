"""`moebius serve`: the command line, start-up, and the graceful shutdown. SIGTERM / SIGINT: new requests get 503
(and /health too), requests in flight run to their end (at most --shutdown-timeout seconds; what is left then fails with
503), the engine closes (its rank processes end), and the process exits 0. A second signal stops at once. If the engine
fails (a rank process died, the watchdog found a stuck step), requests in flight end with the error, the server
answers 503 for a few seconds (so clients and health checks see why), logs the cause and exits 1 for a supervisor to
restart it.

The web packages are imported only when the server starts, so `moebius --help` works without them."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib
import logging
import math
import time
from typing import TYPE_CHECKING, Any

from moebius.config import EngineConfig, HelpFormatter
from moebius.entrypoints.openai.reasoning import PARSERS
from moebius.entrypoints.openai.tool_calls import PARSERS as TOOL_PARSERS
from moebius.worker.build import freeze_heap

if TYPE_CHECKING:
    import uvicorn

    from moebius.entrypoints.openai.engine_loop import EngineLoop
    from moebius.entrypoints.openai.engine_process import EngineClient

log = logging.getLogger("moebius")

DEMO_MODEL_NAME = "moebius-demo"
FAILED_EXIT_AFTER_S = 3.0  # after the engine fails: answering 503 this long before the port closes


HEADER_TIMEOUT_S = 30.0  # a client has this long to send a request's headers (a slow-loris holds no connection)


def _port(value: str) -> int:
    try:
        port = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a port number (1-65535), got {value!r}") from None
    if not 1 <= port <= 65535:  # the OS would take 99999 modulo 65536 and listen on 34463
        raise argparse.ArgumentTypeError(f"must be a port number (1-65535), got {port}")
    return port


def _model_name(value: str) -> str:
    if not value.strip():  # clients could not name it
        raise argparse.ArgumentTypeError(f"must be a non-empty name, got {value!r}")
    return value


def _host(value: str) -> str:
    if not value.strip():  # "" would bind every interface, unsaid
        raise argparse.ArgumentTypeError(f"must be an address (127.0.0.1, 0.0.0.0 for every interface), got {value!r}")
    return value


def _seconds(value: str, least: float = 0.0, open_below: bool = True) -> float:
    """A finite number of seconds above `least` (or at least it, with open_below False)."""
    bound = f"above {least:g}" if open_below else f"at least {least:g}"
    try:
        seconds = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds {bound}, got {value!r}") from None
    if not math.isfinite(seconds) or seconds < least or (open_below and seconds == least):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds {bound}, got {value!r}")
    return seconds


def _drain_seconds(value: str) -> float:
    return _seconds(value, open_below=False)


def _positive_int(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {value!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """The `serve` subcommand (sub: the subparsers of the `moebius` parser)."""
    p = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API (completions, chat, metrics, admin)",
                       description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health, /version, "
                       "/metrics and the operator endpoints /admin/switch, /admin/policy, /admin/pause, "
                       "/admin/resume and /admin/status on one port. With no --model, serves the small built-in model "
                       "(random weights: its text is meaningless). --api-key protects every route but /health.",
                       formatter_class=HelpFormatter)
    http = p.add_argument_group("server")
    http.add_argument("--host", type=_host, default="127.0.0.1", help="address to bind (0.0.0.0: every interface)")
    http.add_argument("--port", type=_port, default=8000, help="port to bind (1-65535)")
    http.add_argument("--served-model-name", type=_model_name, default=None,
                      help=f"the name clients send as `model` (default: the --model value, or {DEMO_MODEL_NAME!r})")
    http.add_argument("--reasoning-parser", choices=("auto", "none", *PARSERS), default="auto",
                      help="split chat answers into `reasoning_content` and `content`: deepseek_r1 (up to </think>), "
                      "qwen3 (<think> ... </think>), openai_gptoss (harmony's analysis channel); auto: the model "
                      "family's (GPT-OSS: openai_gptoss; the others: none)")
    http.add_argument("--enable-auto-tool-choice", action="store_true",
                      help="answer chat requests with tools (tool_choice auto) with the model's calls parsed into "
                      "`tool_calls` by --tool-call-parser (without it such requests are refused, as in vLLM)")
    http.add_argument("--tool-call-parser", choices=tuple(TOOL_PARSERS), default=None,
                      help="the tool-call format of the model: hermes (Qwen3, Qwen2.5: <tool_call>{json}</tool_call>) "
                      "or openai (GPT-OSS: harmony messages to functions.NAME, read by its reasoning parser)")
    http.add_argument("--max-waiting-requests", type=_positive_int, default=None,
                      help="answer 429 while this many requests wait for their first token (default: no limit)")
    http.add_argument("--shutdown-timeout", type=_drain_seconds, default=30.0,
                      help="seconds a shutdown waits for requests in flight to finish")
    http.add_argument("--header-timeout", type=_seconds, default=HEADER_TIMEOUT_S,
                      help="seconds a connection has to send a request's headers, from when it opens or its last "
                      "answer ends; then it is closed (a client that never finishes them holds no connection)")
    http.add_argument("--disable-uvicorn-access-log", action="store_true",
                      help="no log line for each HTTP request answered")
    http.add_argument("--engine-process", choices=("on", "off"), default="on",
                      help="on: the engine loop (front end, and through it the rank processes) in a process of its "
                      "own, so that it and the HTTP side each have a core; off: a thread of the server's process")
    # the operator endpoints are on --port itself: the offline engine's separate admin server has no place here
    EngineConfig.add_cli_args(p, exclude=("admin_port", "admin_host"))
    # a busy front end: two plans ahead keep the ranks from waiting on it (measured with the front end sharing its
    # process with the HTTP side: benchmarks/results/h200-p1-serve-steady384-plans{1,2}.json)
    p.set_defaults(plans_ahead=2)
    return p


def http_stack() -> dict[str, str]:
    """uvicorn's event loop and HTTP protocol, chosen here rather than left to uvicorn's "auto": uvloop and httptools,
    which the serve extra installs (they cut the front end's CPU time per streamed token, and the front end's CPU
    bounds how many streams it serves), else asyncio and h11 (pure Python)."""
    stack: dict[str, str] = {}
    for key, fast, plain in (("loop", "uvloop", "asyncio"), ("http", "httptools", "h11")):
        try:
            importlib.import_module(fast)
        except ImportError:
            stack[key] = plain
        else:
            stack[key] = fast
    return stack


class _HeaderDeadline:
    """Mixed into uvicorn's HTTP protocol: a connection that has not sent a whole request head `header_timeout`
    seconds after it opened, or after its last answer ended, is closed. uvicorn's keep-alive timeout covers only a
    connection that sends nothing after an answer (any byte cancels it) and nothing covers one that never finishes
    its first request line: such clients could hold connections (and file descriptors) forever."""

    header_timeout: float = HEADER_TIMEOUT_S
    _header_timer: asyncio.TimerHandle | None = None
    # uvicorn's protocol's own attributes, used here
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport
    cycle: Any

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._arm_header_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        self._arm_header_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        super().connection_lost(exc)  # type: ignore[misc]

    def _arm_header_deadline(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        self._header_timer = None
        if not self.transport.is_closing():
            self._header_timer = self.loop.call_later(self.header_timeout, self._headers_overdue)

    def _headers_overdue(self) -> None:
        self._header_timer = None
        if self.cycle is not None and not self.cycle.response_complete:
            return  # a request came in time and is being answered; the deadline is armed again when it ends
        if not self.transport.is_closing():
            log.debug("closing a connection that sent no whole request head in %g s", self.header_timeout)
            self.transport.close()


def http_protocol(name: str, header_timeout: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class `name` ("httptools" or "h11") with the header deadline."""
    if name == "httptools":
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    else:
        from uvicorn.protocols.http.h11_impl import H11Protocol as base  # type: ignore[assignment]
    return type(base.__name__, (_HeaderDeadline, base), {"header_timeout": header_timeout})


def uvicorn_config(app: Any, host: str, port: int, header_timeout: float = HEADER_TIMEOUT_S,
                   access_log: bool = True) -> uvicorn.Config:
    """The uvicorn configuration `moebius serve` runs `app` with."""
    import uvicorn

    stack = http_stack()
    return uvicorn.Config(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=10,
                          loop=stack["loop"], http=http_protocol(stack["http"], header_timeout),
                          access_log=access_log)


def _draining_server(config: uvicorn.Config, engine_loop: EngineLoop | EngineClient, drain_timeout: float
                     ) -> uvicorn.Server:
    """A uvicorn.Server whose first signal drains instead of closing at once."""
    import uvicorn

    class Server(uvicorn.Server):
        def __init__(self) -> None:
            super().__init__(config)
            self._aio: asyncio.AbstractEventLoop | None = None
            self._draining = False
            self.failed = False

        async def startup(self, sockets: Any = None) -> None:
            self._aio = asyncio.get_running_loop()
            self._watch_task = self._aio.create_task(self._watch_engine())  # kept: tasks are weakly held
            await super().startup(sockets)
            # what uvicorn runs on: with the serve extra httptools and uvloop, which take less of the front end's CPU
            # time per streamed token than h11 and asyncio (docs/performance-history.md)
            log.info("HTTP %s, event loop %s", self.config.http_protocol_class.__name__,
                     type(self._aio).__module__.split(".")[0])
            freeze_heap()  # what the app and uvicorn's start-up made (imports, routes, schemas): out of collections

        async def _watch_engine(self) -> None:
            while not self.should_exit:
                if engine_loop.error is not None:
                    log.error("the engine failed (%s): the server exits in %.0f s; restart it", engine_loop.error,
                              FAILED_EXIT_AFTER_S)
                    self.failed = True
                    await asyncio.sleep(FAILED_EXIT_AFTER_S)
                    self.should_exit = True
                    return
                await asyncio.sleep(0.2)

        def handle_exit(self, sig: int, frame: Any) -> None:
            # Not recorded in _captured_signals: uvicorn would raise it again on the way out (exit code -15).
            aio = self._aio
            if self._draining or aio is None:
                self.force_exit = self._draining
                self.should_exit = True
                return
            self._draining = True
            engine_loop.draining = True
            log.info("signal %d: draining (%d requests in flight, at most %.0f s)", sig, engine_loop.in_flight,
                     drain_timeout)
            aio.call_soon_threadsafe(self._start_drain)

        def _start_drain(self) -> None:
            self._drain_task = asyncio.get_running_loop().create_task(self._drain())  # kept: tasks are weakly held

        async def _drain(self) -> None:
            deadline = time.monotonic() + drain_timeout
            while engine_loop.in_flight and time.monotonic() < deadline and not self.should_exit:
                await asyncio.sleep(0.05)
            if engine_loop.in_flight:
                log.warning("drain timeout: %d requests still in flight fail with 503", engine_loop.in_flight)
            await asyncio.to_thread(engine_loop.stop)  # the engine closes while the HTTP side still answers
            self.should_exit = True

    return Server()


def serve(args: argparse.Namespace) -> int:
    try:
        import uvicorn  # noqa: F401 - missing: the error below

        from moebius.entrypoints.openai.app import ServeSettings, create_app
        from moebius.entrypoints.openai.engine_loop import EngineLoop
        from moebius.entrypoints.openai.engine_process import EngineClient
        from moebius.entrypoints.openai.metrics import ServerMetrics
    except ImportError as e:
        raise ValueError(f"`moebius serve` needs the web packages ({e.name} is missing): "
                         "pip install 'moebius[serve]'") from None
    from moebius.frontend.core import EngineCore

    if args.enable_auto_tool_choice and args.tool_call_parser is None:  # (before the engine starts)
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (the model's tool-call format: "
                         f"{', '.join(TOOL_PARSERS)})")
    ecfg = EngineConfig.from_cli_args(args)
    if ecfg.rank_process == "auto":  # the step launches must not wait for the GIL the HTTP side holds
        ecfg = dataclasses.replace(ecfg, rank_process="on")
    name = args.served_model_name or ecfg.model or DEMO_MODEL_NAME
    metrics = ServerMetrics(name)
    loop: EngineLoop | EngineClient
    # (an engine process and spawned ranks ignore SIGINT: Ctrl+C drains through this process)
    if args.engine_process == "on":
        loop = EngineClient(ecfg, metrics, args.max_waiting_requests)
        mode = loop.mode
    else:
        engine = EngineCore(ecfg)
        loop, mode = EngineLoop(engine, metrics, args.max_waiting_requests), engine.mode
    world = loop.info.world_size
    loop.start()
    try:
        settings = ServeSettings(served_model_name=name, model_path=ecfg.model, api_key=ecfg.api_key,
                                 reasoning_parser=args.reasoning_parser, tool_call_parser=args.tool_call_parser,
                                 enable_auto_tool_choice=args.enable_auto_tool_choice)
        config = uvicorn_config(create_app(loop, settings, metrics), args.host, args.port, args.header_timeout,
                                access_log=not args.disable_uvicorn_access_log)
        log.info("starting the server for %r on http://%s:%d/v1 (%s, %d rank%s%s)", name, args.host, args.port,
                 mode, world, "" if world == 1 else "s", ", the engine in a process of its own"
                 if args.engine_process == "on" else "")
        if ecfg.api_key is None and args.host not in ("127.0.0.1", "localhost", "::1"):
            log.warning("listening on %s without --api-key: anyone who reaches it can generate and switch layouts",
                        args.host)
        server = _draining_server(config, loop, args.shutdown_timeout)
        server.run()
    finally:
        loop.stop()
    log.info("server stopped")
    return 1 if server.failed else 0
