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
import time
from typing import TYPE_CHECKING, Any

from moebius.config import EngineConfig
from moebius.worker.build import freeze_heap

if TYPE_CHECKING:
    import uvicorn

    from moebius.entrypoints.openai.engine_loop import EngineLoop
    from moebius.entrypoints.openai.engine_process import EngineClient

log = logging.getLogger("moebius")

DEMO_MODEL_NAME = "moebius-demo"
FAILED_EXIT_AFTER_S = 3.0  # after the engine fails: answering 503 this long before the port closes


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """The `serve` subcommand (sub: the subparsers of the `moebius` parser)."""
    p = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API (completions, chat, metrics, admin)",
                       description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health, /version, "
                       "/metrics and the operator endpoints /admin/switch and /admin/status on one port. With no "
                       "--model, serves the small built-in model (random weights: its text is meaningless). "
                       "--api-key protects every route but /health.",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    http = p.add_argument_group("server")
    http.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: every interface)")
    http.add_argument("--port", type=int, default=8000, help="port to bind")
    http.add_argument("--served-model-name", default=None,
                      help=f"the name clients send as `model` (default: the --model value, or {DEMO_MODEL_NAME!r})")
    http.add_argument("--max-waiting-requests", type=int, default=None,
                      help="answer 429 while this many requests wait for their first token (default: no limit)")
    http.add_argument("--shutdown-timeout", type=float, default=30.0,
                      help="seconds a shutdown waits for requests in flight to finish")
    http.add_argument("--engine-process", choices=("on", "off"), default="on",
                      help="on: the engine loop (front end, and through it the rank processes) in a process of its "
                      "own, so that it and the HTTP side each have a core; off: a thread of the server's process")
    EngineConfig.add_cli_args(p)
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


def uvicorn_config(app: Any, host: str, port: int) -> uvicorn.Config:
    """The uvicorn configuration `moebius serve` runs `app` with."""
    import uvicorn

    return uvicorn.Config(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=10, **http_stack())


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

    ecfg = EngineConfig.from_cli_args(args)
    if ecfg.rank_process == "auto":  # the step launches must not wait for the GIL the HTTP side holds
        ecfg = dataclasses.replace(ecfg, rank_process="on")
    if ecfg.admin_port is not None:
        raise ValueError("--admin-port: `moebius serve` hosts /admin/switch and /admin/status on --port itself")
    if args.max_waiting_requests is not None and args.max_waiting_requests < 1:
        raise ValueError(f"--max-waiting-requests must be at least 1, got {args.max_waiting_requests}")
    if args.shutdown_timeout < 0:
        raise ValueError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
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
        settings = ServeSettings(served_model_name=name, model_path=ecfg.model, api_key=ecfg.api_key)
        config = uvicorn_config(create_app(loop, settings, metrics), args.host, args.port)
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
