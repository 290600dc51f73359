"""Mixtral (`MixtralForCausalLM`: Mixtral-8x7B, Mixtral-8x22B): GQA attention without q/k norm or bias, plain RoPE,
every layer a softmax top-2 router (the two weights renormalised) over SwiGLU experts, checkpoints naming the experts
`block_sparse_moe.experts.{e}.w1 / w3 / w2`; an optional sliding window (`sliding_window`: every layer)."""

from moebius.models import gqa
from moebius.models.mixtral import forward
from moebius.models.mixtral.config import parse_config
from moebius.models.mixtral.weights import build_weights, weight_specs
from moebius.models.specs import Family

FAMILY = Family("mixtral", ("MixtralForCausalLM",), parse_config, weight_specs, build_weights, forward,
                checks_own_keys=True, floor_terms=gqa.floor_terms)
