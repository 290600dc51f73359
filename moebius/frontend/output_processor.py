"""The front end's state of one request, and the one place where the ranks' token deltas become outputs: tokens,
their times and log-probabilities, the text (decoded here, and only here), stop strings (checked where the text is
decoded), aborts, and the `RequestOutput` each request's `RequestOutputKind` asks for."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moebius.link.lifecycle import StopStrings
from moebius.link.messages import TokenDelta
from moebius.outputs import CompletionOutput, RequestOutput
from moebius.sampling_params import RequestOutputKind, SamplingParams
from moebius.tokenizer import IncrementalDetokenizer, Tokenizer


def child_ids(request_id: str, n: int) -> list[str]:
    """The ids of a request's samples on the ranks (one a sample)."""
    return [request_id] if n == 1 else [f"{request_id}#{i}" for i in range(n)]


def child_seed(seed: int, index: int) -> int:
    """The seed of sample `index` of a request seeded `seed` (n > 1: distinct, reproducible)."""
    return seed if index == 0 else (seed * 0x9E3779B97F4A7C15 + index) & (2**63 - 1)


@dataclass
class Sample:
    """Front-end state of one sample (one rank-side request): its output so far, and how much of it went out."""

    out: CompletionOutput
    detok: IncrementalDetokenizer | None
    stops: StopStrings
    sent_tokens: int = 0  # (DELTA) tokens already in an output
    sent_text: int = 0  # (DELTA) characters already in an output
    changed: bool = False  # got something since its last output
    released: bool = False  # ended here (abort, stop string) while a rank ran it: the ranks were told
    # (return_routed_experts) the router's choices by position of prompt + output, as the ranks reported them (a
    # recomputed position, after preemption, overwrites its own)
    routed: list[list[list[int]]] = field(default_factory=list)
    num_prompt: int = 0

    def _take_routed(self, d: TokenDelta) -> None:
        if d.routed_experts is None:
            return
        at = d.routed_start
        if at > len(self.routed):  # positions the prefix cache held: never routed here
            self.routed += [[] for _ in range(at - len(self.routed))]
        self.routed[at: at + len(d.routed_experts)] = d.routed_experts
        last = self.num_prompt - 1  # the prompt's last position: its forward samples output token 0
        self.out.routed_experts = self.routed[last: last + len(self.out.token_ids)]
        if self.out.prompt_routed_experts is not None or at < last:
            self.out.prompt_routed_experts = self.routed[:last]

    def take(self, d: TokenDelta, now: float) -> bool:
        """Its new tokens (at time `now`), their log-probabilities and text, and its end. Returns True when a stop
        string in the text ended it here (the ranks still run it: the front end releases it)."""
        out = self.out
        if not d.new_token_ids and d.finish_reason is None:  # a prompt chunk's routing alone: no output yet
            self._take_routed(d)
            return False
        self.changed = True
        if d.finish_reason == "error":  # a rank could not run it (it says why): it ended there, with nothing new
            self.fail(d.error or "a rank could not run this request")
            return False
        out.token_ids += d.new_token_ids
        out.token_times += [now] * len(d.new_token_ids)
        self._take_routed(d)
        if d.cached_tokens is not None:
            out.num_cached_tokens = d.cached_tokens
        if d.logprobs is not None and d.logprob_ids is not None:
            # the token's own first; a top id equal to it keeps that value (dict order: the token, then the top)
            entry = {d.logprob_ids[0]: d.logprobs[0]}
            for t, v in zip(d.logprob_ids[1:], d.logprobs[1:], strict=True):
                entry.setdefault(t, v)
            if out.logprobs is None:
                out.logprobs = []
            out.logprobs.append(entry)
        if self.detok is not None:
            out.text += "".join(self.detok.append(t) for t in d.new_token_ids)
        if d.finish_reason == "stop":  # EOS or a stop token id: the rules' order puts them before stop strings
            self._end("stop", d.stop_reason)
            return False
        hit = self.stops.find(out.text, len(out.token_ids))
        if hit is not None:
            stop, cut = hit
            out.text = out.text[:cut]
            out.finish_reason, out.stop_reason = "stop", stop
            return d.finish_reason is None  # a rank still runs it
        if d.finish_reason is not None:
            self._end(d.finish_reason, d.stop_reason)
        return False

    def _end(self, reason: str, stop_reason: int | None) -> None:
        out = self.out
        out.finish_reason, out.stop_reason = reason, stop_reason
        if self.detok is not None:
            out.text += self.detok.finish()

    def abort(self) -> None:
        if not self.out.finished:
            self.out.finish_reason = "abort"
            self.changed = True

    def fail(self, error: str) -> None:
        """End it with finish_reason "error" and why (what it got so far stays)."""
        self.out.finish_reason, self.out.stop_reason, self.out.error = "error", None, error
        self.changed = True

    def delta(self) -> CompletionOutput:
        """What it got since its last output; its text holds back what could still begin a stop string."""
        out = self.out
        t0, self.sent_tokens = self.sent_tokens, len(out.token_ids)
        visible = len(out.text) if out.finished else max(self.sent_text, len(out.text) - self.stops.holdback)
        c0, self.sent_text = self.sent_text, visible
        return CompletionOutput(out.index, out.token_ids[t0:], out.text[c0:visible], out.finish_reason,
                                out.stop_reason, out.token_times[t0:],
                                out.logprobs[t0:] if out.logprobs is not None else None, out.num_cached_tokens,
                                out.error, out.routed_experts[t0:] if out.routed_experts is not None else None,
                                out.prompt_routed_experts if t0 == 0 else None)


