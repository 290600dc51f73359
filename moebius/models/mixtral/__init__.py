"""Mixtral (`MixtralForCausalLM`: Mixtral-8x7B, Mixtral-8x22B): GQA attention without q/k norm or bias, plain RoPE,
every layer a softmax top-2 router (the two weights renormalised) over SwiGLU experts, checkpoints naming the experts
`block_sparse_moe.experts.{e}.w1 / w3 / w2`. Sliding-window attention is refused."""

from moebius.models import gqa
from moebius.models.mixtral import forward
from moebius.models.mixtral.config import parse_config
from moebius.models.mixtral.weights import build_weights, weight_specs
from moebius.models.specs import Family

FAMILY = Family("mixtral", ("MixtralForCausalLM",), parse_config, weight_specs, build_weights, forward,
                checks_own_keys=True, floor_terms=gqa.floor_terms,
                cpu_only="its attention without q/k norm (the torch ops beside the fused kernels) is not yet checked "
                         "on a GPU")
