"""The requests' side of a live switch on one rank: the global request list, who holds each request afterwards,
whether the target layout can hold them, their target page tables; then the data plane (`switch/executor.py`)
moves the weights and KV, and the rank adopts the `SwitchResult`.

Every rank computes the same list, owners, capacity answer and page tables (TP's tables are identical on every
rank), so all of them take the same decision without further messages.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from moebius.config import first_live_page
from moebius.link.codec import TokenIds, decode, encode
from moebius.link.messages import SwitchOutcome
from moebius.link.request import Request, RequestSpec, Status
from moebius.memory.kv_pool import KVPages
from moebius.parallel.groups import Groups, all_gather_json
from moebius.parallel.layout import Layout
from moebius.switch.executor import Switcher
from moebius.switch.plan import LiveKV

# The EP -> TP request list's first gather round carries this much of each rank's part: one round instead of two for
# the request counts where a policy would switch (a hundred or so requests a rank).
REQUEST_LIST_INLINE = 65536


@dataclass
class RequestState:
    """What moves with a request in a switch beside its spec (which every rank holds) and its output ids (sent
    together for the whole list); pages do not move: they are allocated again."""

    request_id: str
    num_output: int
    num_computed: int
    status: Status
    prompt_logits: list[torch.Tensor]
    num_cached_tokens: int
    prefix_keys: TokenIds  # its source rank's prefix-cache keys: which pages it shares (`shared_prefixes`)


@dataclass
class RequestList:
    """A switch's requests in one message: their states, and all their output ids as one `TokenIds`."""

    ids: TokenIds
    requests: list[RequestState]

    @staticmethod
    def of(reqs: list[Request]) -> RequestList:
        return RequestList(list(itertools.chain.from_iterable(r.output_token_ids for r in reqs)),
                           [RequestState(r.request_id, len(r.output_token_ids), r.num_computed, r.status,
                                         r.prompt_logits, r.num_cached_tokens, r.prefix_keys) for r in reqs])

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
                               prompt_logits=m.prompt_logits, num_cached_tokens=m.num_cached_tokens,
                               prefix_keys=list(m.prefix_keys)))
            at += m.num_output
        if at != len(self.ids):
            raise ValueError(f"request list: {len(self.ids) - at} token ids belong to no request")
        return out


@dataclass
class SwitchResult:
    """What a switch changed on this rank, for the rank to adopt (`mode` None: refused, nothing changed)."""

    outcome: SwitchOutcome
    mode: str | None = None
    running: list[Request] = field(default_factory=list)  # with their target page tables
    waiting: list[Request] = field(default_factory=list)
    kv_pages: KVPages | None = None  # the target layout's allocators, holding those pages
    others: dict[str, RequestSpec] = field(default_factory=dict)  # specs of the requests other ranks now run


@dataclass(frozen=True)
class RankRequests:
    """This rank's requests before the switch."""

    running: list[Request]
    waiting: list[Request]
    others: dict[str, RequestSpec]  # specs of the requests other ranks run (EP)


def _global_requests(src: Layout, mine: RankRequests, groups: Groups, device: torch.device
                     ) -> tuple[list[Request], list[Request], list[int]]:
    """(running, waiting, each one's rank before the switch), in the order every rank agrees on."""
    if not src.data_parallel:  # every rank holds every request, in the same order
        n = len(mine.running) + len(mine.waiting)
        return list(mine.running), list(mine.waiting), [src.rank] * n
    # requests spread over ranks: all-gather them; every rank keeps the specs of the others' requests, so only
    # outputs and state travel, and a rank's own requests stay as they are
    own = list(mine.running) + list(mine.waiting)
    everything = all_gather_json([len(mine.running), encode(RequestList.of(own))], groups, device,
                                 inline=REQUEST_LIST_INLINE)
    running, waiting = [], []
    for s, (n_run, m) in enumerate(everything):
        reqs = own if s == src.rank else decode(RequestList, m).requests_with(mine.others)
        running += [(r, s) for r in reqs[:n_run]]
        waiting += [(r, s) for r in reqs[n_run:]]
    running.sort(key=lambda x: x[0].spec.arrival)
    waiting.sort(key=lambda x: x[0].spec.arrival)
    return [r for r, _ in running], [r for r, _ in waiting], [s for _, s in running + waiting]


