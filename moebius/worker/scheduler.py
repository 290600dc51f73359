"""Continuous batching on one rank: waiting and running queues, chunked prefill under a token budget, decode,
admission by free KV pages, preemption by recompute (the rules that end a request are `link/lifecycle.py`).

Deterministic: the same inputs give the same schedule on every rank (TP relies on it). Each step a request gets a
chunk of its not-yet-cached tokens; when a chunk reaches the request's last token, that position is sampled.
Prefill and decode are the same operation with chunk sizes n and 1.

Prefix caching (unless disabled): a request admitted from the queue starts with the pages of the longest chain of
full pages the allocator's index holds for its first tokens (never its last token: that one is computed, so that
it samples), and each full page a step computes is indexed for later requests: prompt pages, and output pages once
their tokens are known (the next turn of a chat starts with the last one's prompt and answer). A page is indexed
when the step that computes it is scheduled, so a request admitted in the same step already shares it: every layer
writes the whole step's K/V before any attention reads the cache. The one path that writes and reads in one launch
(the fused decode kernel) runs only steps of one-token chunks, so a page a one-token chunk completes (every output
page) is indexed at a later schedule instead, once its last token, sampled on the device, is known here.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from moebius.link.lifecycle import ends_by_length
from moebius.link.request import PLACEHOLDER, Request, Status
from moebius.memory.kv_pool import BlockAllocator, KVPages


@dataclass
class ScheduledChunk:
    req: Request
    start: int  # first token position computed this step
    num_tokens: int

    @property
    def samples(self) -> bool:
        return self.start + self.num_tokens == self.req.num_tokens


class Scheduler:
    def __init__(self, kv: KVPages, max_running: int, max_batched_tokens: int, prefix_caching: bool = True) -> None:
        self.kv = kv
        self.max_running = max_running
        self.max_batched_tokens = max_batched_tokens
        self.prefix_caching = prefix_caching
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    @property
    def alloc(self) -> BlockAllocator:
        """The first KV group's allocator: the prefix cache's index."""
        return self.kv.first

    def adopt(self, running: list[Request], waiting: list[Request], kv: KVPages) -> None:
        """Take over a switch's requests and the target layout's allocators (their pages are allocated in them)."""
        for r in running:  # their pages are new (copies): indexed again in the new allocator as they are scheduled
            r.status, r.prefix_keys = Status.RUNNING, []
        for r in waiting:
            r.status, r.prefix_keys = Status.WAITING, []
            r.set_tables(kv.empty())
        self.running, self.waiting, self.kv = list(running), deque(waiting), kv

    def add(self, req: Request) -> None:
        req.status = Status.WAITING
        self.waiting.append(req)

    def find(self, request_id: str) -> Request | None:
        for r in self.running:
            if r.request_id == request_id:
                return r
        for r in self.waiting:
            if r.request_id == request_id:
                return r
        return None

    def finish(self, req: Request) -> None:
        """Remove a request (finished or aborted) and free its pages."""
        if req.status is Status.RUNNING:
            self.running.remove(req)
        elif req.status is Status.WAITING:
            self.waiting.remove(req)
        self._release(req)
        req.status = Status.FINISHED

    def _preempt(self, victim: Request) -> None:
        """Free the victim's KV and requeue it in front: it will recompute prompt + output so far."""
        self.running.remove(victim)
        self._release(victim)
        victim.num_computed, victim.status, victim.prefix_keys = 0, Status.WAITING, []
        self.waiting.appendleft(victim)
        self.num_preemptions += 1

    def retract(self) -> int:
        """Every running request back to the front of the queue, its KV freed, in the order they ran (a pause in mode
        "retract": each recomputes prompt + output so far when admitted again, as a preempted one). Returns how many
        went back. Not counted as preemptions: nothing was short of pages."""
        n = len(self.running)
        for req in reversed(self.running):
            self._release(req)
            req.num_computed, req.status, req.prefix_keys = 0, Status.WAITING, []
            self.waiting.appendleft(req)
        self.running = []
        return n

    def _release(self, req: Request) -> None:
        self.kv.free(req.tables)
        req.set_tables(self.kv.empty())

    def _grow(self, req: Request, num_tokens: int) -> bool:
        """Pages for its tokens up to `num_tokens`, the next chunk from its computed ones (`KVPages.grow`)."""
        return self.kv.grow(req.tables, req.num_computed, num_tokens)

    def _cached_prefix(self, req: Request) -> tuple[list[list[int]], list[int]]:
        """The indexed pages (a table a KV group) and keys a request admitted now would start with: full pages short
        of its last token. Nothing for a request that wants every prompt position's logits or routing, nor with the
        cache off."""
        if not self.prefix_caching or req.params.prompt_logits or req.params.return_prompt_routed_experts:
            return self.kv.empty(), []
        bs = self.alloc.block_size
        return self.kv.match(lambda b: req.page_tokens(b, bs), (req.num_tokens - 1) // bs)

    def _index(self, req: Request, computed: int) -> None:
        """Index the request's full pages within its first `computed` tokens (computed by now or by the step being
        scheduled), up to the first that holds a token still on the device."""
        bs = self.alloc.block_size
        keys = req.prefix_keys
        for b in range(len(keys), computed // bs):
            tokens = req.page_tokens(b, bs)
            if PLACEHOLDER in tokens or not req.pages[b]:  # (a window's page freed before its tokens were known)
                break
            keys.append(self.kv.register(req.tables, b, keys[-1] if keys else 0, tokens))

    def _scheduled(self, batch: list[ScheduledChunk], chunk: ScheduledChunk) -> None:
        batch.append(chunk)
        if self.prefix_caching:  # see the module docstring for why a one-token chunk's page waits a step
            computed = chunk.start + chunk.num_tokens if chunk.num_tokens > 1 else chunk.start
            if computed >= (len(chunk.req.prefix_keys) + 1) * self.alloc.block_size:  # a decode: once a page
                self._index(chunk.req, computed)

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.max_batched_tokens
        batch: list[ScheduledChunk] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if ends_by_length(req):  # overlap scheduling: it ends when its token in flight comes back
                i += 1
                continue
            n = min(req.num_tokens - req.num_computed, budget)
            while not self._grow(req, req.num_computed + n):
                victim = self.running[-1]  # the most recently admitted
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            else:
                self._scheduled(batch, ScheduledChunk(req, req.num_computed, n))
                budget -= n
                i += 1
        # Admit new work only when nothing had to be preempted (avoids thrashing).
        while self.waiting and budget > 0 and not preempted and len(self.running) < self.max_running:
            req = self.waiting[0]  # nothing computed, no pages
            cached, keys = self._cached_prefix(req)
            start = len(cached[0]) * self.alloc.block_size
            n = min(req.num_tokens - start, budget)
            need = self.kv.need(cached, start, start + n)
            if not self.kv.fits(need, cached):
                break
            tables = [list(t) for t in cached]
            self.kv.share(tables)
            self.kv.extend(tables, start, need)
            self.kv.trim(tables, start)  # cached pages before a window (the chain's keys are what it needed)
            req.set_tables(tables)
            req.num_computed, req.prefix_keys = start, keys
            if not req.output_token_ids:  # its first admission (not a preempted one's return)
                req.num_cached_tokens = start
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
            self._scheduled(batch, ScheduledChunk(req, start, n))
            budget -= n
        return batch
