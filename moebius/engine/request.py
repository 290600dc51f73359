"""A request as a rank sees it: its tokens, its KV pages, its sampling and stop state.

Everything here is plain data so that a request can later move between ranks (layout switch) unchanged.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from moebius.sampling_params import SamplingParams


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
    stop_ids_seen: int = 0  # output tokens already decoded into stop_text
    prompt_logits: list = field(default_factory=list)  # chunks of [n, V] float32, when asked for

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

    def token(self, i: int) -> int:
        n = len(self.spec.prompt_token_ids)
        return self.spec.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]

    def tokens(self, start: int, stop: int) -> list[int]:
        n = len(self.spec.prompt_token_ids)
        if stop <= n:
            return self.spec.prompt_token_ids[start:stop]
        return (self.spec.prompt_token_ids + self.output_token_ids)[start:stop]

    @property
    def wants_prompt_logits(self) -> bool:
        return self.params.prompt_logits and sum(c.shape[0] for c in self.prompt_logits) < self.num_prompt

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
