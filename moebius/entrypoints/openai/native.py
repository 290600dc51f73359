"""SGLang's native `/generate` (the endpoint RL trainers such as slime and AReaL call): its request body (`text` or
`input_ids`, a `sampling_params` dict with SGLang's names, `return_logprob`, `stream`) and its answer (`text`,
`output_ids`, `meta_info` with the finish reason as an object, the token counts, `output_token_logprobs` as
`[logprob, token_id, text]` and the `weight_version`), one object for one prompt and sample, a list otherwise.
Written from SGLang's documented payloads; no SGLang code."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from moebius.entrypoints.openai.engine_loop import EngineInfo
from moebius.entrypoints.openai.protocol import MAX_N, MAX_PROMPTS, MAX_STOP_TOKEN_IDS, APIError, Float, _check_stop
from moebius.entrypoints.openai.serving import Choice, routed_experts_b64
from moebius.sampling_params import INT64_MAX, INT64_MIN, MAX_LOGPROBS, SamplingParams

if TYPE_CHECKING:
    from moebius.entrypoints.openai.serving import Generation
    from moebius.frontend.core import Prompt

SGLANG_DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default when sampling_params gives none


class _Strict(BaseModel):
    # a misspelt field is refused naming it (silently ignored, it would sample with a default the trainer did not ask)
    model_config = ConfigDict(extra="forbid", strict=True)


class NativeSampling(_Strict):
    """SGLang's sampling_params, by its names; the penalties and special-token spacing only at their neutral values."""

    max_new_tokens: int | None = Field(SGLANG_DEFAULT_MAX_NEW_TOKENS, ge=1)
    min_new_tokens: int = Field(0, ge=0)
    temperature: Float = Field(1.0, ge=0)
    top_p: Float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)
    min_p: Float = Field(0.0, ge=0, le=1)
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False  # keep a matched stop string in the text
    n: int = Field(1, ge=1, le=MAX_N)
    sampling_seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    presence_penalty: Float = 0.0
    frequency_penalty: Float = 0.0
    repetition_penalty: Float = 1.0
    spaces_between_special_tokens: bool = True

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_shape(cls, value: Any) -> Any:
        return _check_stop(value)


class GenerateRequest(_Strict):
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: NativeSampling | list[NativeSampling] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool = False
    top_logprobs_num: int = Field(0, ge=0, le=MAX_LOGPROBS)
    return_text_in_logprobs: bool = False
    logprob_start_len: int = Field(-1, ge=-1)  # -1: the output's tokens only (prompt log-probabilities: not served)
    return_routed_experts: bool = False  # meta_info.routed_experts: the routing of prompt + output[:-1] (SGLang's)
    stream: bool = False


def _params(sp: NativeSampling, info: EngineInfo, logprobs: int | None, routed: bool, where: str) -> SamplingParams:
    for name, neutral in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0)):
        if getattr(sp, name) != neutral:
            raise APIError(400, f"{where}.{name} {getattr(sp, name):g} is not supported (only {neutral:g}: no "
                           "penalty)", param=f"{where}.{name}", code="unsupported_parameter")
    if not sp.spaces_between_special_tokens:
        raise APIError(400, f"{where}.spaces_between_special_tokens false is not supported",
                       param=f"{where}.spaces_between_special_tokens", code="unsupported_parameter")
    if sp.max_new_tokens is not None and sp.max_new_tokens > info.max_model_len:
        raise APIError(400, f"{where}.max_new_tokens {sp.max_new_tokens} exceeds the model's context length "
                       f"{info.max_model_len}", param=f"{where}.max_new_tokens")
    if sp.stop_token_ids and max(sp.stop_token_ids) >= info.vocab_size:
        raise APIError(400, f"{where}.stop_token_ids must be below the vocabulary size {info.vocab_size}, got "
                       f"{max(sp.stop_token_ids)}", param=f"{where}.stop_token_ids")
    try:
        return SamplingParams(
            n=sp.n, temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k, min_p=sp.min_p,
            seed=sp.sampling_seed, max_tokens=sp.max_new_tokens, min_tokens=sp.min_new_tokens, stop=sp.stop,
            stop_token_ids=sp.stop_token_ids, ignore_eos=sp.ignore_eos, include_stop_str_in_output=sp.no_stop_trim,
            skip_special_tokens=sp.skip_special_tokens, logprobs=logprobs, return_routed_experts=routed,
            return_prompt_routed_experts=routed)
    except (ValueError, TypeError) as e:  # (min_new_tokens above max_new_tokens, ...)
        raise APIError(400, f"{where}: {e}", param=where) from None


