"""What the engine hands back to its users: per-sample completions and per-request outputs (vLLM's shapes)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class CompletionOutput:
    """One sample of a request."""

    index: int
    token_ids: list[int]
    text: str
    # "stop" (EOS / stop token / stop string), "length", "abort", "error" (it failed: see `error`); None while running
    finish_reason: str | None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    token_times: list[float] = field(default_factory=list)  # wall time (time.perf_counter) of each output token
    # with SamplingParams.logprobs: per output token, {token id: log-probability} of the token itself first, then
    # of the most likely ones (the raw distribution of the model; --logprobs-mode picks another)
    logprobs: list[dict[int, float]] | None = None
    num_cached_tokens: int = 0  # prompt tokens this sample took from the prefix cache (known from its first token)
    error: str | None = None  # with finish_reason "error": what failed (the engine itself serves on)
    # (SamplingParams.return_routed_experts) per output token, per MoE layer, the router's top-k expert ids (global
    # ids, in the router's order) of the forward that sampled the token: that of the token before it
    routed_experts: list[list[list[int]]] | None = None
    # (return_prompt_routed_experts) the same for every prompt token but the last (whose is routed_experts[0]):
    # prompt_routed_experts + routed_experts is the routing of prompt + output[:-1], the sequence a trainer forwards
    prompt_routed_experts: list[list[list[int]]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """All samples of one request. For n = 1 the sample's fields are also readable on the request itself."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    arrival_time: float
    prompt_logits: torch.Tensor | None = None  # [prompt_len, vocab] float32, when asked for
    # the caller's name for the weights the engine held when this output was made (LLM.update_weights)
    weight_version: str | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens the first sample took from the prefix cache (vLLM's field)."""
        return self.outputs[0].num_cached_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)

    @property
    def ttft(self) -> float | None:
        """Seconds from arrival to the first output token (of the first sample to produce one)."""
        firsts = [o.token_times[0] for o in self.outputs if o.token_times]
        return min(firsts) - self.arrival_time if firsts else None

    @property
    def token_latencies(self) -> list[float]:
        """Seconds between consecutive output tokens of the first sample (inter-token latency)."""
        t = self.outputs[0].token_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]
