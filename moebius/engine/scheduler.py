"""Continuous batching on one rank: waiting and running queues, chunked prefill under a token budget, decode,
admission by free KV pages, preemption by recompute, and the stop rules.

Deterministic: the same inputs give the same schedule on every rank (TP relies on it). Each step a request gets a
chunk of its not-yet-cached tokens; when a chunk reaches the request's last token, that position is sampled.
Prefill and decode are the same operation with chunk sizes n and 1.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from moebius.engine.request import Request, Status
from moebius.memory.kv_pool import BlockAllocator
from moebius.tokenizer import Tokenizer


@dataclass
class ScheduledChunk:
    req: Request
    start: int  # first token position computed this step
    num_tokens: int

    @property
    def samples(self) -> bool:
        return self.start + self.num_tokens == self.req.num_tokens


class StopChecker:
    """EOS, stop token ids, stop strings, max_tokens and the context limit, applied after each new token."""

    def __init__(self, eos_token_ids: tuple[int, ...], tokenizer: Tokenizer | None) -> None:
        self.eos = frozenset(eos_token_ids)
        self.tokenizer = tokenizer

    def check(self, req: Request) -> None:
        p = req.params
        tok = req.output_token_ids[-1]
        n_out = len(req.output_token_ids)
        if n_out >= p.min_tokens:
            if not p.ignore_eos and tok in self.eos:
                return self._finish(req, "stop", None)
            if p.stop_token_ids and tok in p.stop_token_ids:
                return self._finish(req, "stop", tok)
            if p.stop_strings and self._stop_string(req):
                return None
        if p.max_tokens is not None and n_out >= p.max_tokens:
            return self._finish(req, "length", None)
        if req.num_tokens >= req.spec.max_total_len:
            return self._finish(req, "length", None)
        return None

    def _stop_string(self, req: Request) -> bool:
        if self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer (the model directory has no tokenizer.json)")
        p = req.params
        # Incremental decode over a short window (prefix/read offsets, as vLLM): a multi-byte character is appended
        # only once complete, and each token costs O(window), not O(output).
        old_len = len(req.stop_text)
        ids, (pre, read) = req.output_token_ids, req.stop_offsets
        before = self.tokenizer.decode(ids[pre:read], skip_special_tokens=p.skip_special_tokens)
        after = self.tokenizer.decode(ids[pre:], skip_special_tokens=p.skip_special_tokens)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            req.stop_text += after[len(before):]
            req.stop_offsets = (read, len(ids))
        longest = max(len(s) for s in p.stop_strings)
        tail_from = max(0, old_len - longest + 1)
        hits = [(i, s) for s in p.stop_strings if (i := req.stop_text.find(s, tail_from)) >= 0]
        if hits:
            self._finish(req, "stop", min(hits)[1])
            return True
        return False

    @staticmethod
    def _finish(req: Request, reason: str, stop_reason: int | str | None) -> None:
        req.finish_reason, req.stop_reason = reason, stop_reason


class Scheduler:
    def __init__(self, allocator: BlockAllocator, max_running: int, max_batched_tokens: int) -> None:
        self.alloc = allocator
        self.max_running = max_running
        self.max_batched_tokens = max_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

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
            if req.stops_by_length:  # overlap scheduling: it ends when its token in flight comes back
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
