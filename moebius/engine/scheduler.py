"""Continuous batching on one rank: waiting and running queues, chunked prefill under a token budget, decode,
admission by free KV pages, preemption by recompute (the rules that end a request are `engine/lifecycle.py`).

Deterministic: the same inputs give the same schedule on every rank (TP relies on it). Each step a request gets a
chunk of its not-yet-cached tokens; when a chunk reaches the request's last token, that position is sampled.
Prefill and decode are the same operation with chunk sizes n and 1.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from moebius.engine.lifecycle import ends_by_length
from moebius.engine.request import Request, Status
from moebius.memory.kv_pool import BlockAllocator


@dataclass
class ScheduledChunk:
    req: Request
    start: int  # first token position computed this step
    num_tokens: int

    @property
    def samples(self) -> bool:
        return self.start + self.num_tokens == self.req.num_tokens


class Scheduler:
    def __init__(self, allocator: BlockAllocator, max_running: int, max_batched_tokens: int) -> None:
        self.alloc = allocator
        self.max_running = max_running
        self.max_batched_tokens = max_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def adopt(self, running: list[Request], waiting: list[Request], allocator: BlockAllocator) -> None:
        """Take over a switch's requests and the target layout's allocator (their pages are allocated in it)."""
        for r in running:
            r.status = Status.RUNNING
        for r in waiting:
            r.status, r.pages = Status.WAITING, []
        self.running, self.waiting, self.alloc = list(running), deque(waiting), allocator

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
        self.alloc.free(req.pages)
        req.pages = []
        req.status = Status.FINISHED

    def _preempt(self, victim: Request) -> None:
        """Free the victim's KV and requeue it in front: it will recompute prompt + output so far."""
        self.running.remove(victim)
        self.alloc.free(victim.pages)
        victim.pages, victim.num_computed, victim.status = [], 0, Status.WAITING
        self.waiting.appendleft(victim)
        self.num_preemptions += 1

    def _grow(self, req: Request, num_tokens: int) -> bool:
        need = self.alloc.pages_for(num_tokens) - len(req.pages)
        if need > self.alloc.num_free:
            return False
        if need > 0:
            req.pages += self.alloc.allocate(need)
        return True

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
                batch.append(ScheduledChunk(req, req.num_computed, n))
                budget -= n
                i += 1
        # Admit new work only when nothing had to be preempted (avoids thrashing).
        while self.waiting and budget > 0 and not preempted and len(self.running) < self.max_running:
            req = self.waiting[0]
            n = min(req.num_tokens - req.num_computed, budget)
            if not self._grow(req, req.num_computed + n):
                break
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
            batch.append(ScheduledChunk(req, req.num_computed, n))
            budget -= n
        return batch
