"""Qwen3-MoE (`Qwen3MoeForCausalLM`): GQA attention with per-head q/k RMSNorm, softmax top-k routing, optional
dense MLP layers (`mlp_only_layers`, `decoder_sparse_step`)."""

from types import MappingProxyType

from moebius.models import gqa
from moebius.models.fp8_blocks import FP8
from moebius.models.qwen3_moe import forward
from moebius.models.qwen3_moe.config import parse_config
from moebius.models.qwen3_moe.weights import build_weights, weight_specs
from moebius.models.specs import Family

FAMILY = Family("qwen3_moe", ("Qwen3MoeForCausalLM",), parse_config, weight_specs, build_weights, forward,
                floor_terms=gqa.floor_terms, packings=MappingProxyType({FP8.method: FP8}))
