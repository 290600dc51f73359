"""Moebius: a serving engine for Mixture-of-Experts LLMs that switches live between TP and EP layouts."""

from moebius.entrypoints.llm import LLM
from moebius.outputs import CompletionOutput, RequestOutput
from moebius.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutputKind", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
