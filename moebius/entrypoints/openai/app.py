"""The FastAPI application: routes, the API-key and body-size guard (a plain ASGI middleware, so streams and client
disconnects pass through untouched), and every error in OpenAI's shape."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hmac
import ipaddress
import json
import logging
import math
import re
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from moebius import __version__
from moebius.entrypoints.openai import control
from moebius.entrypoints.openai.engine_loop import EngineLoop
from moebius.entrypoints.openai.metrics import CONTENT_TYPE, ServerMetrics
from moebius.entrypoints.openai.native import (
    AbortBody,
    AbortRequestsBody,
    ContinueBody,
    GenerateRequest,
    NativeAnswer,
    PauseBody,
    ReleaseMemoryBody,
    ResumeMemoryBody,
    UpdateFromDiskBody,
    UpdateWeightsFromTensorBody,
    generate_items,
)
from moebius.entrypoints.openai.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DestroyWeightsUpdateGroupBody,
    InitWeightsUpdateGroupBody,
    PolicyRequest,
    SwitchRequest,
    UpdateWeightsFromDistributedBody,
)
from moebius.entrypoints.openai.reasoning import ReasoningParser, make_parser
from moebius.entrypoints.openai.serving import (
    Answer,
    Generation,
    chat_prompt,
    chat_tools,
    check_model,
    completion_inputs,
    sampling_params,
)
from moebius.entrypoints.openai.tool_calls import NEEDS_REASONING as TOOL_NEEDS_REASONING
from moebius.entrypoints.openai.tool_calls import PARSERS as TOOL_PARSERS
from moebius.entrypoints.openai.tool_calls import ToolCallParser
from moebius.frontend.core import EngineStateError
from moebius.parallel.layout import MODES

if TYPE_CHECKING:
    from moebius.entrypoints.openai.engine_process import EngineClient

log = logging.getLogger("moebius")

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat runs up to the context length
# POSTs with a JSON body (the RL control routes that take an empty body read theirs themselves: _optional_body)
JSON_ROUTES = ("/v1/completions", "/v1/chat/completions", "/admin/switch", "/admin/policy", "/generate",
               "/update_weights_from_disk", "/abort_request", "/abort_requests", "/init_weights_update_group",
               "/update_weights_from_distributed", "/destroy_weights_update_group", "/update_weights_from_tensor")


@dataclass(frozen=True)
class ServeSettings:
    served_model_name: str
    model_path: str | None = None
    api_key: str | None = None
    max_body_bytes: int = 4 << 20
    switch_timeout_s: float = 600.0
    open_paths: tuple[str, ...] = ("/health",)  # reachable without the API key (load balancers' probes)
    json_paths: tuple[str, ...] = JSON_ROUTES  # POSTed as application/json only (as vLLM and OpenAI)
    reasoning_parser: str = "auto"  # a name in reasoning.PARSERS, "none", or "auto": the family's
    tool_call_parser: str | None = None  # a name in tool_calls.PARSERS: with enable_auto_tool_choice, parses tool calls
    enable_auto_tool_choice: bool = False


def _loopback_only(request: Request) -> None:
    """403 unless the client is this machine's loopback (IPv4, IPv6, or IPv4 mapped into IPv6): CUDA IPC handles
    and shared memory name this machine's memory, so only its own processes may hand them in."""
    host = request.client.host if request.client is not None else None
    try:
        ip = ipaddress.ip_address(host or "")
        ok = (getattr(ip, "ipv4_mapped", None) or ip).is_loopback
    except ValueError:
        ok = False
    if not ok:
        raise APIError(403, f"{request.url.path} takes tensors by handle from processes of this machine only "
                       f"(127.0.0.1 or ::1); this request came from {host}", code="forbidden")


