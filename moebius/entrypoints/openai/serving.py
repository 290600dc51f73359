"""Completions and chat completions: request -> SamplingParams (or a 400), then the answer, whole or as server-sent
events. Text is streamed as the engine's deltas bring it (they never take text back: the engine holds back what
could still begin a stop string).

The RL extensions, whole and streamed:
- `return_token_ids` (vLLM's names and places): completions give each choice `prompt_token_ids` and `token_ids`, a
  stream each choice's first chunk `prompt_token_ids` and every chunk the `token_ids` it adds; chat gives
  `prompt_token_ids` at the top of the answer (a stream: on each choice's first chunk, the one with the role) and
  `token_ids` in each choice (a stream: in every chunk, the tokens it adds).
- `return_routed_experts` / `return_prompt_routed_experts`: each choice's `routed_experts`, encoded as /generate's
  `meta_info.routed_experts` (routed_experts_b64): the prompt's rows (every prompt token but the last) when
  return_prompt_routed_experts, then one row per output token when return_routed_experts; with both, the routing of
  prompt + output[:-1], what /generate returns. A stream sends it once, whole, on each choice's last chunk (the one
  with its finish_reason)."""

from __future__ import annotations

import base64
import dataclasses
import itertools
import json
import re
import time
import uuid
from array import array
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any

from moebius.entrypoints.openai.engine_loop import Accepted, EngineInfo, EngineLoop, Failure, SampleDelta, Sink, Update
from moebius.entrypoints.openai.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    unsupported,
)
from moebius.entrypoints.openai.reasoning import ReasoningParser
from moebius.entrypoints.openai.tool_calls import ToolCall, ToolCallParser
from moebius.sampling_params import SamplingParams
from moebius.tokenizer import _bytes_to_unicode

if TYPE_CHECKING:
    from moebius.entrypoints.openai.engine_process import EngineClient
    from moebius.frontend.core import Prompt

_PARAMS = {f.name for f in dataclasses.fields(SamplingParams) if f.init}


def check_model(req: SamplingFields, served: str) -> None:
    if req.model is not None and req.model != served:
        raise APIError(404, f"the model {req.model!r} does not exist; this server serves {served!r}", param="model",
                       code="model_not_found")


def sampling_params(req: SamplingFields, info: EngineInfo, default_max_tokens: int | None,
                    logprobs: int | None = None) -> SamplingParams:
    """The engine's parameters for a request, or a 400 naming the parameter. logprobs: top tokens to return a
    log-probability for with each output token (0: the token's own; None: none)."""
    for name, neutral in (("presence_penalty", 0), ("frequency_penalty", 0), ("repetition_penalty", 1)):
        if (value := getattr(req, name)) not in (None, neutral):
            raise unsupported(name, f"{value:g} is not supported (only {neutral}: no penalty)")
    if req.logit_bias:
        raise unsupported("logit_bias", f"is not supported (got {len(req.logit_bias)} biased tokens)")
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed with stream: true", param="stream_options")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_tokens = default_max_tokens if max_tokens is None else max_tokens
    if max_tokens is not None and max_tokens > info.max_model_len:
        raise APIError(400, f"max_tokens {max_tokens} exceeds the model's context length {info.max_model_len}",
                       param="max_tokens")
    if req.stop_token_ids and max(req.stop_token_ids) >= info.vocab_size:
        raise APIError(400, f"stop_token_ids must be below the vocabulary size {info.vocab_size}, got "
                       f"{max(req.stop_token_ids)}", param="stop_token_ids")
    extra: dict[str, Any] = {"min_p": req.min_p} if req.min_p is not None else {}
    try:
        return SamplingParams(
            n=req.n, temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p, top_k=-1 if req.top_k is None else req.top_k,
            seed=req.seed, max_tokens=max_tokens, min_tokens=req.min_tokens, stop=req.stop,
            stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos,
            include_stop_str_in_output=req.include_stop_str_in_output, skip_special_tokens=req.skip_special_tokens,
            logprobs=logprobs, return_routed_experts=req.return_routed_experts,
            return_prompt_routed_experts=req.return_prompt_routed_experts, **extra)
    except (ValueError, TypeError) as e:  # SamplingParams names the parameter first ("min_tokens 10 is ...")
        words = re.findall(r"[a-z_]+", str(e))
        raise APIError(400, str(e), param=next((w for w in words if w in _PARAMS), None)) from None


