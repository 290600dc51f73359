"""What the front end and the ranks tell each other, carried as JSON by `link/codec.py` between ranks and as
pickles over rank 0's local pipe.

Front end -> ranks: a `StepPlan` before each step (its parts typed: admissions, releases, a weight update, a switch
order, a diagnostic query) or, off the serving path, a `DecodeProbe` / `PrefillProbe` that times steps for a benchmark.
Ranks -> front end: a `StepReport` (one rank's, merged over the ranks for the front end), whose token deltas are
the one stream every output is built from, and, with a switch, its `SwitchOutcome` (with an update, its
`UpdateOutcome`; with a memory release or resume, its `MemoryOutcome`).
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any, Self

import torch

from moebius.link.request import RequestSpec


# ---- front end -> ranks ----
@dataclass
class Admit:
    """A new request, validated and tokenized. owner: the rank that runs it where the layout places requests
    (EP); None: every rank runs it."""

    spec: RequestSpec
    owner: int | None = None


@dataclass
class SwitchOrder:
    """Switch to `target` ("tp" | "ep") before the step; owners: with a switch into EP, the rank of every live
    request (the front end's placement)."""

    target: str
    owners: dict[str, int] = field(default_factory=dict)


@dataclass
class WeightUpdate:
    """New values of some of the model's weights, written on every rank between two steps
    (`worker/weight_update.py`), by their Hugging Face checkpoint names: the tensors of a safetensors directory
    (`path`: every rank reads its own cut), or tensors in memory: by handle (`handles`), or, with the one rank in the
    front end's process, the tensors themselves."""

    path: str | None = None
    # one rank in this process: the checked tensors as they are (not an init field: it never travels)
    local: dict[str, torch.Tensor] = field(default_factory=dict, init=False, repr=False)
    # from a trainer's process group (`worker/update_group.py`): the tensors its rank 0 broadcasts, in this order
    broadcast: BroadcastTensors | None = None
    # join or leave a trainer's process group: no weight is written (nor the prefix cache flushed)
    group: UpdateGroupOrder | None = None
    # tensors by handle, every rank opens them where they lie: the checked plain description of
    # `link/tensor_handles.py` (CUDA IPC handles; CPU tensors in a shared-memory segment)
    handles: dict[str, Any] | None = None


@dataclass
class BroadcastTensors:
    """The tensors a trainer's rank 0 broadcasts to the engine's ranks in the process group `group_name`, one
    broadcast each in this order (checked at the front end before the ranks receive a byte)."""

    group_name: str
    names: list[str]
    dtypes: list[str]  # torch dtype names without "torch."
    shapes: list[list[int]]
    # SGLang's load_format "flattened_bucket": one broadcast of every tensor's bytes back to back (uint8)
    bucket: bool = False


@dataclass
class UpdateGroupOrder:
    """Join (`init`) or leave (not `init`) a trainer's process group `group_name` (SGLang's
    `init_weights_update_group`): the engine's rank r is rank `rank_offset + r` of `world_size`, rank 0 the trainer,
    meeting at the trainer's TCP store on master_address:master_port."""

    group_name: str
    init: bool = True
    master_address: str = ""
    master_port: int = 0
    rank_offset: int = 1
    world_size: int = 0
    backend: str = "gloo"


@dataclass
class MemoryOrder:
    """Release (`release`) or map again the memory of the unified buffer under `tags` ("weights", "kv_cache"),
    keeping every address (`memory/umm.py`). keep_weights: released weights are copied to the host first and
    restored on resume (else dropped: zeros until an update writes them)."""

    release: bool
    tags: list[str]
    keep_weights: bool = True


class Query(enum.Enum):
    """A question every rank answers without a step (`worker/diagnostics.py`)."""

    FINGERPRINT = "fingerprint"  # view addresses, weight and KV digests: what a switch must preserve
    MEMORY = "memory"
    REQUESTS = "requests"  # ids held: running, waiting, and the specs kept of other ranks' requests
    KERNELS = "kernels"  # how the kernels run (KernelConfig's fields)
    COMM = "comm"  # each layout's communicator
    HEAP = "heap"  # objects kept out of garbage collections since start-up
    RESET_PREFIX_CACHE = "reset_prefix_cache"  # forget every cached page (answers the pages dropped)


@dataclass
class StepPlan:
    """What the front end tells every rank before a step, applied in this order: admit new requests, release the
    ones the front end is done with, update weights, switch, then run one step (or not: an update, a switch or a
    query alone)."""

    admit: list[Admit] = field(default_factory=list)
    # requests the front end ended (aborted, stopped by a stop string) or saw finish: a rank ends any it still runs,
    # without a report, and forgets the specs it keeps of other ranks' requests
    release: list[str] = field(default_factory=list)
    switch: SwitchOrder | None = None
    run: bool = True
    query: Query | None = None
    update: WeightUpdate | None = None
    # a pause in mode "retract": every running request goes back to waiting, its KV freed; it recomputes prompt and
    # output so far when steps run again (under the weights of that time)
    retract: bool = False
    memory: MemoryOrder | None = None  # release or resume memory (a plan without a step)


@dataclass
class DecodeProbe:
    """Time steady decode steps of `batch` requests (global) with `context` cached tokens each, through the real
    runner (graph or eager) without prefill: a benchmark's hook, off the serving path (`worker/probes.py`)."""

    batch: int
    context: int
    steps: int = 5
    warmup: int = 2
    graphs: bool = True


@dataclass
class PrefillProbe:
    """Time a prefill step of `tokens` prompt tokens over `sequences` prompts after `context` cached tokens each,
    with `decodes` decoding requests (after `decode_context` tokens) beside them; the device idles `idle_s` before
    each (`worker/probes.py`)."""

    tokens: int
    context: int
    steps: int = 5
    warmup: int = 2
    graphs: bool = True
    sequences: int = 1
    decodes: int = 0
    decode_context: int = 0
    idle_s: float = 0.0


Probe = DecodeProbe | PrefillProbe


# ---- ranks -> front end ----
@dataclass
class TokenDelta:
    """One request's new tokens of one step (a rank reports each once), and its end where a rank's rule ended it
    (EOS, a stop token, its length), or where a rank could not run it (finish_reason "error", with `error`)."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | None = None
    prompt_logits: torch.Tensor | None = None  # with the first token, when asked for
    # (SamplingParams.logprobs) the new token's log-probability then its top k's, and their ids (the token's first)
    logprobs: list[float] | None = None
    logprob_ids: list[int] | None = None
    cached_tokens: int | None = None  # on a request's first token: prompt tokens taken from the prefix cache
    error: str | None = None  # why a rank refused it (finish_reason "error")
    # (SamplingParams.return_routed_experts) the expert ids [positions][MoE layers][k] the step's forward chose for
    # the request's positions routed_start.. (a prompt chunk that samples nothing reports them with no token)
    routed_experts: list[list[list[int]]] | None = None
    routed_start: int = 0

    def __reduce__(self) -> tuple[type[TokenDelta], tuple[Any, ...]]:
        # pickled as the constructor's arguments: a rank process's reply carries one a request every step, and
        # this loads faster than the default's dict of fields
        return TokenDelta, tuple(getattr(self, f.name) for f in _DELTA_FIELDS)


_DELTA_FIELDS = dataclasses.fields(TokenDelta)


def split_evenly(total: int, parts: int) -> list[int]:
    """`parts` sizes as equal as integers allow (the larger first) that add up to `total`."""
    return [total // parts + (i < total % parts) for i in range(parts)]


def attended_pairs(start: int, tokens: int, window: int = 0) -> int:
    """(query, key) pairs a causal chunk of `tokens` new tokens after `start` cached ones computes; with a sliding
    `window`, each query's keys at most the window's (the query at position q reads min(q + 1, window))."""
    if not window:
        return tokens * start + tokens * (tokens + 1) // 2
    a, b = start + 1, start + tokens  # each query's key count before the window caps it
    ramp = min(b, window)
    below = (a + ramp) * (ramp - a + 1) // 2 if ramp >= a else 0
    return below + window * max(0, b - max(a - 1, window))


def window_reads(start: int, tokens: int, window: int) -> int:
    """KV tokens a sliding-window layer reads for a chunk of `tokens` new tokens after `start` cached ones: the cached
    keys its first query's window reaches, and the new tokens'."""
    return min(start, window - 1) + tokens if window else 0


class _Summed:
    """A dataclass of numbers that adds field by field (a step's work, rank times: summed over ranks or steps)."""

    def __add__(self, other: Self) -> Self:
        pairs = zip(dataclasses.astuple(self), dataclasses.astuple(other), strict=True)  # type: ignore[call-overload]
        return type(self)(*(a + b for a, b in pairs))


@dataclass
class StepWork(_Summed):
    """What a launched step computes (the floor model prices it): new tokens (prefill chunks and decodes), the
    sequences they belong to, KV tokens its attention reads (each sequence's length after the step), the (query,
    key) pairs attention computes (each new token's position + 1), and the rows sampled; a model's sliding-window
    layers' reads and pairs apart (its largest window's: `window_reads`, `attended_pairs`)."""

    tokens: int = 0
    decode_tokens: int = 0  # of `tokens`: decodes (one output-position token that samples)
    sequences: int = 0
    kv_tokens: int = 0
    attended: int = 0
    sampled: int = 0
    preempted: int = 0  # requests preempted to schedule it (their KV freed; they recompute)
    window_kv_tokens: int = 0  # KV tokens a sliding-window layer reads (0 where none slides)
    window_attended: int = 0  # (query, key) pairs a sliding-window layer computes


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
class SwitchTimes:
    """A switch's pass on the device (ms), read once it is over: expert weights and KV (summed over the layers),
    the span from the first layer's start to the last one's end, and the total: the request side, the index
    vectors and the span."""

    weights_ms: float
    kv_ms: float
    span_ms: float
    total_ms: float


@dataclass
class SwitchOutcome:
    """What a switch did on rank 0: done, or refused and why (nothing changed then), and where its time went (ms).
    Host side: `drain_ms` waiting for the step in flight, `list_ms` the global request list, `plan_ms` owners,
    capacity, page tables and the KV index plan, `staging_ms` the buffers and the ranks' agreement, `requests_ms`
    those three, `prep_ms` the index vectors, `enqueue_ms` launching the pass, `host_ms` the whole call. `device`:
    the pass's times (a switch that rides on a step: they come with the step after it)."""

    source: str
    target: str
    done: bool
    reason: str | None = None
    drain_ms: float = 0.0
    list_ms: float = 0.0
    plan_ms: float = 0.0
    staging_ms: float = 0.0
    requests_ms: float = 0.0
    prep_ms: float = 0.0
    enqueue_ms: float = 0.0
    host_ms: float = 0.0
    pipelined: bool = False  # --switch-overlap's double-buffered pass ran
    transport: str = ""  # the transport that moved the bytes
    peer_exchanges: int = 0  # exchanges that went as direct peer copies
    running: int = 0  # requests moved, running and waiting
    waiting: int = 0
    # bytes rank 0 sent to the other ranks, by the plan: its experts' shards for them, and KV rows
    weight_bytes: int = 0
    kv_bytes: int = 0
    device: SwitchTimes | None = None

    @property
    def total_ms(self) -> float | None:
        """From the switch's start to its last byte landing (None until the device times are in)."""
        return self.device.total_ms if self.device is not None else None

    def to_json(self) -> dict[str, Any]:
        """The flat JSON the operator endpoints answer: "done", "reason", "from", "to", the host's times and, once
        known, the device's ("weights_ms", "kv_ms", "span_ms", "total_ms")."""
        d = dataclasses.asdict(self)
        device = d.pop("device") or {}
        d["from"], d["to"] = d.pop("source"), d.pop("target")
        return {**d, **device}


@dataclass
class UpdateOutcome:
    """What a weight update did: done (on every rank), or why no rank wrote a byte; the views rank 0 rewrote and
    the prefix-cache pages it dropped (they were computed by the old weights)."""

    done: bool
    reason: str | None = None
    views: int = 0
    flushed_pages: int = 0


@dataclass
class MemoryOutcome:
    """What a memory release or resume did: done on every rank, or why not (then every rank is as before); rank
    0's bytes unmapped (or mapped again), those copied to or from the host, and its seconds."""

    done: bool
    reason: str | None = None
    nbytes: int = 0
    host_bytes: int = 0
    seconds: float = 0.0


@dataclass
class StepReport:
    """What the ranks report after a plan: one rank's, or every rank's merged for the front end (`merge`). In TP
    every rank computes the same tokens and only rank 0 reports them; in EP each rank reports its own."""

    deltas: list[TokenDelta]
    kv: list[KVStats]  # per rank
    running: int = 0  # requests running and waiting on the ranks, each counted once
    waiting: int = 0
    work: StepWork = field(default_factory=StepWork)  # the steps launched, summed over the ranks that ran distinct ones
    switch: SwitchOutcome | None = None  # rank 0's, when the plan ordered a switch
    # rank 0's device times of a switch that rode on the step before (they come a step late: see SwitchOutcome)
    switch_times: SwitchTimes | None = None
    times: RankTimes = field(default_factory=RankTimes)  # rank 0's
    answers: list[Any] | None = None  # per rank, when the plan asked a query
    update: UpdateOutcome | None = None  # rank 0's, when the plan carried a weight update
    memory: MemoryOutcome | None = None  # rank 0's, when the plan released or resumed memory

    @staticmethod
    def merge(reports: list[StepReport]) -> StepReport:
        head = reports[0]
        return StepReport([d for r in reports for d in r.deltas], [k for r in reports for k in r.kv],
                          sum(r.running for r in reports), sum(r.waiting for r in reports),
                          sum((r.work for r in reports), StepWork()), head.switch, head.switch_times, head.times,
                          None if head.answers is None else [a for r in reports for a in r.answers or []],
                          head.update, head.memory)

    def waited(self, ms: float) -> StepReport:
        """This report with rank 0's wait for its plan (known only where the plan was received)."""
        return dataclasses.replace(self, times=dataclasses.replace(self.times, wait_ms=ms))
