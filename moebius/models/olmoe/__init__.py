"""OLMoE (`OlmoeForCausalLM`): GQA attention with q/k RMSNorm over the whole projections (a cross-rank sum of
squares in TP: forward.py says why), softmax top-k routing, SwiGLU experts in every layer."""

from moebius.models.olmoe import forward
from moebius.models.olmoe.config import parse_config
from moebius.models.olmoe.floor_terms import floor_terms
from moebius.models.olmoe.weights import build_weights, weight_specs
from moebius.models.specs import Family

FAMILY = Family("olmoe", ("OlmoeForCausalLM",), parse_config, weight_specs, build_weights, forward,
                checks_own_keys=True, floor_terms=floor_terms)
