"""A request as a rank sees it: its tokens, its KV pages, its sampling and stop state.

Everything here is plain data so that a request can later move between ranks (layout switch) unchanged.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from moebius.parallel.groups import ids_from_json, ids_to_json, tensor_from_json, tensor_to_json
from moebius.sampling_params import SamplingParams

_PARAM_FIELDS = [f.name for f in dataclasses.fields(SamplingParams) if f.init]

# An output token sampled by a step still running on the device (overlap scheduling); never a vocabulary id.
PLACEHOLDER = -1


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestSpec:
    """What the front end sends to the ranks for a new request (already validated and tokenized)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # resolved: the request's own or one drawn by the front end
    max_total_len: int  # prompt + output may not exceed this (context limit)
    arrival: int = 0  # global admission order (assigned by the front end): the order of the TP request list

    def to_json(self) -> dict[str, Any]:
        # token ids as base64 int32 (groups.ids_to_json): quicker both ways than a JSON list of numbers
        return dict(request_id=self.request_id, prompt_token_ids=ids_to_json(self.prompt_token_ids), seed=self.seed,
                    max_total_len=self.max_total_len, arrival=self.arrival,
                    params={k: getattr(self.params, k) for k in _PARAM_FIELDS})

    @staticmethod
    def from_json(d: dict[str, Any]) -> RequestSpec:
        return RequestSpec(d["request_id"], ids_from_json(d["prompt_token_ids"]), SamplingParams(**d["params"]),
                           d["seed"], d["max_total_len"], d["arrival"])


@dataclass
class Request:
    spec: RequestSpec
    output_token_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the cache
    pages: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    stop_text: str = ""  # decoded output, kept only when there are stop strings
    stop_offsets: tuple[int, int] = (0, 0)  # output tokens: start of the decode window, end of the decoded part
    prompt_logits: list[torch.Tensor] = field(default_factory=list)  # chunks of [n, V] float32, when asked for

    def to_json(self) -> dict[str, Any]:
        """The state that moves with the request in a switch, beside its spec (which the receiving ranks hold) and
        its output ids (which `requests_to_json` sends together); pages do not move: they are reallocated."""
        return dict(request_id=self.request_id, num_output=len(self.output_token_ids), num_computed=self.num_computed,
                    status=self.status.value, stop_text=self.stop_text, stop_offsets=list(self.stop_offsets),
                    prompt_logits=[tensor_to_json(t) for t in self.prompt_logits])

    @staticmethod
    def from_json(d: dict[str, Any], spec: RequestSpec, output: list[int]) -> Request:
        return Request(spec, output, d["num_computed"], status=Status(d["status"]), stop_text=d["stop_text"],
                       stop_offsets=tuple(d["stop_offsets"]),
                       prompt_logits=[tensor_from_json(t) for t in d["prompt_logits"]])

    @property
    def request_id(self) -> str:
        return self.spec.request_id

    @property
    def params(self) -> SamplingParams:
        return self.spec.params

    @property
    def num_prompt(self) -> int:
        return len(self.spec.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.spec.prompt_token_ids) + len(self.output_token_ids)

    def tokens(self, start: int, stop: int) -> list[int]:
        prompt = self.spec.prompt_token_ids
        n = len(prompt)
        if stop <= n:
            return prompt[start:stop]
        if start >= n:  # decode: never copy the whole sequence for one token
            return self.output_token_ids[start - n: stop - n]
        return prompt[start:] + self.output_token_ids[: stop - n]

    @property
    def stops_by_length(self) -> bool:
        """Its last token is still on the device and ends it by length whatever that token is: nothing to run."""
        p = self.params
        return self.output_token_ids[-1:] == [PLACEHOLDER] and (
            (p.max_tokens is not None and len(self.output_token_ids) >= p.max_tokens)
            or self.num_tokens >= self.spec.max_total_len)

    @property
    def wants_prompt_logits(self) -> bool:
        return self.params.prompt_logits and sum(c.shape[0] for c in self.prompt_logits) < self.num_prompt

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED


def requests_to_json(reqs: list[Request]) -> dict[str, Any]:
    """Many requests in one message, a switch's EP -> TP request list: each one's state, and the output ids of all of
    them as one base64 int32 string (the per-token work stays in C). Their specs do not travel: every EP rank keeps
    those of the other ranks' requests (`Worker.others`), since every plan brings each new one to every rank."""
    return dict(ids=ids_to_json(*(r.output_token_ids for r in reqs)), requests=[r.to_json() for r in reqs])


def requests_from_json(d: dict[str, Any], specs: Mapping[str, RequestSpec]) -> list[Request]:
    ids = ids_from_json(d["ids"])
    out, at = [], 0
    for m in d["requests"]:
        spec, n = specs.get(m["request_id"]), m["num_output"]
        if spec is None:
            raise ValueError(f"request list: request {m['request_id']!r} came without its spec, unknown here")
        if not (isinstance(n, int) and at + n <= len(ids)):
            raise ValueError("request list: token counts do not match its ids")
        out.append(Request.from_json(m, spec, ids[at: at + n]))
        at += n
    if at != len(ids):
        raise ValueError(f"request list: {len(ids) - at} token ids belong to no request")
    return out