def generate_items(body: GenerateRequest, info: EngineInfo) -> tuple[list[tuple[Prompt, SamplingParams]], list[str],
                                                                       str, bool]:
    """The engine requests of a /generate body (one per prompt), the rid of each prompt, the field that holds the
    prompts (for errors) and whether the answer is a list (a batch). APIError 400 naming the field otherwise."""
    if (body.text is None) == (body.input_ids is None):
        raise APIError(400, "give exactly one of text and input_ids", param="text" if body.text else "input_ids")
    field = "text" if body.text is not None else "input_ids"
    given: Any = body.text if body.text is not None else body.input_ids
    batch = isinstance(given, list) and bool(given) and not isinstance(given[0], int)
    prompts: list[Prompt] = list(given) if batch else [given]
    if not prompts or any(not p for p in prompts):
        raise APIError(400, f"{field} must not be empty (nor any prompt in it)", param=field)
    if len(prompts) > MAX_PROMPTS:
        raise APIError(400, f"at most {MAX_PROMPTS} prompts are allowed in one request, got {len(prompts)}",
                       param=field)
    n = len(prompts)
    sps = body.sampling_params if body.sampling_params is not None else NativeSampling()
    listed = isinstance(sps, list)
    if isinstance(sps, list):
        if len(sps) != n:
            raise APIError(400, f"sampling_params has {len(sps)} entries for {n} prompts", param="sampling_params")
    else:
        sps = [sps] * n
    shortest = min(len(p) for p in prompts) if field == "input_ids" else None
    if body.logprob_start_len != -1 and (shortest is None or body.logprob_start_len < shortest):
        raise APIError(400, f"logprob_start_len {body.logprob_start_len}: the prompt's log-probabilities are not "
                       "served; give -1 (the output's tokens only)", param="logprob_start_len")
    logprobs = body.top_logprobs_num if body.return_logprob else None
    routed = body.return_routed_experts
    items = [(p, _params(sp, info, logprobs, routed, f"sampling_params[{i}]" if listed else "sampling_params"))
             for i, (p, sp) in enumerate(zip(prompts, sps, strict=True))]
    if body.rid is None:
        rids = [uuid.uuid4().hex for _ in prompts]
    else:
        rids = [body.rid] if isinstance(body.rid, str) else list(body.rid)
        if len(rids) != n:
            raise APIError(400, f"rid has {len(rids)} ids for {n} prompts", param="rid")
        if len(set(rids)) != n or any(not r for r in rids):
            raise APIError(400, f"rid must be distinct non-empty strings, got {rids}", param="rid")
    return items, rids, field, batch or any(p.n > 1 for _, p in items)


def finish_reason(s: Choice, max_tokens: int | None) -> dict[str, Any] | None:
    """SGLang's finish reason object: {"type": "length", "length": n}, {"type": "stop", "matched": the stop token
    id or string (EOS: its id)}, {"type": "abort", "message": ...}; None while running."""
    if s.finish_reason is None:
        return None
    if s.finish_reason == "length":
        return {"type": "length", "length": max_tokens if max_tokens is not None else len(s.tokens)}
    if s.finish_reason == "stop":
        return {"type": "stop", "matched": s.stop_reason if s.stop_reason is not None else
                (s.tokens[-1] if s.tokens else None)}
    return {"type": s.finish_reason, "message": "aborted" if s.finish_reason == "abort" else s.finish_reason}