def _error(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def _send_error(send: Send, e: APIError) -> None:
    await _error(e)({"type": "http"}, _no_receive, send)


async def _no_receive() -> Message:
    return {"type": "http.disconnect"}


def _media_type(content_type: bytes | None) -> str:
    """The media type of a Content-Type header ("application/json; charset=utf-8" -> "application/json")."""
    return (content_type or b"").decode("latin-1").split(";", 1)[0].strip().lower()


class Guard:
    """Before anything is parsed: the API key (constant-time compare), the body size (Content-Length, and the
    bytes actually received for bodies sent without one) and, on the routes that take a JSON body, its Content-Type
    (FastAPI would otherwise read a text/plain body as bytes and call a JSON object no object)."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int, open_paths: tuple[str, ...],
                 json_paths: tuple[str, ...] = JSON_ROUTES) -> None:
        self.app, self.max_body, self.open_paths, self.json_paths = app, max_body_bytes, open_paths, json_paths
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.expected is not None and scope["path"] not in self.open_paths:
            if not hmac.compare_digest(headers.get(b"authorization", b""), self.expected):
                return await _send_error(send, APIError(
                    401, "missing or wrong API key: send 'Authorization: Bearer <key>'", code="invalid_api_key"))
        length = headers.get(b"content-length")
        if length is not None:
            if not length.isdigit():
                return await _send_error(send, APIError(400, "malformed Content-Length header"))
            if int(length) > self.max_body:
                return await _send_error(send, self._too_large())
        if scope["method"] == "POST" and scope["path"] in self.json_paths:
            media = _media_type(headers.get(b"content-type"))
            if media != "application/json":
                got = f"Content-Type {media!r}" if media else "no Content-Type header"
                return await _send_error(send, APIError(
                    415, f"{scope['path']} takes a JSON body: send it with 'Content-Type: application/json' (got "
                    f"{got})", code="unsupported_media_type"))
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_body:  # raised into the body parser, which passes HTTP errors on
                raise HTTPException(413, self._too_large().message)
            return message

        await self.app(scope, counted, send)

    def _too_large(self) -> APIError:
        return APIError(413, f"the request body is larger than {self.max_body} bytes", code="request_too_large")


# pydantic's union branch names in a location (a model's is its class name: fields are never capitalized)
_TYPE_TAG = re.compile(r"^(str|int|float|bool|none|list|dict)$|\[|^[A-Z][A-Za-z0-9]*$")


def _shown(value: Any, limit: int = 80) -> str:
    """A value as JSON, cut short (a 5000-token prompt is not repeated back)."""
    text = json.dumps(value, default=repr)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _validation_error(errors: list[dict[str, Any]]) -> APIError:
    """pydantic's first complaint as one readable sentence naming the field and the value it got."""
    e = errors[0]
    if e.get("type") == "json_invalid":
        detail = (e.get("ctx") or {}).get("error", "")
        at = next((x for x in e.get("loc", ()) if isinstance(x, int)), None)
        where = f" at character {at}" if at is not None else ""
        return APIError(400, f"the request body is not valid JSON ({detail}{where})" if detail else
                        "the request body is not valid JSON")
    loc = [x for x in e.get("loc", ()) if x != "body" and not (isinstance(x, str) and _TYPE_TAG.search(x))]
    if not loc:
        if e.get("type") == "missing":
            return APIError(400, "the request body is missing: send a JSON object")
        got = e.get("input")
        kind = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean",
                type(None): "null", bytes: "bytes"}.get(type(got), type(got).__name__)
        return APIError(400, f"the request body must be a JSON object, got {kind} ({_shown(got, 40)})")
    path = "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in loc).lstrip(".")
    if e.get("type") == "missing":
        return APIError(400, f"{path} is required", param=str(loc[0]))
    msg = str(e.get("msg", "invalid")).removeprefix("Value error, ")
    got = f" (got {_shown(e['input'])})" if "input" in e else ""
    return APIError(400, f"{path}: {msg}{got}", param=str(loc[0]))