def completion_inputs(req: CompletionRequest) -> list[Prompt]:
    if req.echo:
        raise unsupported("echo", "is not supported")
    if req.suffix:
        raise unsupported("suffix", "is not supported")
    if req.best_of is not None and req.best_of != req.n:
        raise unsupported("best_of", f"{req.best_of} other than n ({req.n}) is not supported")
    p = req.prompt
    if isinstance(p, str) or (p and isinstance(p[0], int)):
        return [p]  # type: ignore[list-item]
    return list(p)  # type: ignore[arg-type]


def chat_tools(req: ChatCompletionRequest, tool_parser: str | None) -> list[dict[str, Any]] | None:
    """The tools the chat template renders, and the answer is parsed for (None: none); a 400 for a tool_choice
    that cannot be honoured. tool_parser: the server's --tool-call-parser with --enable-auto-tool-choice, else
    None (as vLLM: without them a request with tools and tool_choice auto is refused)."""
    choice = req.tool_choice
    if (choice is not None and not isinstance(choice, str)) or choice == "required":
        what = "a named function" if not isinstance(choice, str) else "'required'"
        raise unsupported("tool_choice", f"{what} is not supported (it needs guided decoding); send 'auto' or 'none'")
    if not req.tools or choice == "none":  # (vLLM: tool_choice none leaves the tools out of the prompt)
        return None
    if tool_parser is None:
        raise APIError(400, "tools with tool_choice 'auto' need the server started with --enable-auto-tool-choice "
                       "and --tool-call-parser", param="tool_choice")
    return [t.model_dump(exclude_none=True) for t in req.tools]


def chat_prompt(req: ChatCompletionRequest, info: EngineInfo, tools: list[dict[str, Any]] | None = None) -> str:
    """The conversation rendered by the model's chat template, with these tools (pure: runs off the event loop)."""
    if req.top_logprobs and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    if req.response_format and (kind := req.response_format.get("type", "text")) != "text":
        raise unsupported("response_format", f"other than text is not supported, got type {kind!r}")
    if info.tokenizer is None:
        raise APIError(400, "this model has no tokenizer, hence no chat template: use /v1/completions with token ids",
                       param="messages")
    kwargs = req.chat_template_kwargs or {}
    if reserved := sorted({"messages", "add_generation_prompt", "tools"} & set(kwargs)):
        raise APIError(400, f"chat_template_kwargs may not set {reserved}", param="chat_template_kwargs")
    messages = []
    for i, m in enumerate(req.messages):
        content = m.content
        if content is None and m.role != "assistant":  # (OpenAI lets an assistant's tool call go without text)
            raise APIError(400, f"messages[{i}].content is null or missing: a {m.role!r} message needs a string or "
                           "a list of text parts", param="messages")
        if isinstance(content, list):
            if bad := next((part for part in content if part.type != "text" or part.text is None), None):
                raise APIError(400, f"messages[{i}].content: only text parts (with their text) are supported, got "
                               f"a part of type {bad.type!r}", param="messages")
            content = "\n".join(part.text or "" for part in content)
        message: dict[str, Any] = {"role": m.role, "content": content or ""}
        for name in ("name", "tool_call_id"):
            if (value := getattr(m, name)) is not None:
                message[name] = value
        if m.tool_calls:
            message["tool_calls"] = [c.model_dump() for c in m.tool_calls]
        messages.append(message)
    if tools is not None:
        kwargs = {**kwargs, "tools": tools}
    try:
        return info.tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt, **kwargs)
    except (ValueError, TypeError) as e:
        raise APIError(400, str(e), param="messages") from None


class Generation:
    """The engine requests of one HTTP request (one per prompt), as the HTTP side follows them."""

    def __init__(self, loop: EngineLoop | EngineClient, items: Sequence[tuple[Prompt, SamplingParams]],
                 param: str) -> None:
        self.loop, self.params = loop, items[0][1]
        self.sink: Sink = loop.submit(items, param)  # 429 / 503 here
        self.pending = set(range(len(items)))  # prompts not finished
        self.accepted: Accepted | None = None

    async def start(self) -> Accepted:
        """Wait until the engine admitted the requests (or refused them: the 400 is raised here)."""
        ev = await self.sink.get()
        if isinstance(ev, Failure):
            self.pending.clear()
            raise ev.error
        assert isinstance(ev, Accepted)
        self.accepted = ev
        return ev

    async def batches(self) -> AsyncIterator[list[Update]]:
        """The updates that arrived since the last batch (one or more, in order): a stream sends each batch in one
        write, so an HTTP side that falls behind catches up in fewer."""
        while self.pending:
            batch: list[Update] = []
            for ev in await self.sink.get_all():
                if isinstance(ev, Failure):
                    self.pending.clear()
                    if batch:
                        yield batch
                    raise ev.error
                assert isinstance(ev, Update)
                if ev.finished:
                    self.pending.discard(ev.prompt_index)
                batch.append(ev)
            yield batch

    async def updates(self) -> AsyncIterator[Update]:
        async for batch in self.batches():
            for ev in batch:
                yield ev

    def abort(self) -> None:
        """Abort what has not finished (the client went away); nothing when all finished."""
        if self.pending:
            self.loop.abort([self.sink.request_ids[i] for i in sorted(self.pending)])
            self.pending.clear()