class NativeAnswer:
    """The /generate answer of one HTTP request, whole or as server-sent events (each with everything so far, as
    SGLang streams by default)."""

    def __init__(self, gen: Generation, rids: list[str], body: GenerateRequest, info: EngineInfo,
                 items: list[tuple[Prompt, SamplingParams]], as_list: bool) -> None:
        self.gen, self.rids, self.body, self.info, self.as_list = gen, rids, body, info, as_list
        self.params = [p for _, p in items]
        self.first = [0]  # index of each prompt's first sample in the flat list
        for p in self.params:
            self.first.append(self.first[-1] + p.n)
        self.samples = [Choice() for _ in range(self.first[-1])]
        self.weight_version: str | None = None
        self.start = time.perf_counter()

    def _text(self, t: int) -> str | None:
        if not self.body.return_text_in_logprobs:
            return None
        tok = self.info.tokenizer
        return tok.decode([t], skip_special_tokens=False) if tok is not None else None

    def _item(self, i: int) -> dict[str, Any]:
        assert self.gen.accepted is not None
        prompt = next(k for k in range(len(self.params)) if self.first[k] <= i < self.first[k + 1])
        s, params = self.samples[i], self.params[prompt]
        n = params.n
        meta: dict[str, Any] = {
            "id": self.rids[prompt] if n == 1 else f"{self.rids[prompt]}-{i - self.first[prompt]}",
            "finish_reason": finish_reason(s, params.max_tokens),
            "prompt_tokens": len(self.gen.accepted.prompt_token_ids[prompt]), "completion_tokens": len(s.tokens),
            "cached_tokens": s.cached_tokens, "weight_version": self.weight_version,
            "e2e_latency": time.perf_counter() - self.start}
        if self.body.return_logprob:
            meta["output_token_logprobs"] = [[lps.get(t), t, self._text(t)]
                                             for t, lps in s.logprobs]
            if self.body.top_logprobs_num:
                k = self.body.top_logprobs_num
                meta["output_top_logprobs"] = [[[v, u, self._text(u)] for u, v in sorted(
                    lps.items(), key=lambda kv: -kv[1])[:k]] for _, lps in s.logprobs]
        if self.body.return_routed_experts:  # shaped (prompt + output - 1 tokens, decoder layers, top-k)
            meta["routed_experts"] = routed_experts_b64(s.prompt_routed + s.routed, self.info)
        return {"text": s.text, "output_ids": list(s.tokens), "meta_info": meta}

    def _apply(self, upd: Any) -> list[int]:
        """An update's samples into the answer; the flat indices it touched."""
        self.weight_version = upd.weight_version  # the weights of its latest tokens
        touched = []
        for d in upd.samples:
            i = self.first[upd.prompt_index] + d.index
            self.samples[i].apply(d)
            touched.append(i)
        return touched

    async def whole(self) -> Any:
        try:
            async for upd in self.gen.updates():
                self._apply(upd)
        except APIError:
            self.gen.abort()  # the answer is an error: its other prompts and samples stop too
            raise
        items = [self._item(i) for i in range(len(self.samples))]
        return items if self.as_list else items[0]

    async def stream(self) -> AsyncIterator[str]:
        """`data: {...}` events, each one sample's whole answer so far (with its "index" in a batch), then
        `data: [DONE]`; an engine failure becomes an error event."""
        try:
            async for batch in self.gen.batches():
                events = []
                for upd in batch:
                    for i in dict.fromkeys(self._apply(upd)):
                        item = self._item(i)
                        if self.as_list:
                            item["index"] = i
                        events.append(f"data: {json.dumps(item)}\n\n")
                if events:
                    yield "".join(events)
        except APIError as e:
            yield f"data: {json.dumps(e.body())}\n\n"
        finally:
            self.gen.abort()
        yield "data: [DONE]\n\n"


# ---- the RL trainers' control bodies (SGLang's names) ----
class PauseBody(_Strict):
    """POST /pause_generation: SGLang's modes (abort, retract, in_place) and vLLM's keep; an empty body: abort."""

    mode: str = "abort"


class ContinueBody(_Strict):
    torch_empty_cache: bool = True  # (nothing to empty: the unified buffer keeps its memory)


class ResumeMemoryBody(_Strict):
    """POST /resume_memory_occupation (SGLang's): tags "weights", "kv_cache" (none or an empty body: both)."""

    tags: list[str] | None = None


class ReleaseMemoryBody(ResumeMemoryBody):
    """POST /release_memory_occupation (SGLang's), and keep_weights (ours): the weights wait in host memory and come
    back on resume (false: dropped, as SGLang without --enable-weights-cpu-backup; update them after the resume)."""

    keep_weights: bool = True


class AbortBody(_Strict):
    rid: str = ""
    abort_all: bool = False


class AbortRequestsBody(_Strict):
    """POST /abort_requests (vLLM's): /generate rids (or the engine's own request ids); none or empty: all."""

    request_ids: list[str] | None = None


class _UpdateBody(_Strict):
    """What every SGLang weight-update body carries."""

    weight_version: str | None = None
    flush_cache: bool = True  # the prefix cache is flushed either way (its pages hold the old weights' KV)
    abort_all_requests: bool = False


class UpdateFromDiskBody(_UpdateBody):
    model_path: str = Field(min_length=1)
    load_format: str | None = None  # "auto" or "safetensors": the only format read

    @field_validator("load_format")
    @classmethod
    def _format(cls, value: str | None) -> str | None:
        if value not in (None, "auto", "safetensors"):
            raise ValueError("only safetensors directories are read: give auto, safetensors or null")
        return value


class UpdateWeightsFromTensorBody(_UpdateBody):
    """POST /update_weights_from_tensor (SGLang's route, loopback callers only): `named_tensors` is the plain
    description `moebius.link.tensor_handles.export_tensors` makes (CUDA IPC handles, a shared-memory segment) in
    place of SGLang's `serialized_named_tensors`, which are pickles and never read here."""

    # SGLang's pickled tensors: refused naming what to send instead (first: its complaint is the one reported)
    serialized_named_tensors: Any = None
    named_tensors: dict[str, Any]
    load_format: str | None = None  # "direct" (SGLang's default) or null: the tensors are the model's own

    @field_validator("load_format")
    @classmethod
    def _format(cls, value: str | None) -> str | None:
        if value not in (None, "direct"):
            raise ValueError("the tensors are read as the model's own names: give direct or null")
        return value

    @field_validator("serialized_named_tensors")
    @classmethod
    def _pickles(cls, value: Any) -> Any:
        raise ValueError("pickled tensors are never read: send named_tensors, the plain description of "
                         "moebius.link.tensor_handles.export_tensors")
