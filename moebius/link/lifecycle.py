"""The rules of a request's life, in one place: how long it may get, what ends it, what it may not end with yet.

- Admission (front end): prompt + max_tokens must fit within `max_model_len` and the KV capacity (refused with the
  numbers otherwise, never cut short); max_tokens None runs up to the context.
- Placement weight (front end, EP): the tokens a request may come to hold, prompt + max_tokens.
- After each new token (ranks): EOS (unless ignore_eos) and stop token ids, once min_tokens are out; max_tokens and
  the context limit always.
- Stop strings (front end, where the text is decoded): once min_tokens are out, the first stop string in the text
  ends the request; the front end releases it on the ranks.
- Before min_tokens (ranks): EOS and stop token ids are masked out of the logits.
- With a token still on the device (overlap scheduling): a request that ends by length whatever that token is
  runs no further step.
- The returned text (front end) ends before a stop string, or after it with include_stop_str_in_output; text
  streamed before the end holds back what could still become a stop string.
"""

from __future__ import annotations

from moebius.link.request import PLACEHOLDER, Request
from moebius.sampling_params import SamplingParams


class ContextLengthError(ValueError):
    """A prompt, or a prompt and its max_tokens, longer than the context (`max_tokens_at_fault`: the latter, so a
    smaller max_tokens would do)."""

    def __init__(self, message: str, max_tokens_at_fault: bool = False) -> None:
        super().__init__(message)
        self.max_tokens_at_fault = max_tokens_at_fault


def check_prompt(num_prompt: int, max_tokens: int | None, max_model_len: int, kv_capacity: int) -> None:
    """Raise ValueError, with the numbers and the setting that sets the limit, unless a prompt of this length
    leaves room for output: for `max_tokens` of it (None: at least one token; it runs up to the context)."""
    limit = max_total_len(max_model_len, kv_capacity)
    what = (f"max_model_len (--max-model-len) is {limit} tokens" if limit == max_model_len else
            f"KV-cache capacity of one request is {limit} tokens (--max-total-tokens or --mem-fraction, in the "
            "smaller layout)")
    if num_prompt >= limit:
        raise ContextLengthError(f"prompt has {num_prompt} tokens; the {what}, which leaves no room for output")
    if max_tokens is not None and num_prompt + max_tokens > limit:
        raise ContextLengthError(f"prompt has {num_prompt} tokens and max_tokens is {max_tokens}: "
                                 f"{num_prompt + max_tokens} tokens in all, but the {what}; ask for at most "
                                 f"{limit - num_prompt} tokens, or leave max_tokens unset (None: up to the context)",
                                 max_tokens_at_fault=True)


def max_total_len(max_model_len: int, kv_capacity: int) -> int:
    """Prompt + output may not exceed this: any admitted request fits in either layout after any switch."""
    return min(max_model_len, kv_capacity)


def placement_weight(num_prompt: int, params: SamplingParams) -> int:
    """The tokens a request may come to hold, as EP placement counts them."""
    return num_prompt + (params.max_tokens or 0)


def ends_by_length(req: Request) -> bool:
    """Its last token is still on the device and ends it by length whatever that token is: nothing to run."""
    return req.output_token_ids[-1:] == [PLACEHOLDER] and _at_length(req)


def _at_length(req: Request) -> bool:
    p = req.params
    return ((p.max_tokens is not None and len(req.output_token_ids) >= p.max_tokens)
            or req.num_tokens >= req.spec.max_total_len)


class StopStrings:
    """The stop strings of one sample, checked as its text grows (front end)."""

    def __init__(self, params: SamplingParams) -> None:
        self.strings = params.stop_strings
        self.include = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self.longest = max((len(s) for s in self.strings), default=0)
        self._checked = 0  # characters of text seen by the last call

    @property
    def holdback(self) -> int:
        """Characters at the end of a growing text that could still turn out to begin a stop string (not sent)."""
        return 0 if self.include or not self.strings else self.longest - 1

    def find(self, text: str, num_tokens: int) -> tuple[str, int] | None:
        """(the stop string, where the returned text ends) if the text that grew since the last call (`text`, of
        `num_tokens` output tokens) completes one, once min_tokens are out (vLLM's rule: text made before then is
        not searched again, but a stop string that straddles the two counts)."""
        if not self.strings:
            return None
        start = max(0, self._checked - self.longest + 1)
        self._checked = len(text)
        if num_tokens < self.min_tokens:
            return None
        hits = [(i, s) for s in self.strings if (i := text.find(s, start)) >= 0]
        if not hits:
            return None
        at, stop = min(hits)
        return stop, at + (len(stop) if self.include else 0)


class StopRules:
    """The rules that end a request, applied on the ranks after each new token."""

    def __init__(self, eos_token_ids: tuple[int, ...]) -> None:
        self.eos = frozenset(eos_token_ids)

    def check(self, req: Request) -> None:
        """Set the request's finish_reason (and stop_reason) if its last token ends it."""
        p = req.params
        tok = req.output_token_ids[-1]
        if len(req.output_token_ids) >= p.min_tokens:
            if not p.ignore_eos and tok in self.eos:
                req.finish_reason, req.stop_reason = "stop", None
                return
            if p.stop_token_ids and tok in p.stop_token_ids:
                req.finish_reason, req.stop_reason = "stop", tok
                return
        if _at_length(req):
            req.finish_reason, req.stop_reason = "length", None

    def banned(self, req: Request) -> list[int]:
        """Tokens the request may not sample yet (before min_tokens): those that would stop it."""
        if len(req.output_token_ids) >= req.params.min_tokens:
            return []
        banned = set(req.params.stop_token_ids or ())
        if not req.params.ignore_eos:
            banned |= self.eos
        return sorted(banned)