def _finite(obj: Any) -> Any:
    """JSON-safe: non-finite floats (an unbounded threshold) become null."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {str(k): _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


async def _optional_body(request: Request, model: type[BaseModel]) -> Any:
    """A control route's body: none (or only whitespace) gives the model's defaults (SGLang's trainers post
    /pause_generation without one), else a JSON object checked by the model (a 400 naming the field)."""
    raw = await request.body()
    if not raw.strip():
        return model()
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        raise _validation_error([{**err, "loc": ("body", *err["loc"])} for err in e.errors()]) from None


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone (the body is read by then, so the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        await asyncio.sleep(0.05)


async def _whole_unless_gone(request: Request, answer: Coroutine[Any, Any, Any], abort: Callable[[], None]
                             ) -> Response:
    """The whole answer as JSON, or 499 once the client has gone (then `abort` frees what it held at once)."""
    whole = asyncio.ensure_future(answer)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({whole, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not whole.done():  # the client went away (or we are cancelled): free its KV now
            whole.cancel()
            abort()
    if not whole.done() or whole.cancelled():
        return Response(status_code=499)  # nobody reads it
    return JSONResponse(whole.result())


def create_app(loop: EngineLoop | EngineClient, settings: ServeSettings, metrics: ServerMetrics | None = None
               ) -> FastAPI:
    app = FastAPI(title="Moebius", version=__version__, description="OpenAI-compatible API over the Moebius engine")
    app.add_middleware(Guard, api_key=settings.api_key, max_body_bytes=settings.max_body_bytes,  # type: ignore[arg-type]
                       open_paths=settings.open_paths, json_paths=settings.json_paths)
    served, info, created = settings.served_model_name, loop.info, int(time.time())

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return _error(e)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        return _error(_validation_error(list(e.errors())))

    @app.exception_handler(HTTPException)
    async def _http(request: Request, e: HTTPException) -> JSONResponse:
        if e.status_code == 404:
            return _error(APIError(404, f"no route {request.url.path}", code="not_found"))
        if e.status_code == 405:
            return _error(APIError(405, f"{request.method} is not allowed on {request.url.path}",
                                   code="method_not_allowed", headers=dict(e.headers or {})))
        code = "request_too_large" if e.status_code == 413 else None
        return _error(APIError(e.status_code, str(e.detail), code=code, headers=dict(e.headers or {})))

    @app.exception_handler(Exception)
    async def _crash(_: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error in a request")
        return _error(APIError(500, f"internal error: {type(e).__name__}: {e}", code="internal_error"))

    async def respond(request: Request, gen: Generation, chat: bool, body: CompletionRequest | ChatCompletionRequest,
                      reasoning: Callable[[], ReasoningParser] | None = None,
                      tools: Callable[[], ToolCallParser] | None = None) -> Response:
        try:
            await gen.start()
        except asyncio.CancelledError:
            gen.abort()
            raise
        answer = Answer(gen, chat, served, body.return_token_ids, info, reasoning, tools)
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            # the background abort covers a client gone before the stream's first event (its generator never ran)
            return StreamingResponse(answer.stream(usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"}, background=BackgroundTask(gen.abort))
        return await _whole_unless_gone(request, answer.whole(), gen.abort)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_model(body, served)
        prompts = completion_inputs(body)
        params = sampling_params(body, info, COMPLETIONS_DEFAULT_MAX_TOKENS, body.logprobs)
        return await respond(request, Generation(loop, [(p, params) for p in prompts], "prompt"), False, body)

    reasoning = info.reasoning_parser if settings.reasoning_parser == "auto" else \
        None if settings.reasoning_parser == "none" else settings.reasoning_parser
    # (harmony's markers are special tokens: its answers are decoded with them)
    keep_specials = reasoning is not None and make_parser(reasoning, "").keeps_special_tokens
    if settings.tool_call_parser is not None and settings.tool_call_parser not in TOOL_PARSERS:
        raise ValueError(f"unknown tool call parser {settings.tool_call_parser!r}; known: {', '.join(TOOL_PARSERS)}")
    if (need := TOOL_NEEDS_REASONING.get(settings.tool_call_parser or "")) is not None and reasoning != need:
        raise ValueError(f"--tool-call-parser {settings.tool_call_parser} reads the calls the {need} reasoning parser "
                         f"takes out of the answer: it needs --reasoning-parser {need} (or auto, for its family), got "
                         f"{settings.reasoning_parser} ({reasoning or 'none'})")
    tool_parser = settings.tool_call_parser if settings.enable_auto_tool_choice else None

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        check_model(body, served)
        params = sampling_params(body, info, None, (body.top_logprobs or 0) if body.logprobs else None)
        tools = chat_tools(body, tool_parser)
        prompt = await run_in_threadpool(chat_prompt, body, info, tools)  # a template render: off the event loop
        parser = None if tools is None or tool_parser is None else TOOL_PARSERS[tool_parser]
        if keep_specials or (parser is not None and parser.keeps_special_tokens):  # (markers that are special tokens)
            params = dataclasses.replace(params, skip_special_tokens=False)
        calls = None if parser is None else functools.partial(parser, tools)  # (one an answer, knowing the tools)
        parse = None if reasoning is None else functools.partial(make_parser, reasoning, prompt)
        return await respond(request, Generation(loop, [(prompt, params)], "messages"), True, body, parse, calls)

    def model_card() -> dict[str, Any]:
        return {"id": served, "object": "model", "created": created, "owned_by": "moebius",
                "root": settings.model_path or served, "max_model_len": info.max_model_len}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> dict[str, Any]:
        if model != served:
            raise APIError(404, f"the model {model!r} does not exist", param="model", code="model_not_found")
        return model_card()

    @app.get("/health")
    async def health() -> Response:
        if loop.error is not None or not loop.healthy:
            raise APIError(503, f"the engine failed: {loop.error or 'its loop is not running'}", code="engine_dead")
        if loop.draining:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus() -> Response:
        if metrics is None:
            raise APIError(404, "metrics are off", code="not_found")
        metrics.waiting.set(loop.waiting)  # fresher than the engine thread's last step
        metrics.running.set(loop.running)
        return Response(metrics.exposition(), media_type=CONTENT_TYPE)

    async def on_engine(fn: Any, *args: Any, admit_while_draining: bool = False) -> Any:
        fut = loop.call(fn, *args, admit_while_draining=admit_while_draining)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(fut), settings.switch_timeout_s)
        except TimeoutError:
            raise APIError(503, "the engine did not reach a step boundary in time", code="timeout") from None
        except APIError:
            raise
        except (ValueError, TypeError) as e:
            raise APIError(400, str(e)) from None
        except EngineStateError as e:  # (memory released, requests in flight): nothing changed
            raise APIError(409, str(e), code="conflict") from None
        except Exception as e:
            raise APIError(500, f"{type(e).__name__}: {e}", code="engine_error") from None

    # ---- the RL trainers' API: SGLang's native names, vLLM's beside them (one implementation, control.py) ----
    native_rids: dict[str, list[str]] = {}  # a /generate rid in flight -> its engine requests (/abort_request)

    @app.post("/generate")
    async def generate(body: GenerateRequest, request: Request) -> Response:
        items, rids, field, as_list = generate_items(body, info)
        if busy := [r for r in rids if r in native_rids]:
            raise APIError(400, f"rid {busy[0]!r} is already in flight", param="rid")
        gen = Generation(loop, items, field)
        for k, rid in enumerate(rids):
            native_rids[rid] = [gen.sink.request_ids[k]]

        def forget() -> None:
            gen.abort()
            for rid in rids:
                native_rids.pop(rid, None)

        try:
            await gen.start()
        except APIError as e:
            forget()
            if e.param == "max_tokens":  # the engine's name for it: SGLang's in this API
                e.param, e.message = "sampling_params.max_new_tokens", e.message.replace("max_tokens",
                                                                                         "max_new_tokens")
            raise
        except BaseException:
            forget()
            raise
        answer = NativeAnswer(gen, rids, body, info, items, as_list)
        if body.stream:
            return StreamingResponse(answer.stream(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"}, background=BackgroundTask(forget))
        try:
            return await _whole_unless_gone(request, answer.whole(), lambda: None)
        finally:
            forget()

    async def pause_in(mode: str, clear_cache: bool = False) -> None:
        try:
            await on_engine(control.pause, mode, clear_cache)
        except APIError as e:  # the engine names the mode's value and the modes it takes
            if e.status == 400:
                e.param = "mode"
            raise

    @app.post("/pause_generation")
    async def pause_generation(request: Request) -> Response:
        body = await _optional_body(request, PauseBody)
        await pause_in(body.mode)
        return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

    @app.post("/continue_generation")
    async def continue_generation(request: Request) -> Response:
        await _optional_body(request, ContinueBody)
        await on_engine(control.resume)
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

    @app.post("/pause")
    async def pause_vllm(mode: str = "abort", clear_cache: bool = True) -> Response:  # vLLM's: the query string
        await pause_in(mode, clear_cache)
        return JSONResponse({"status": "paused", "mode": mode})

    @app.post("/resume")
    async def resume_vllm() -> Response:
        await on_engine(control.resume)
        return JSONResponse({"status": "resumed"})

    @app.get("/is_paused")
    async def is_paused() -> Response:
        return JSONResponse({"is_paused": await on_engine(control.is_paused)})

    @app.post("/abort_request")
    async def abort_request(body: AbortBody) -> Response:
        if body.abort_all:
            if body.rid:
                raise APIError(400, "give rid or abort_all, not both", param="rid")
            return JSONResponse({"aborted": await on_engine(control.abort_all)})
        if not body.rid:
            raise APIError(400, "rid is required (or abort_all: true)", param="rid")
        # (an unknown rid aborts nothing, as SGLang: it may have just finished)
        return JSONResponse({"aborted": await on_engine(control.abort_requests, native_rids.get(body.rid, []))})

    @app.post("/abort_requests")
    async def abort_requests(body: AbortRequestsBody) -> Response:
        if not body.request_ids:  # as vLLM: none given, every request in flight
            return JSONResponse({"aborted": await on_engine(control.abort_all)})
        ids = [e for rid in body.request_ids for e in native_rids.get(rid, [rid])]
        return JSONResponse({"aborted": await on_engine(control.abort_requests, ids)})

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        pages = await on_engine(control.flush_cache)
        return PlainTextResponse(f"Cache flushed ({pages} pages).\n")

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        return JSONResponse({"pages": await on_engine(control.flush_cache)})

    @app.get("/get_weight_version")
    async def get_weight_version() -> Response:
        return JSONResponse({"weight_version": await on_engine(control.weight_version)})

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(body: UpdateFromDiskBody) -> Response:
        try:
            done = await on_engine(control.update_weights_from_disk, body.model_path, body.weight_version,
                                   body.abort_all_requests)
        except APIError as e:  # SGLang's reply ({"success": false, "message"}) in the error's status and shape
            return JSONResponse({"success": False, "message": e.message, "num_paused_requests": 0, **e.body()},
                                status_code=e.status)
        return JSONResponse({"success": True, "message": f"Succeeded to update model weights ({done['views']} views, "
                             f"{done['flushed_pages']} cached pages flushed).", "num_paused_requests": 0,
                             "weight_version": body.weight_version, "aborted": done["aborted"]})

    @app.post("/update_weights_from_tensor", dependencies=[Depends(_loopback_only)])  # (before the body's checks)
    async def update_weights_from_tensor(body: UpdateWeightsFromTensorBody) -> Response:
        done, refused = await sglang_reply(control.update_weights_from_tensor, body.named_tensors,
                                           body.weight_version, body.abort_all_requests)
        return refused or JSONResponse({
            "success": True, "message": f"Succeeded to update model weights ({done['views']} views, "
            f"{done['flushed_pages']} cached pages flushed).", "weight_version": body.weight_version,
            "aborted": done["aborted"]})

    async def sglang_reply(fn: Any, *args: Any) -> tuple[Any, JSONResponse | None]:
        """fn on the engine, or SGLang's refusal ({"success": false, "message"}) in the error's status."""
        try:
            return await on_engine(fn, *args), None
        except APIError as e:
            return None, JSONResponse({"success": False, "message": e.message, **e.body()}, status_code=e.status)

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(body: InitWeightsUpdateGroupBody) -> Response:
        _, refused = await sglang_reply(control.init_weights_update_group, body.master_address, body.master_port,
                                        body.rank_offset, body.world_size, body.group_name, body.backend)
        return refused or JSONResponse({"success": True, "message": f"Joined process group {body.group_name!r}."})

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(body: UpdateWeightsFromDistributedBody) -> Response:
        done, refused = await sglang_reply(control.update_weights_from_distributed, body.names, body.dtypes,
                                           body.shapes, body.group_name, body.weight_version,
                                           body.abort_all_requests, body.load_format)
        return refused or JSONResponse({
            "success": True, "message": f"Succeeded to update model weights ({done['views']} views, "
            f"{done['flushed_pages']} cached pages flushed).", "weight_version": body.weight_version,
            "aborted": done["aborted"]})

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(body: DestroyWeightsUpdateGroupBody) -> Response:
        _, refused = await sglang_reply(control.destroy_weights_update_group, body.group_name)
        return refused or JSONResponse({"success": True, "message": f"Left process group {body.group_name!r}."})

    def released(what: str, done: dict[str, Any]) -> str:
        return (f"{what} {done['nbytes'] / 2**30:.2f} GiB on rank 0 ({done['host_bytes'] / 2**30:.2f} GiB through "
                f"host memory) in {done['seconds']:.2f} s.")

    @app.post("/release_memory_occupation")
    async def release_memory_occupation(request: Request) -> Response:
        body = await _optional_body(request, ReleaseMemoryBody)
        done, refused = await sglang_reply(control.release_memory, body.tags, body.keep_weights)
        return refused or JSONResponse({"success": True, "message": released("Released", done), **done})

    @app.post("/resume_memory_occupation")
    async def resume_memory_occupation(request: Request) -> Response:
        body = await _optional_body(request, ResumeMemoryBody)
        done, refused = await sglang_reply(control.resume_memory, body.tags)
        return refused or JSONResponse({"success": True, "message": released("Resumed", done), **done})

    @app.post("/sleep")
    async def sleep(level: int = 1) -> Response:  # vLLM's: level 1 keeps the weights in host memory, 2 drops them
        if level not in (1, 2):
            raise APIError(400, f"level must be 1 or 2, got {level}", param="level")
        return JSONResponse(await on_engine(control.release_memory, None, level == 1))

    @app.post("/wake_up")
    async def wake_up(tags: Annotated[list[str] | None, Query()] = None) -> Response:  # vLLM's ?tags=...&tags=...
        return JSONResponse(await on_engine(control.resume_memory, tags))

    @app.get("/is_sleeping")
    async def is_sleeping() -> Response:
        return JSONResponse({"is_sleeping": await on_engine(control.is_sleeping)})

    @app.post("/admin/switch")
    async def switch(body: SwitchRequest) -> Response:
        if body.mode not in MODES:
            raise APIError(400, f"mode must be one of {list(MODES)}, got {body.mode!r}", param="mode")
        return JSONResponse(_finite(await on_engine(control.switch, body.mode)))

    @app.post("/admin/policy")
    async def policy(body: PolicyRequest) -> Response:
        return JSONResponse(await on_engine(control.set_policy, body.model_dump()))

    @app.post("/admin/pause")
    async def pause() -> Response:  # RL weight updates: requests stay, no step runs until /admin/resume
        await on_engine(control.pause, "keep")
        return JSONResponse({"paused": True})

    @app.post("/admin/resume")
    async def resume() -> Response:
        await on_engine(control.resume)
        return JSONResponse({"paused": False})

    @app.get("/admin/status")
    async def admin_status() -> Response:
        snapshot = await on_engine(control.status, admit_while_draining=True)
        # this (the HTTP) process's CPU seconds so far: with the engine in a process of its own, the HTTP side's
        return JSONResponse(_finite({**snapshot, "draining": loop.draining, "http_cpu_s": time.process_time()}))

    return app
