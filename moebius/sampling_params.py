"""Per-request generation parameters (the vLLM names and meanings), validated on construction and on every later
assignment to a field."""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

MAX_LOGPROBS = 20  # the most top tokens a step returns per output token (OpenAI's top_logprobs limit)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # the sampler carries seeds as int64 tensors


class RequestOutputKind(enum.Enum):
    """What a request's outputs hold each time the engine returns one (vLLM's names)."""

    CUMULATIVE = 0  # everything so far (tokens, text, log-probabilities), after every step that changed it
    DELTA = 1  # only what is new since the last output (a stream); text never retracted (stop strings held back)
    FINAL_ONLY = 2  # one output, when the request has finished


@dataclass
class SamplingParams:
    """How to generate for one request.

    temperature 0 is greedy. With a `seed`, sampling is reproducible and independent of batching: the noise for
    output token j of a request is a pure function of (seed, j), so the same request gives the same tokens in any
    batch, after preemption, and (later) after moving between ranks.

    Assigning a field later (`sp.temperature = 0.5`) checks the whole again: a bad value raises ValueError and leaves
    the object as it was. The engine admits a snapshot, so changing one after `generate` / `add_request` changes
    no request already admitted.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: all tokens
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely one (0: off)
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the context length
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Return the logits of every prompt position (float32, on CPU) in the output: for scoring and tests.
    prompt_logits: bool = False
    # Return each output token's log-probability under the model (the raw distribution, before temperature and
    # cuts; the engine's --logprobs-mode picks another) and the `logprobs` most likely tokens' (0: the sampled
    # token's alone; None: nothing), as vLLM does.
    logprobs: int | None = None
    # (routing replay) CompletionOutput.routed_experts: per output token, each MoE layer's top-k expert ids of the
    # forward that sampled it (SGLang's name); return_prompt_routed_experts adds CompletionOutput.
    # prompt_routed_experts, those of every prompt token but the last (whose forward samples the first output token)
    return_routed_experts: bool = False
    return_prompt_routed_experts: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    stop_strings: tuple[str, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._check()
        object.__setattr__(self, "_ready", True)

    def __setattr__(self, name: str, value: Any) -> None:
        if not self.__dict__.get("_ready"):  # inside __init__: __post_init__ checks every field at once
            object.__setattr__(self, name, value)
            return
        if name == "stop_strings":
            raise AttributeError("stop_strings is derived from stop: assign stop instead")
        if name not in _FIELDS:  # a misspelt field would otherwise be taken silently and do nothing
            raise AttributeError(f"SamplingParams has no field {name!r}")
        checked = dataclasses.replace(self, **{name: value})  # the constructor's checks, on the whole
        for f in (*_FIELDS, "stop_strings"):
            object.__setattr__(self, f, getattr(checked, f))

    def clone(self) -> SamplingParams:
        """A checked copy that shares no list with this one (what the engine admits: later edits of this object,
        even in place, reach no request already admitted)."""
        return dataclasses.replace(self, stop=list(self.stop) if isinstance(self.stop, list | tuple) else self.stop,
                                   stop_token_ids=None if self.stop_token_ids is None else list(self.stop_token_ids))

    def _check(self) -> None:
        """Check every field (ValueError naming the field and the value) and set the derived ones."""
        _int("n", self.n, lo=1)
        _real("temperature", self.temperature, "must be a number >= 0", lambda v: v >= 0)
        _real("top_p", self.top_p, "must be a number in (0, 1]", lambda v: 0.0 < v <= 1.0)
        _int("top_k", self.top_k, lo=-1, what="-1 (disabled) or a positive integer")
        _real("min_p", self.min_p, "must be a number in [0, 1]", lambda v: 0.0 <= v <= 1.0)
        if self.logprobs is not None:
            _int("logprobs", self.logprobs, lo=0)
            if self.logprobs > MAX_LOGPROBS:
                raise ValueError(f"logprobs must be at most {MAX_LOGPROBS}, got {self.logprobs}")
        if self.max_tokens is not None:
            _int("max_tokens", self.max_tokens, lo=1)
        _int("min_tokens", self.min_tokens, lo=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens {self.min_tokens} is larger than max_tokens {self.max_tokens}")
        if self.seed is not None:
            _int("seed", self.seed, lo=INT64_MIN, hi=INT64_MAX, what="an integer in [-2**63, 2**63 - 1] (int64)")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "prompt_logits",
                     "return_routed_experts", "return_prompt_routed_experts"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.stop is not None and not isinstance(self.stop, str | list | tuple):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in stops):
            raise ValueError(f"stop strings must be non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop_strings", tuple(stops))
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, list | tuple):
                raise ValueError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
            for t in self.stop_token_ids:
                _int("stop_token_ids", t, lo=0, what="non-negative integers")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        if self.top_k == 0:
            object.__setattr__(self, "top_k", -1)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams) if f.init)


def _int(name: str, v: object, lo: int | None = None, what: str | None = None, hi: int | None = None) -> None:
    """An integer (not a bool, not a float) in [lo, hi]; ValueError naming the field otherwise."""
    if (isinstance(v, bool) or not isinstance(v, int) or (lo is not None and v < lo)
            or (hi is not None and v > hi)):
        want = what or ("an integer" if lo is None else f"an integer >= {lo}")
        raise ValueError(f"{name} must be {want}, got {v!r}")


def _real(name: str, v: object, rule: str, ok: Callable[[float], bool]) -> None:
    """A finite number (not a bool) that satisfies `ok`; ValueError naming the field otherwise."""
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or not ok(float(v)):
        raise ValueError(f"{name} {rule}, got {v!r}")