class Choice:
    """One choice (sample) of an answer, OpenAI's or SGLang's /generate: what it got so far."""

    def __init__(self, parser: ReasoningParser | None = None, tools: ToolCallParser | None = None) -> None:
        self.text = ""
        self.parser = parser  # chat with a reasoning parser: `text` is its content, `reasoning` the rest
        self.reasoning = ""
        self.tools = tools  # chat with tools: the calls taken out of the content
        self.calls: list[ToolCall] = []
        self.tokens: list[int] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.opened = False  # its first chunk went out
        self.logprobs: list[tuple[int, dict[int, float]]] = []  # (token, {id: log-probability}) per token
        self.text_offset = 0  # streamed completions: where the next chunk's tokens start in the text
        self.cached_tokens = 0  # its prompt tokens found in the prefix cache
        self.routed: list[list[list[int]]] = []  # per output token (return_routed_experts)
        self.prompt_routed: list[list[list[int]]] = []  # per prompt token but the last (return_prompt_routed_experts)

    def apply(self, d: SampleDelta) -> tuple[str, str, list[ToolCall]]:
        """Take a delta; returns the reasoning and content text and the tool calls it adds (all content without
        parsers)."""
        self.tokens += d.token_ids
        if d.routed_experts is not None:
            self.routed += d.routed_experts
        if d.prompt_routed_experts is not None:  # all of the prompt's so far: replaces
            self.prompt_routed = d.prompt_routed_experts
        reasoning, content = ("", d.text) if self.parser is None else self.parser.feed(d.text)
        self.cached_tokens = d.cached_tokens
        if d.logprobs is not None:
            self.logprobs += list(zip(d.token_ids, d.logprobs, strict=True))
        if d.finish_reason == "error":  # this request failed (the engine serves on): the answer is an error
            raise APIError(500, f"generation failed: {d.error}", code="generation_error")
        if d.finish_reason is not None and self.parser is not None:
            rest = self.parser.finish()
            reasoning, content = reasoning + rest[0], content + rest[1]
        calls = self.parser.take_calls() if self.parser is not None else []
        if self.tools is not None:
            content, found = self.tools.feed(content)
            calls += found
            if d.finish_reason is not None:
                rest_text, rest_calls = self.tools.finish()
                content, calls = content + rest_text, calls + rest_calls
        self.text += content
        self.reasoning += reasoning
        self.calls += calls
        if d.finish_reason is not None:  # (an answer that ends in its calls: OpenAI's "tool_calls")
            self.finish_reason = "tool_calls" if self.calls and d.finish_reason == "stop" else d.finish_reason
            self.stop_reason = d.stop_reason
        return reasoning, content, calls


def routed_experts_b64(rows: list[list[list[int]]], info: EngineInfo) -> str:
    """SGLang's meta_info.routed_experts (and each OpenAI choice's `routed_experts`): base64 of int32 ids shaped
    (rows, decoder layers, top-k), in the router's order; a dense layer's entry is -1. rows: per token, per MoE
    layer, its top-k ids."""
    moe = [i for i, m in enumerate(info.moe_layers) if m]
    flat: list[int] = []
    for row in rows:
        by_layer = dict(zip(moe, row, strict=True))
        for layer in range(len(info.moe_layers)):
            flat += by_layer.get(layer, [-1] * info.top_k)
    return base64.b64encode(array("i", flat).tobytes()).decode("ascii")


def token_bytes(info: EngineInfo, t: int) -> bytes:
    """The bytes token `t` stands for: a byte-level BPE token that is part of a UTF-8 character is that raw byte,
    where its decoded text would be "\ufffd"."""
    tok = info.tokenizer
    if tok is None:
        return f"token_id:{t}".encode()
    text = tok.decode([t], skip_special_tokens=False)
    piece = tok.id_to_token(t)
    if piece is not None and t not in tok.all_special_ids:
        if _BYTE_FALLBACK.fullmatch(piece):  # SentencePiece's byte fallback: <0xE2>
            return bytes([int(piece[3:5], 16)])
        if all(c in _BYTE_OF for c in piece):  # byte-level BPE: each character one byte
            raw = bytes(_BYTE_OF[c] for c in piece)
            if raw.decode("utf-8", "replace") == text:  # (a tokenizer of another kind whose piece merely looks so)
                return raw
    return text.encode("utf-8")


