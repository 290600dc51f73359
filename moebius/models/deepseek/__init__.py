"""The DeepSeek-V2 / V3 family (DeepSeek-V2-Lite, Moonlight, DeepSeek-V3 / R1, Kimi K2): multi-head latent
attention, shared experts, grouped routing. Served on the CPU only for now: the GPU has a Triton decode kernel for
paged latent attention (kernels/mla.py) but no prompt-chunk kernel, CUDA graphs or step pieces for the latent
cache yet."""

from moebius.models.deepseek import forward
from moebius.models.deepseek.config import parse_config
from moebius.models.deepseek.floor_terms import floor_terms
from moebius.models.deepseek.weights import build_weights, weight_specs
from moebius.models.specs import Family

FAMILY = Family("deepseek", ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM"), parse_config, weight_specs,
                build_weights, forward, rope_table=forward.family_rope_table,
                cpu_only="no Triton kernels for prompt chunks of latent attention (MLA), nor CUDA graphs and "
                         "step pieces for the latent cache, yet (decodes have one: kernels/mla.py)",
                checks_own_keys=True, floor_terms=floor_terms)
