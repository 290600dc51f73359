"""GLM-4.5 / 4.6 (`Glm4MoeForCausalLM`): GQA attention with q|k|v bias, optional per-head q/k norm and partial
rotary, DeepSeek-V3's MoE block (sigmoid grouped routing with the correction bias, shared experts), dense first
layers (first_k_dense_replace). On the GPU partial rotary and no q/k norm go through torch ops beside the fused
kernels."""

from moebius.models.glm4_moe import forward
from moebius.models.glm4_moe.config import parse_config
from moebius.models.glm4_moe.floor_terms import floor_terms
from moebius.models.glm4_moe.weights import build_weights, weight_specs
from moebius.models.specs import Family

FAMILY = Family("glm4_moe", ("Glm4MoeForCausalLM",), parse_config, weight_specs, build_weights, forward,
                rope_table=forward.family_rope_table, checks_own_keys=True,
                floor_terms=floor_terms)