_BYTE_OF = {c: b for b, c in _bytes_to_unicode().items()}  # GPT-2's byte-level alphabet, back to bytes
_BYTE_FALLBACK = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def logprobs_json(entries: Sequence[tuple[int, dict[int, float]]], k: int, chat: bool, info: EngineInfo,
                  offset: int = 0) -> dict[str, Any] | None:
    """OpenAI's `logprobs` of a choice (or a chunk): per token its log-probability and the k most likely tokens'
    (entries: (token id, {id: log-probability}, the token's own first)); None when none were asked for. offset: the
    completion's text offset of the first entry (the tokens' text streamed before this chunk)."""
    if not entries:
        return None

    def text(t: int) -> str:
        return info.tokenizer.decode([t], skip_special_tokens=False) if info.tokenizer else f"token_id:{t}"

    def top(lps: dict[int, float]) -> list[tuple[int, float]]:
        return sorted(lps.items(), key=lambda kv: -kv[1])[:k]

    if chat:
        def item(t: int, lp: float) -> dict[str, Any]:
            return {"token": text(t), "logprob": lp, "bytes": list(token_bytes(info, t))}

        return {"content": [{**item(t, lps[t]), "top_logprobs": [item(u, v) for u, v in top(lps)]}
                            for t, lps in entries]}
    tokens = [text(t) for t, _ in entries]
    offsets = list(itertools.accumulate((len(x) for x in tokens[:-1]), initial=offset))
    return {"tokens": tokens, "token_logprobs": [lps[t] for t, lps in entries],
            "top_logprobs": [{text(u): v for u, v in [(t, lps[t]), *top(lps)]} for t, lps in entries],
            "text_offset": offsets}


def logprobs_end(lp: dict[str, Any]) -> int:
    """The text offset after the last token of a completions `logprobs` (where the next chunk's starts)."""
    return lp["text_offset"][-1] + len(lp["tokens"][-1])


