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

    def to_json(self, tokens: bool = True) -> dict[str, Any]:
        """tokens=False: the prompt's length instead of its ids (`requests_to_json` sends the ids apart)."""
        # token ids as base64 int32 (groups.ids_to_json): quicker both ways than a JSON list of numbers
        ids = ids_to_json(self.prompt_token_ids) if tokens else len(self.prompt_token_ids)
        return dict(request_id=self.request_id, prompt_token_ids=ids, seed=self.seed,
                    max_total_len=self.max_total_len, arrival=self.arrival,
                    params={k: getattr(self.params, k) for k in _PARAM_FIELDS})

    @staticmethod
    def from_json(d: dict[str, Any], prompt: list[int] | None = None) -> RequestSpec:
        """prompt: the ids of a spec sent without them."""
        ids = prompt if prompt is not None else ids_from_json(d["prompt_token_ids"])
        return RequestSpec(d["request_id"], ids, SamplingParams(**d["params"]), d["seed"], d["max_total_len"],
                           d["arrival"])


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

    def to_json(self, tokens: bool = True, spec: bool = True) -> dict[str, Any]:
        """Everything that moves with the request in a switch (pages do not: they are reallocated). tokens=False:
        the prompt's and the output's lengths instead of their ids (`requests_to_json` sends the ids apart);
        spec=False: only the request id of the spec, for a receiver that holds the spec already."""
        out = ids_to_json(self.output_token_ids) if tokens else len(self.output_token_ids)
        return dict(spec=self.spec.to_json(tokens) if spec else self.request_id, output_token_ids=out,
                    num_computed=self.num_computed,
                    status=self.status.value, stop_text=self.stop_text, stop_offsets=list(self.stop_offsets),
                    prompt_logits=[tensor_to_json(t) for t in self.prompt_logits])

    @staticmethod
    def from_json(d: dict[str, Any], prompt: list[int] | None = None, output: list[int] | None = None,
                  spec: RequestSpec | None = None) -> Request:
        """prompt, output: the ids of a request sent without them; spec: its spec, sent as its id only."""
        return Request(spec or RequestSpec.from_json(d["spec"], prompt),
                       output if output is not None else ids_from_json(d["output_token_ids"]), d["num_computed"],
                       status=Status(d["status"]), stop_text=d["stop_text"], stop_offsets=tuple(d["stop_offsets"]),
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


def requests_to_json(reqs: list[Request], specs_known: bool = False) -> dict[str, Any]:
    """Many requests in one message (a switch's EP -> TP request list carries every live token): the token ids of
    all of them as one base64 int32 string (each request's prompt then output; the per-token work stays in C), the
    rest per request. specs_known: the receivers hold every request's spec already (an EP rank keeps those of the
    other ranks' requests: `Worker.others`), so only its id travels, and of the tokens only the outputs."""
    seqs = (seq for r in reqs for seq in ((r.output_token_ids,) if specs_known
                                          else (r.spec.prompt_token_ids, r.output_token_ids)))
    return dict(ids=ids_to_json(*seqs), requests=[r.to_json(tokens=False, spec=not specs_known) for r in reqs])


def requests_from_json(d: dict[str, Any], specs: Mapping[str, RequestSpec] | None = None) -> list[Request]:
    """specs: where to find the specs of a message sent with specs_known."""
    ids = ids_from_json(d["ids"])
    out, at = [], 0
    for m in d["requests"]:
        spec = None
        if isinstance(m["spec"], str):
            spec = (specs or {}).get(m["spec"])
            if spec is None:
                raise ValueError(f"request list: request {m['spec']!r} came without its spec, unknown here")
        n_prompt, n_out = (0 if spec else m["spec"]["prompt_token_ids"]), m["output_token_ids"]
        if not (isinstance(n_prompt, int) and isinstance(n_out, int) and at + n_prompt + n_out <= len(ids)):
            raise ValueError("request list: token counts do not match its ids")
        out.append(Request.from_json(m, ids[at: at + n_prompt], ids[at + n_prompt: at + n_prompt + n_out], spec))
        at += n_prompt + n_out
    if at != len(ids):
        raise ValueError(f"request list: {len(ids) - at} token ids belong to no request")
    return out
