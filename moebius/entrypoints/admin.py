"""Operator endpoints of a running engine (loopback by default, optional API key):

    POST /admin/switch  {"mode": "tp" | "ep"}  -> the switch outcome (as LLM.switch_mode returns it)
    GET  /admin/status                         -> {"mode": ..., "kv": ..., "unfinished": ..., "paused": ...,
                                                   "weight_version": ...}

Hosted by the entry point that drives the engine (`LLM`): a switch asked for here is carried out by its loop at the
next step boundary (the HTTP thread never touches engine state), so it is the same operation as `LLM.switch_mode`
between two `step()` calls. Bodies are JSON (Content-Type: application/json); nothing is unpickled. Errors have the
shape `moebius serve` answers with: {"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import hmac
import json
import logging
import queue
import threading
from concurrent.futures import Future
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from moebius.config import ConfigError
from moebius.parallel.layout import MODES

if TYPE_CHECKING:
    from moebius.frontend.core import EngineCore

log = logging.getLogger("moebius")

MAX_BODY = 1 << 16  # bytes: a switch request is a few
BODY_TIMEOUT_S = 5.0
HEADER_TIMEOUT_S = 10.0  # seconds a connection may take for its request line and headers (a slow-loris is dropped)


class AdminServer:
    def __init__(self, core: EngineCore, host: str, port: int, api_key: str | None, timeout_s: float = 600.0
                 ) -> None:
        self.core, self.api_key, self.timeout_s = core, api_key, timeout_s
        self._jobs: queue.Queue[tuple[str, Future]] = queue.Queue()
        self._status: dict[str, Any] = {}
        try:
            self.httpd = ThreadingHTTPServer((host, port), self._handler())
        except OSError as e:  # a busy or forbidden port, an address not of this machine
            raise ConfigError(f"admin endpoints cannot listen on {host}:{port}: {e.strerror or e}") from None
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="moebius-admin", daemon=True)
        self._thread.start()
        log.info("admin endpoints on http://%s:%d/admin/ (switch, status)", host, self.port)

    def poll(self) -> None:
        """Run the switches asked for since the last step (called by the loop that drives the engine, between
        steps)."""
        while True:
            try:
                mode, fut = self._jobs.get_nowait()
            except queue.Empty:
                break
            try:
                fut.set_result(self.core.switch_mode(mode).to_json())
            except Exception as e:  # reported to the caller; the engine goes on
                fut.set_exception(e)

    def publish(self) -> None:
        """Snapshot what GET /admin/status reports (called by the loop that drives the engine, after each step)."""
        self._status = {"mode": self.core.mode, "kv": self.core.kv_stats(), "unfinished": self.core.has_unfinished(),
                        "paused": self.core.paused, "weight_version": self.core.weight_version}

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            # a connection's socket reads (the request line and headers too) give up after this long: a client that
            # never finishes its request holds no thread
            timeout = HEADER_TIMEOUT_S

            def log_message(self, fmt: str, *args: Any) -> None:
                log.debug("admin: " + fmt, *args)

            def _reply(self, code: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _error(self, code: int, message: str, param: str | None = None, kind: str | None = None) -> None:
                """An error in the shape `moebius serve` answers with (OpenAI's)."""
                self._reply(code, error_body(code, message, param, kind))

            def _authorized(self) -> bool:
                if server.api_key is None:
                    return True
                got = self.headers.get("Authorization", "")
                if hmac.compare_digest(got.encode(), f"Bearer {server.api_key}".encode()):
                    return True
                self._error(401, "missing or wrong API key: send 'Authorization: Bearer <key>'", kind="invalid_api_key")
                return False

            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                if not self._authorized():
                    return
                if self.path == "/admin/switch":
                    return self._wrong_method()
                if self.path != "/admin/status":
                    return self._error(404, f"no route {self.path}: GET /admin/status, POST /admin/switch",
                                       kind="not_found")
                self._reply(200, server._status or {"mode": server.core.mode})

            def _wrong_method(self) -> None:
                self._error(405, f"{self.command} is not allowed on {self.path}: GET /admin/status, POST "
                            "/admin/switch", kind="method_not_allowed")

            do_PUT = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = _wrong_method  # noqa: N815 (http.server's naming)

            def _body(self) -> bytes | None:
                """The request body, or None after answering why not (too large, shorter than announced)."""
                length = self.headers.get("Content-Length", "0")
                try:
                    n = int(length)
                except ValueError:
                    n = -1
                if not 0 <= n <= MAX_BODY:
                    self._error(413 if n > MAX_BODY else 400, f"Content-Length must be 0-{MAX_BODY}, got {length!r}",
                                kind="request_too_large" if n > MAX_BODY else None)
                    return None
                self.connection.settimeout(BODY_TIMEOUT_S)  # a client announcing more than it sends is not waited on
                try:
                    data = self.rfile.read(n)
                except TimeoutError:
                    data = b""
                if len(data) != n:
                    self._error(400, f"the body has fewer bytes than its Content-Length {n}")
                    return None
                return data

            def _mode(self, data: bytes) -> str | None:
                """The body's mode, or None after answering what is wrong with the body."""
                media = self.headers.get("Content-Type", "").split(";", 1)[0].strip().lower()
                if media != "application/json":  # as `moebius serve` (and vLLM) take JSON bodies
                    got = f"Content-Type {media!r}" if media else "no Content-Type header"
                    self._error(415, f"/admin/switch takes a JSON body: send it with 'Content-Type: "
                                f"application/json' (got {got})", kind="unsupported_media_type")
                    return None
                try:
                    body = json.loads(data)
                except ValueError as e:  # (UnicodeDecodeError is one)
                    self._error(400, f"the body is not valid JSON ({e}): send {{\"mode\": \"tp\" | \"ep\"}}")
                    return None
                if not isinstance(body, dict):
                    self._error(400, f"the body must be a JSON object {{\"mode\": \"tp\" | \"ep\"}}, got "
                                f"{json.dumps(body)[:80]}")
                    return None
                if unknown := sorted(set(body) - {"mode"}):
                    self._error(400, f"unknown field(s) {unknown}: the body is {{\"mode\": \"tp\" | \"ep\"}}",
                                param=unknown[0])
                    return None
                if "mode" not in body:
                    self._error(400, "mode is required", param="mode")
                    return None
                mode = body["mode"]
                if mode not in MODES:
                    self._error(400, f"mode must be one of {list(MODES)}, got {json.dumps(mode)}", param="mode")
                    return None
                return str(mode)

            def do_POST(self) -> None:  # noqa: N802
                if not self._authorized():
                    return
                if self.path == "/admin/status":
                    return self._wrong_method()
                if self.path != "/admin/switch":
                    return self._error(404, f"no route {self.path}: GET /admin/status, POST /admin/switch",
                                       kind="not_found")
                data = self._body()
                if data is None:
                    return
                mode = self._mode(data)
                if mode is None:
                    return
                fut: Future = Future()
                server._jobs.put((mode, fut))
                try:
                    self._reply(200, fut.result(timeout=server.timeout_s))
                except TimeoutError:
                    self._error(503, "the engine did not reach a step boundary in time; the switch stays queued",
                                kind="timeout")
                except Exception as e:
                    self._error(500, f"{type(e).__name__}: {e}", kind="engine_error")

        return Handler


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape, as `moebius serve` answers (entrypoints/openai/protocol.py, which needs pydantic)."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
