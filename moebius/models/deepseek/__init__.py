"""The DeepSeek-V2 / V3 family (DeepSeek-V2-Lite, Moonlight, DeepSeek-V3 / R1, Kimi K2): multi-head latent
attention, shared experts, grouped routing. On the GPU: decode graphs and step pieces around the latent kernels of
kernels/mla.py."""

from types import MappingProxyType

from moebius.models.deepseek import forward
from moebius.models.deepseek.config import parse_config
from moebius.models.deepseek.floor_terms import floor_terms
from moebius.models.deepseek.weights import build_weights, weight_specs
from moebius.models.fp8_blocks import FP8
from moebius.models.specs import Family

FAMILY = Family("deepseek", ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM"), parse_config, weight_specs,
                build_weights, forward, rope_table=forward.family_rope_table, checks_own_keys=True,
                floor_terms=floor_terms, packings=MappingProxyType({FP8.method: FP8}))
