"""A request as a rank sees it: its tokens, its KV pages, its sampling state.

Plain data, so that a request moves between ranks (a layout switch) unchanged (`switch/handover.RequestList`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from moebius.link.codec import TokenIds
from moebius.sampling_params import SamplingParams

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
    prompt_token_ids: TokenIds
    params: SamplingParams
    seed: int  # resolved: the request's own or one drawn by the front end
    max_total_len: int  # prompt + output may not exceed this (context limit)
    arrival: int = 0  # global admission order (assigned by the front end): the order of the TP request list


@dataclass
class Request:
    spec: RequestSpec
    output_token_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the cache
    pages: list[int] = field(default_factory=list)  # the first KV group's page table (every layer's in most models)
    # the other KV groups' tables (ModelConfig.kv_groups[1:], sliding-window layers): page 0 before the window
    group_pages: list[list[int]] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None
    stop_reason: int | None = None  # the stop token id that ended it
    prompt_logits: list[torch.Tensor] = field(default_factory=list)  # chunks of [n, V] float32, when asked for
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache by the admission that gave its first token
    # the prefix cache's key of each of its leading full pages indexed so far (the scheduler's, per allocator)
    prefix_keys: list[int] = field(default_factory=list)

    @property
    def request_id(self) -> str:
        return self.spec.request_id

    @property
    def tables(self) -> list[list[int]]:
        """Its page table in each KV group (`memory/kv_pool.KVPages`)."""
        return [self.pages, *self.group_pages]

    def set_tables(self, tables: list[list[int]]) -> None:
        self.pages, self.group_pages = tables[0], tables[1:]

    @property
    def params(self) -> SamplingParams:
        return self.spec.params

    @property
    def num_prompt(self) -> int:
        return len(self.spec.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.spec.prompt_token_ids) + len(self.output_token_ids)

    def page_tokens(self, page: int, block_size: int) -> tuple[int, ...]:
        """The tokens of its page `page` (the prefix cache's key; PLACEHOLDER where one is still on the device)."""
        return tuple(self.tokens(page * block_size, (page + 1) * block_size))

    def tokens(self, start: int, stop: int) -> list[int]:
        prompt = self.spec.prompt_token_ids
        n = len(prompt)
        if stop <= n:
            return prompt[start:stop]
        if start >= n:  # decode: never copy the whole sequence for one token
            return self.output_token_ids[start - n: stop - n]
        return prompt[start:] + self.output_token_ids[: stop - n]

    @property
    def wants_prompt_logits(self) -> bool:
        return self.params.prompt_logits and sum(c.shape[0] for c in self.prompt_logits) < self.num_prompt

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
