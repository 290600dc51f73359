"""The front end's state of one request: its samples' outputs as they grow (tokens, times, text, log-probabilities),
and how a rank's `TokenDelta` lands in them."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moebius.link.lifecycle import cut_at_stop
from moebius.link.messages import TokenDelta
from moebius.outputs import CompletionOutput, RequestOutput
from moebius.sampling_params import SamplingParams
from moebius.tokenizer import IncrementalDetokenizer


def child_seed(seed: int, index: int) -> int:
    """The seed of sample `index` of a request seeded `seed` (n > 1: distinct, reproducible)."""
    return seed if index == 0 else (seed * 0x9E3779B97F4A7C15 + index) & (2**63 - 1)


@dataclass
class Sample:
    """Front-end state of one sample (one rank-side request)."""

    out: CompletionOutput
    detok: IncrementalDetokenizer | None


@dataclass
class FrontRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    samples: list[Sample]
    prompt_logits: torch.Tensor | None = None
    children: list[str] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(s.out.finished for s in self.samples)

    def output(self) -> RequestOutput:
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, [s.out for s in self.samples],
                             self.finished, self.arrival_time, self.prompt_logits)

    def apply(self, i: int, d: TokenDelta, now: float) -> None:
        """Sample i's new tokens (at time `now`), their log-probabilities and text, and its end."""
        s = self.samples[i]
        out = s.out
        out.token_ids += d.new_token_ids
        out.token_times += [now] * len(d.new_token_ids)
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
        if s.detok is not None:
            out.text += "".join(s.detok.append(t) for t in d.new_token_ids)
        if d.finish_reason is not None:
            out.finish_reason, out.stop_reason = d.finish_reason, d.stop_reason
            if s.detok is not None:
                out.text += s.detok.finish()
            if isinstance(d.stop_reason, str):
                out.text = cut_at_stop(out.text, d.stop_reason, self.params.include_stop_str_in_output)
        if d.prompt_logits is not None and i == 0:
            self.prompt_logits = d.prompt_logits
