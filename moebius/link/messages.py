"""What the front end and the ranks tell each other (carried as JSON by `link/codec.py`): each step's plan, each
rank's report, and a switch's request list."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Self

import torch

from moebius.link.codec import TokenIds
from moebius.link.request import Request, RequestSpec, Status


@dataclass
class StepPlan:
    """What the front end tells every rank before a step: requests to admit and abort, an optional layout switch
    (done before the step), whether to run a forward step, and an optional query (diagnostics, answered per rank)."""

    new: list[RequestSpec] = field(default_factory=list)
    # the rank running each request, where the layout places them (EP): the new ones, and with a switch into EP
    # every live one; a request not named here runs on every rank
    owners: dict[str, int] = field(default_factory=dict)
    aborts: list[str] = field(default_factory=list)
    # requests that ended since the last plan (the front end saw their last token): EP ranks forget their specs
    retired: list[str] = field(default_factory=list)
    switch_to: str | None = None
    run: bool = True
    query: dict[str, Any] | None = None  # {"name": ..., **arguments}


@dataclass
class TokenDelta:
    """What a rank reports for one request after a step."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None
    prompt_logits: torch.Tensor | None = None
    # (SamplingParams.logprobs) the new token's log-probability then its top k's, and their ids (the token's first)
    logprobs: list[float] | None = None
    logprob_ids: list[int] | None = None
    cached_tokens: int | None = None  # on a request's first token: prompt tokens taken from the prefix cache

    def __reduce__(self) -> tuple[type[TokenDelta], tuple[Any, ...]]:
        # pickled as the constructor's arguments (its fields, in order): a rank process's reply carries one a
        # request every step, and this loads in a third of the default's time (1.3 -> 0.5 ms at 1024 on the CPU)
        return TokenDelta, tuple(getattr(self, f.name) for f in _DELTA_FIELDS)


_DELTA_FIELDS = dataclasses.fields(TokenDelta)