class Answer:
    """Builds the JSON of one completions or chat request, whole or chunk by chunk."""

    def __init__(self, gen: Generation, chat: bool, model: str, return_token_ids: bool, info: EngineInfo,
                 reasoning: Callable[[], ReasoningParser] | None = None,
                 tools: Callable[[], ToolCallParser] | None = None) -> None:
        """reasoning, tools: a new parser for each choice (chat with a reasoning parser: `reasoning_content` beside
        `content`; with tools: `tool_calls`)."""
        self.gen, self.chat, self.model, self.return_ids, self.info = gen, chat, model, return_token_ids, info
        self.k = gen.params.logprobs or 0
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.n = gen.params.n
        self.reasoning = reasoning is not None
        self.choices = [Choice(reasoning() if reasoning is not None else None, tools() if tools is not None else None)
                        for _ in range(len(gen.sink.request_ids) * self.n)]
        # (the engine may report more than was asked, e.g. the prompt's rows of a chunked prompt: what goes out is
        # what the request asked for)
        self.routed_out, self.routed_prompt = gen.params.return_routed_experts, gen.params.return_prompt_routed_experts
        self.routed = self.routed_out or self.routed_prompt

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def usage(self) -> dict[str, Any]:
        assert self.gen.accepted is not None
        prompt = sum(len(ids) for ids in self.gen.accepted.prompt_token_ids)
        completion = sum(len(c.tokens) for c in self.choices)
        # each prompt counts once, as in prompt_tokens: its first sample's (the others share what it computed)
        cached = sum(c.cached_tokens for c in self.choices[:: self.n])
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def _prompt_ids(self, index: int) -> list[int]:
        assert self.gen.accepted is not None
        return self.gen.accepted.prompt_token_ids[index // self.n]

    def _routed_b64(self, c: Choice) -> str:
        asked = (c.prompt_routed if self.routed_prompt else []) + (c.routed if self.routed_out else [])
        return routed_experts_b64(asked, self.info)

    async def whole(self) -> dict[str, Any]:
        try:
            async for upd in self.gen.updates():
                for d in upd.samples:
                    self.choices[upd.prompt_index * self.n + d.index].apply(d)
        except APIError:
            self.gen.abort()  # the answer is an error: its other prompts and samples stop too
            raise
        out = []
        for i, c in enumerate(self.choices):
            lp = logprobs_json(c.logprobs, self.k, self.chat, self.info)
            if self.chat:
                message: dict[str, Any] = {"role": "assistant", "content": c.text}
                if self.reasoning:  # (vLLM's name; null where the answer had none)
                    message["reasoning_content"] = c.reasoning or None
                if c.calls:  # (OpenAI: content null where the answer is only its calls)
                    message["tool_calls"] = [call.json() for call in c.calls]
                    message["content"] = c.text or None
                choice: dict[str, Any] = {"index": i, "message": message, "logprobs": lp,
                                          "finish_reason": c.finish_reason}
            else:
                choice = {"index": i, "text": c.text, "logprobs": lp, "finish_reason": c.finish_reason}
            choice["stop_reason"] = c.stop_reason
            if self.return_ids:
                if not self.chat:  # (chat: at the top, the answer's one prompt)
                    choice["prompt_token_ids"] = self._prompt_ids(i)
                choice["token_ids"] = c.tokens
            if self.routed:
                choice["routed_experts"] = self._routed_b64(c)
            out.append(choice)
        top = {"prompt_token_ids": self._prompt_ids(0)} if self.chat and self.return_ids else {}
        return {**self._head("chat.completion" if self.chat else "text_completion"), "choices": out,
                "usage": self.usage(), **top}

    async def stream(self, include_usage: bool) -> AsyncIterator[str]:
        """Server-sent events ending in `data: [DONE]`; an engine failure becomes an error event. Cancelled (client
        gone) or not, what has not finished is aborted."""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        # every chunk's JSON is {head, "choices": [choice], maybe "usage": null}: the head dumped once
        head, tail = json.dumps(self._head(obj))[:-1], ', "usage": null}' if include_usage else "}"

        def event(choice: dict[str, Any], prompt_ids: list[int] | None = None) -> str:
            top = f', "prompt_token_ids": {json.dumps(prompt_ids)}' if prompt_ids is not None else ""
            return f'data: {head}, "choices": [{json.dumps(choice)}]{top}{tail}\n\n'

        try:
            if self.chat:  # the role first, as OpenAI sends it
                for i, c in enumerate(self.choices):
                    c.opened = True
                    first: dict[str, Any] = {"index": i, "delta": {"role": "assistant", "content": ""},
                                             "logprobs": None, "finish_reason": None}
                    yield event(first, self._prompt_ids(i) if self.return_ids else None)
            async for batch in self.gen.batches():
                events = []
                for upd in batch:
                    for d in upd.samples:
                        i = upd.prompt_index * self.n + d.index
                        c = self.choices[i]
                        called = len(c.calls)
                        reasoning, text, calls = c.apply(d)
                        lp = logprobs_json(list(zip(d.token_ids, d.logprobs, strict=True)), self.k, self.chat,
                                           self.info, c.text_offset) if d.logprobs else None
                        if lp is not None and not self.chat:  # offsets run on across chunks, as in the whole answer
                            c.text_offset = logprobs_end(lp)
                        if not (text or reasoning or calls or d.finish_reason or lp
                                or (self.return_ids and d.token_ids)):
                            continue
                        if self.chat:
                            delta: dict[str, Any] = {"reasoning_content": reasoning} if reasoning else {}
                            if text:
                                delta["content"] = text
                            if calls:  # each whole, in the chunk that completes it
                                delta["tool_calls"] = [call.json(called + k) for k, call in enumerate(calls)]
                            choice: dict[str, Any] = {"index": i, "delta": delta, "logprobs": lp,
                                                      "finish_reason": c.finish_reason}
                        else:
                            choice = {"index": i, "text": text, "logprobs": lp, "finish_reason": d.finish_reason,
                                      "stop_reason": d.stop_reason}
                        if self.return_ids:
                            choice["token_ids"] = d.token_ids
                            if not c.opened:
                                choice["prompt_token_ids"] = self._prompt_ids(i)
                        if self.routed and d.finish_reason is not None:
                            choice["routed_experts"] = self._routed_b64(c)
                        c.opened = True
                        events.append(event(choice))
                if events:
                    yield "".join(events)  # one write for what arrived together
            if include_usage:
                yield f"data: {json.dumps({**self._head(obj), 'choices': [], 'usage': self.usage()})}\n\n"
        except APIError as e:
            yield f"data: {json.dumps(e.body())}\n\n"
        finally:
            self.gen.abort()
        yield "data: [DONE]\n\n"