def shared_prefixes(running: list[Request], after: list[int], before: list[int], block_size: int) -> list[int]:
    """How many leading pages each request (in the global order) shares with earlier requests of its target rank
    (`after`): pages its source rank (`before`) indexed under the same prefix-cache keys hold the same tokens (a
    TP source: every rank's keys are the same). Pure: every rank computes the same answer."""
    seen: dict[tuple[int, int], set[int]] = {}  # (target rank, source rank) -> the keys of pages moved there
    out = []
    for r, a, s in zip(running, after, before, strict=True):
        keys = r.prefix_keys[: r.num_computed // block_size]
        moved = seen.setdefault((a, s), set())
        k = 0
        while k < len(keys) and keys[k] in moved:
            k += 1
        moved.update(keys[k:])
        out.append(k)
    return out


def switch_requests(switcher: Switcher, src: Layout, dst: Layout, dst_pages: Sequence[int], mine: RankRequests,
                    owners: dict[str, int], groups: Groups, device: torch.device, block_size: int, max_running: int,
                    share_prefixes: bool = True) -> SwitchResult:
    """Switch this rank from layout `src` to `dst` (a collective: every rank, the same plan). owners: the rank each
    request runs on in `dst` where it places requests (the front end's placement); elsewhere unused. share_prefixes
    (prefix caching): requests of one target rank share the target pages of the leading pages their source rank
    indexed under the same keys (moved once), as they shared them before."""
    t0 = time.perf_counter()
    running, waiting, before = _global_requests(src, mine, groups, device)
    t_list = time.perf_counter()
    live = running + waiting
    if dst.data_parallel:
        missing = [r.request_id for r in live if r.request_id not in owners]
        if missing:
            raise RuntimeError(f"switch to {dst.mode}: the plan places no rank for request(s) {missing[:5]}")
        after = [owners[r.request_id] for r in live]
    else:
        after = [dst.rank] * len(live)  # every rank holds every request
    P = groups.world_size
    targets = [Layout(dst.cfg, dst.mode, q, P) for q in range(P)]
    # Which leading pages requests of one target rank have in common: the first request's move fills such a page,
    # the others share it (a TP target: one group, every rank holds every request).
    group = [a if dst.data_parallel else 0 for a in after[: len(running)]]
    # (not where the first KV group has a window: its leading pages may be freed already)
    share_prefixes = share_prefixes and src.cfg.kv_groups[0].window is None
    shared = (shared_prefixes(running, group, before[: len(running)], block_size) if share_prefixes
              else [0] * len(running))
    # Capacity: the target must hold the live KV of every running request (plus its next token) in every KV group
    # (a window group: its window's pages) ...
    kv_pages = KVPages(dst_pages, block_size, [g.window for g in src.cfg.kv_groups])
    first = [[first_live_page(r.num_computed, w, block_size) for r in running] for w in kv_pages.windows]
    need = [[sum(-(-r.num_tokens // block_size) - max(s if g == 0 else 0, f)
                 for r, o, s, f in zip(running, after, shared, first[g], strict=False) if lay.holds(o))
             for g in range(len(first))] for lay in targets]
    for g, alloc in enumerate(kv_pages.groups):
        most = max((per_group[g] for per_group in need), default=0)
        if most > alloc.usable_pages:
            where = f" in KV group {g} (window {kv_pages.windows[g]})" if len(need[0]) > 1 else ""
            return _refused(src, dst, f"{dst.mode} layout cannot hold the live KV: needs {most} pages on a rank"
                            f"{where}, has {alloc.usable_pages}")
    # ... and its batch slots (TP runs every request on every rank)
    per_rank = [sum(1 for o in after[: len(running)] if lay.holds(o)) for lay in targets]
    if max(per_rank, default=0) > max_running:
        return _refused(src, dst, f"{dst.mode} layout cannot run {max(per_rank)} requests on a rank "
                        f"(max_running_requests {max_running})")
    # Target page tables, in the global order, in fresh allocators that only adopting the result makes the target's:
    # nothing has changed yet. A window group's tables start at the window of the request's next token: the pages
    # before are neither moved nor given.
    kv: list[list[LiveKV]] = [[] for _ in kv_pages.groups]
    my_tables = {r.request_id: r.tables for r in mine.running}
    page_of: dict[tuple[int, int], dict[int, int]] = {}  # (group, source rank) -> {prefix-cache key: target page}
    for i, (r, b, a, g, s) in enumerate(zip(running, before, after, group, shared, strict=False)):
        mine_now = my_tables.get(r.request_id)
        for k, alloc in enumerate(kv_pages.groups):
            pages: list[int] = []
            lead = first[k][i]
            if dst.holds(a):
                if k == 0:  # the first group's leading pages shared by prefix (`share_prefixes`; window groups: none)
                    keys = r.prefix_keys[: r.num_computed // block_size]
                    mine_of = page_of.setdefault((g, b), {})
                    pages = [mine_of[key] for key in keys[:s]]
                    alloc.share(pages)
                pages += [0] * (lead - len(pages))
                pages += alloc.allocate(-(-r.num_computed // block_size) - len(pages))
                if k == 0:
                    mine_of.update(zip(keys[s:], pages[s:], strict=False))
            kv[k].append(LiveKV(b if src.data_parallel else a, r.num_computed, mine_now[k] if mine_now else [], pages,
                                max(s if k == 0 else 0, lead) * block_size))
    t_plan = time.perf_counter()
    launch = switcher.move(src.mode, dst.mode, kv, len(running), len(waiting), (t_plan - t0) * 1e3)
    if isinstance(launch, str):
        return _refused(src, dst, launch)
    for i, r in enumerate(running):
        r.set_tables([kv[k][i].dst_pages for k in range(len(kv))])
    keep = [i for i, o in enumerate(after) if dst.holds(o)]
    n_run = len(running)
    kept = set(keep)
    list_ms = (t_list - t0) * 1e3
    outcome = SwitchOutcome(src.mode, dst.mode, True, list_ms=list_ms,
                            plan_ms=(t_plan - t_list) * 1e3 + launch.kv_plan_ms, staging_ms=launch.staging_ms,
                            requests_ms=launch.requests_ms, prep_ms=launch.prep_ms, enqueue_ms=launch.enqueue_ms,
                            host_ms=(time.perf_counter() - t0) * 1e3, pipelined=launch.pipelined,
                            transport=launch.transport, peer_exchanges=launch.peer_exchanges, running=len(running),
                            waiting=len(waiting), weight_bytes=launch.weight_bytes, kv_bytes=launch.kv_bytes)
    return SwitchResult(
        outcome, dst.mode, [running[i] for i in keep if i < n_run], [waiting[i - n_run] for i in keep if i >= n_run],
        kv_pages, {r.request_id: r.spec for i, r in enumerate(live) if i not in kept} if dst.data_parallel else {})


def _refused(src: Layout, dst: Layout, reason: str) -> SwitchResult:
    return SwitchResult(SwitchOutcome(src.mode, dst.mode, False, reason))