def split_evenly(total: int, parts: int) -> list[int]:
    """`parts` sizes as equal as integers allow (the larger first) that add up to `total`."""
    return [total // parts + (i < total % parts) for i in range(parts)]


def attended_pairs(start: int, tokens: int) -> int:
    """(query, key) pairs a causal chunk of `tokens` new tokens after `start` cached ones computes."""
    return tokens * start + tokens * (tokens + 1) // 2


class _Summed:
    """A dataclass of numbers that adds field by field (a step's work, rank times: summed over ranks or steps)."""

    def __add__(self, other: Self) -> Self:
        pairs = zip(dataclasses.astuple(self), dataclasses.astuple(other), strict=True)  # type: ignore[call-overload]
        return type(self)(*(a + b for a, b in pairs))


@dataclass
class StepWork(_Summed):
    """What a launched step computes (the floor model prices it): new tokens (prefill chunks and decodes), the
    sequences they belong to, KV tokens its attention reads (each sequence's length after the step), the (query,
    key) pairs attention computes (each new token's position + 1), and the rows sampled."""

    tokens: int = 0
    decode_tokens: int = 0  # of `tokens`: decodes (one output-position token that samples)
    sequences: int = 0
    kv_tokens: int = 0
    attended: int = 0
    sampled: int = 0
    preempted: int = 0  # requests preempted to schedule it (their KV freed; they recompute)


@dataclass
class KVStats:
    free_tokens: int
    total_tokens: int


@dataclass
class RankTimes(_Summed):
    """Where rank 0's time went between two plans (ms): its host work for a plan (scheduling, metadata, launches,
    bookkeeping, a switch's host side), the time it blocked on the device for a step's tokens (overlap: the step
    before's), and, with the rank in a process of its own, the time it waited for the plan itself (the front end's
    turn). A rank whose sync is ~0 keeps the device waiting on its host work; a long wait is the front end's."""

    host_ms: float = 0.0
    sync_ms: float = 0.0
    wait_ms: float = 0.0


@dataclass
class RankReport:
    """What one rank sends back after a plan."""

    deltas: list[TokenDelta]
    kv: KVStats
    running: int = 0  # requests this rank runs and waiting, where it reports them (Layout.reports_deltas)
    waiting: int = 0
    work: StepWork = field(default_factory=StepWork)  # the step it launched, where it reports (as the counts)
    switch: dict[str, Any] | None = None  # the switch outcome, when the plan asked for a switch
    query: Any = None  # the answer, when the plan asked a query
    # device times of a switch that rode on the step before (Switcher.pass_times): they come a step late
    switch_times: dict[str, Any] | None = None
    times: RankTimes = field(default_factory=RankTimes)


@dataclass
class StepResult:
    """The ranks' reports, gathered for the front end."""

    deltas: list[TokenDelta]
    kv: list[KVStats]  # per rank
    running: int = 0  # requests running and waiting on the ranks, each counted once
    waiting: int = 0
    work: StepWork = field(default_factory=StepWork)  # the steps launched, summed over the ranks that ran distinct ones
    switch: dict[str, Any] | None = None  # rank 0's switch outcome
    query: list[Any] | None = None  # per rank
    switch_times: dict[str, Any] | None = None  # rank 0's
    times: RankTimes = field(default_factory=RankTimes)  # rank 0's

    @staticmethod
    def gather(reports: list[RankReport]) -> StepResult:
        return StepResult([d for r in reports for d in r.deltas], [r.kv for r in reports],
                          sum(r.running for r in reports), sum(r.waiting for r in reports),
                          sum((r.work for r in reports), StepWork()), reports[0].switch, [r.query for r in reports],
                          reports[0].switch_times, reports[0].times)

    def waited(self, ms: float) -> StepResult:
        """This result with rank 0's wait for its plan (known only where the plan was received)."""
        return dataclasses.replace(self, times=dataclasses.replace(self.times, wait_ms=ms))


# ---- a switch's request list ----
@dataclass
class RequestState:
    """What moves with a request in a switch beside its spec (which every rank holds) and its output ids (sent
    together for the whole list); pages do not move: they are allocated again."""

    request_id: str
    num_output: int
    num_computed: int
    status: Status
    stop_text: str
    stop_offsets: tuple[int, int]
    prompt_logits: list[torch.Tensor]
    num_cached_tokens: int
    prefix_keys: TokenIds  # its source rank's prefix-cache keys: which pages it shares (switch/requests.py)


@dataclass
class RequestList:
    """Requests in one message: their states, and all their output ids as one `TokenIds`."""

    ids: TokenIds
    requests: list[RequestState]

    @staticmethod
    def of(reqs: list[Request]) -> RequestList:
        return RequestList(list(itertools.chain.from_iterable(r.output_token_ids for r in reqs)),
                           [RequestState(r.request_id, len(r.output_token_ids), r.num_computed, r.status, r.stop_text,
                                         r.stop_offsets, r.prompt_logits, r.num_cached_tokens, r.prefix_keys)
                            for r in reqs])

    def requests_with(self, specs: Mapping[str, RequestSpec]) -> list[Request]:
        """The requests, given the specs of every one of them."""
        out, at = [], 0
        for m in self.requests:
            spec = specs.get(m.request_id)
            if spec is None:
                raise ValueError(f"request list: request {m.request_id!r} came without its spec, unknown here")
            if not (m.num_output >= 0 and at + m.num_output <= len(self.ids)):
                raise ValueError("request list: token counts do not match its ids")
            out.append(Request(spec, self.ids[at: at + m.num_output], m.num_computed, status=m.status,
                               stop_text=m.stop_text, stop_offsets=m.stop_offsets, prompt_logits=m.prompt_logits,
                               num_cached_tokens=m.num_cached_tokens, prefix_keys=list(m.prefix_keys)))
            at += m.num_output
        if at != len(self.ids):
            raise ValueError(f"request list: {len(self.ids) - at} token ids belong to no request")
        return out
