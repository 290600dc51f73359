"""GPT-OSS (`GptOssForCausalLM`: gpt-oss-20b, gpt-oss-120b): GQA attention with q|k|v and o biases, a learned sink
logit a head, sliding-window layers alternating with full ones, YaRN rope; a biased router softmaxed over its top k;
experts with biases and a clamped SwiGLU, stored fused with gate and up interleaved.

On the GPU the paged kernel takes the sinks and windows and the fused MoE the biases and the clamped activation.
MXFP4 checkpoints (the releases:
quantization_config's quant_method "mxfp4", the experts stored as `*_blocks` / `*_scales`) load dequantized to the
engine's dtype (`mxfp4.MXFP4`, the family's `packings`), or with --quantization mxfp4 kept in MXFP4 as MXFP4 rows
(kernels/mxfp4_rows.py: their values exactly); a weight update takes the same pieces; a checkpoint dequantized to a
float dtype loads too."""

from __future__ import annotations

from types import MappingProxyType

from moebius.models import gqa
from moebius.models.gpt_oss import forward
from moebius.models.gpt_oss.config import parse_config
from moebius.models.gpt_oss.mxfp4 import MXFP4
from moebius.models.gpt_oss.weights import build_weights, checkpoint_tensor_shapes, weight_specs
from moebius.models.specs import Family

# transformers' fused expert tensors are this family's checkpoint names, with their own shapes ([E, D, 2I]
# gate_up_proj), not per-expert names standing for them: `checkpoint_shapes` says them
FAMILY = Family("gpt_oss", ("GptOssForCausalLM",), parse_config, weight_specs, build_weights, forward,
                rope_table=forward.family_rope_table, checks_own_keys=True,
                floor_terms=gqa.floor_terms, packings=MappingProxyType({MXFP4.method: MXFP4}),
                checkpoint_shapes=checkpoint_tensor_shapes, quantizations=("mxfp4",),
                reasoning_parser="openai_gptoss")  # (its chat answers are harmony messages, as vLLM parses them)