@dataclass
class FrontRequest:
    """One request at the front end: its samples (n of them, each a request on the ranks, `children`)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    kind: RequestOutputKind
    samples: list[Sample] = field(default_factory=list)
    children: list[str] = field(default_factory=list)
    prompt_logits: torch.Tensor | None = None

    @staticmethod
    def make(request_id: str, prompt: str | None, ids: list[int], params: SamplingParams, now: float,
             kind: RequestOutputKind, tokenizer: Tokenizer | None) -> FrontRequest:
        fr = FrontRequest(request_id, prompt, ids, params, now, kind)
        for i in range(params.n):
            detok = IncrementalDetokenizer(tokenizer, ids, params.skip_special_tokens) if tokenizer else None
            fr.samples.append(Sample(CompletionOutput(i, [], "", None), detok, StopStrings(params),
                                     num_prompt=len(ids)))
        fr.children = child_ids(request_id, params.n)
        return fr

    @property
    def finished(self) -> bool:
        return all(s.out.finished for s in self.samples)

    def ended(self, i: int) -> bool:
        """Whether sample i has ended (steps already on their way may still report one the front end ended)."""
        return self.samples[i].out.finished

    def take(self, i: int, d: TokenDelta, now: float) -> bool:
        """Sample i's delta; True when the front end ended the sample (a stop string): the ranks release it."""
        if d.prompt_logits is not None and i == 0:
            self.prompt_logits = d.prompt_logits
        return self.samples[i].take(d, now)

    def fail(self, i: int, error: str) -> list[str]:
        """End sample i (whose output could not be taken in) and every other sample still running with an error;
        returns their ids on the ranks, which may still run them."""
        failed = [c for j, (c, s) in enumerate(zip(self.children, self.samples, strict=True))
                  if j == i or not s.out.finished]
        for j, s in enumerate(self.samples):
            if j == i or not s.out.finished:
                s.fail(error)
        return failed

    def abort(self) -> list[str]:
        """Abort every sample still running; returns their ids on the ranks."""
        running = [c for c, s in zip(self.children, self.samples, strict=True) if not s.out.finished]
        for s in self.samples:
            s.abort()
        return running

    def output(self) -> RequestOutput | None:
        """Its output, as its kind asks, if anything changed since the last one (None: nothing to return now)."""
        finished = self.finished
        if self.kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        changed = [s for s in self.samples if s.changed]
        if not changed:
            return None
        for s in changed:
            s.changed = False
        if self.kind is RequestOutputKind.DELTA:
            outs = [s.delta() for s in changed]
        else:
            outs = [s.out for s in self.samples]
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outs, finished, self.arrival_time,
                             self.prompt_logits)
