"""Request models of the OpenAI API (pydantic, strict: JSON `true` is no number and `"5"` no integer) and the error
shape `{"error": {"message", "type", "param", "code"}}`. Unknown fields are ignored (as OpenAI does); fields the
engine cannot honour yet are accepted at their neutral values and refused with a 400 otherwise (serving.py)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from moebius.sampling_params import INT64_MAX, INT64_MIN

# Bounds on what one request may ask for: they keep one request from taking a large share of the engine.
MAX_N = 16  # samples per prompt: each holds its own KV pages and decode slot, so n multiplies a request's memory
MAX_STOP = 16  # stop strings: every one is searched for after each token
MAX_STOP_TOKEN_IDS = 256
MAX_PROMPTS = 64  # prompts in one completions request (each is an engine request, times n)

Float = Annotated[float, Field(allow_inf_nan=False)]


class APIError(Exception):
    """An answer other than 200, in OpenAI's error shape."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def __reduce__(self) -> tuple[Any, ...]:  # pickled whole (from an engine in a process of its own)
        return APIError, (self.status, self.message, self.param, self.code, self.headers)

    @property
    def type(self) -> str:
        if self.status == 429:
            return "rate_limit_error"
        return "invalid_request_error" if self.status < 500 else "server_error"

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def unsupported(param: str, why: str) -> APIError:
    return APIError(400, f"{param} {why}", param=param, code="unsupported_parameter")


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Model):
    include_usage: bool = False


def _check_stop(value: Any) -> Any:
    if value is None or isinstance(value, str):
        return value
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise ValueError("must be a string or a list of strings")
    if len(value) > MAX_STOP:
        raise ValueError(f"at most {MAX_STOP} stop strings are allowed, got {len(value)}")
    return value


class SamplingFields(_Model):
    """What completions and chat share: the model name, sampling, stopping, streaming."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: Float | None = Field(None, ge=0)
    top_p: Float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: Float | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    presence_penalty: Float | None = Field(None, ge=-2, le=2)
    frequency_penalty: Float | None = Field(None, ge=-2, le=2)
    repetition_penalty: Float | None = Field(None, gt=0)
    logit_bias: dict[str, Float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False  # vLLM's extension: token ids of the prompt and of each choice
    # (routing replay, needs --enable-return-routed-experts) each choice's `routed_experts`: its output tokens' and,
    # with return_prompt_routed_experts, its prompt's router choices, encoded as /generate's meta_info.routed_experts
    return_routed_experts: bool = False
    return_prompt_routed_experts: bool = False
    user: str | None = None  # ignored

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_shape(cls, value: Any) -> Any:
        return _check_stop(value)


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_N)

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value: Any) -> Any:
        def ids(v: Any) -> bool:
            return isinstance(v, list) and bool(v) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)

        ok = isinstance(value, str) or (isinstance(value, list) and bool(value) and (
            all(isinstance(p, str) for p in value) or ids(value) or all(ids(p) for p in value)))
        if not ok:
            raise ValueError("must be a string, a list of strings, a list of token ids, or a list of lists of token "
                             "ids (none of them empty)")
        if isinstance(value, list) and value and not isinstance(value[0], int) and len(value) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts are allowed in one request, got {len(value)}")
        return value


class ContentPart(_Model):
    type: str
    text: str | None = None


class FunctionCall(_Model):
    name: str = Field(min_length=1)
    arguments: str  # JSON text, as OpenAI sends it


class MessageToolCall(_Model):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Model):
    role: str = Field(min_length=1)
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's calls, earlier in the conversation
    tool_call_id: str | None = None  # a tool message: the call it answers


class Function(_Model):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema


class Tool(_Model):
    type: Literal["function"]
    function: Function


class NamedToolChoice(_Model):
    type: Literal["function"]
    function: dict[str, str]


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class _AdminModel(BaseModel):
    """An operator's body: a misspelt field is refused (it would otherwise leave the setting as it was, unsaid)."""

    model_config = ConfigDict(extra="forbid", strict=True)


class SwitchRequest(_AdminModel):
    mode: str


class PolicyRequest(_AdminModel):
    """POST /admin/policy: "off", or the policy's settings (the engine flags without `switch_`), each finite and not
    negative (JSON's parser reads NaN, Infinity and 1e999 as floats: refused here)."""

    policy: Literal["threshold", "cost", "off"] | None = None
    profile: Literal["interactive", "rollout"] | None = None
    high: Float | None = Field(None, ge=0)
    low: Float | None = Field(None, ge=0)
    window: int | None = Field(None, ge=1)
    cooldown: Float | None = Field(None, ge=0)



# ---- SGLang's weight updates from a trainer's process group (its payloads; `master_port` may come as a string) ----
class InitWeightsUpdateGroupBody(BaseModel):
    model_config = ConfigDict(extra="forbid")  # not strict: SGLang's trainers send master_port as "29500" too
    master_address: str = Field(min_length=1)
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = Field("weight_update_group", min_length=1)
    backend: Literal["nccl", "gloo"] | None = None  # none given: nccl on GPUs, gloo on CPUs


class UpdateWeightsFromDistributedBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    names: list[str] = Field(min_length=1)
    dtypes: list[str]  # "bfloat16" or "torch.bfloat16"
    shapes: list[list[int]]
    group_name: str = Field("weight_update_group", min_length=1)
    weight_version: str | None = None
    flush_cache: bool = True  # the prefix cache is flushed either way (its pages hold the old weights' KV)
    abort_all_requests: bool = False
    load_format: str | None = None  # null, "auto", "direct": a broadcast a tensor; "flattened_bucket": one in all


class DestroyWeightsUpdateGroupBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    group_name: str = Field("weight_update_group", min_length=1)
