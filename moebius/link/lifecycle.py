"""The rules of a request's life, in one place: how long it may get, what ends it, what it may not end with yet.

- Admission (front end): a prompt must leave room for output within `max_model_len` and the KV capacity.
- Placement weight (front end, EP): the tokens a request may come to hold, prompt + max_tokens.
- After each new token (ranks): EOS (unless ignore_eos), stop token ids and stop strings, once min_tokens are out;
  max_tokens and the context limit always.
- Before min_tokens (ranks): EOS and stop token ids are masked out of the logits.
- With a token still on the device (overlap scheduling): a request that ends by length whatever that token is
  runs no further step.
- The returned text (front end) ends before a stop string, or after it with include_stop_str_in_output.
"""

from __future__ import annotations

from moebius.link.request import PLACEHOLDER, Request
from moebius.sampling_params import SamplingParams
from moebius.tokenizer import Tokenizer


def check_prompt(num_prompt: int, max_model_len: int, kv_capacity: int) -> None:
    """Raise ValueError unless a prompt of this length leaves room for output."""
    limit = min(max_model_len, kv_capacity)
    if num_prompt >= limit:
        what = "max_model_len" if limit == max_model_len else "KV-cache capacity"
        raise ValueError(f"prompt has {num_prompt} tokens; the {what} is {limit} tokens, which leaves no room for "
                         f"output")


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


def cut_at_stop(text: str, stop: str, include: bool) -> str:
    """The returned text of a request that a stop string ended."""
    cut = text.find(stop)
    return text if cut < 0 else text[: cut + (len(stop) if include else 0)]


class StopRules:
    """The rules that end a request, applied on the ranks after each new token."""

    def __init__(self, eos_token_ids: tuple[int, ...], tokenizer: Tokenizer | None) -> None:
        self.eos = frozenset(eos_token_ids)
        self.tokenizer = tokenizer

    def check(self, req: Request) -> None:
        """Set the request's finish_reason (and stop_reason) if its last token ends it."""
        p = req.params
        tok = req.output_token_ids[-1]
        if len(req.output_token_ids) >= p.min_tokens:
            if not p.ignore_eos and tok in self.eos:
                return self._finish(req, "stop", None)
            if p.stop_token_ids and tok in p.stop_token_ids:
                return self._finish(req, "stop", tok)
            if p.stop_strings and self._stop_string(req):
                return None
        if _at_length(req):
            return self._finish(req, "length", None)
        return None

    def banned(self, req: Request) -> list[int]:
        """Tokens the request may not sample yet (before min_tokens): those that would stop it."""
        if len(req.output_token_ids) >= req.params.min_tokens:
            return []
        banned = set(req.params.stop_token_ids or ())
        if not req.params.ignore_eos:
            banned |= self.eos
        return sorted(banned)

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
