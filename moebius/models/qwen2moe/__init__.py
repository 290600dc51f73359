"""Qwen2-MoE (`Qwen2MoeForCausalLM`: Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): GQA attention with a q|k|v bias and no q/k
norm, softmax top-k routing (renormalised only with norm_topk_prob), a shared expert every token runs, scaled per
token by a sigmoid gate, beside the routed ones; optional dense MLP layers (`mlp_only_layers`,
`decoder_sparse_step`); sliding-window layers (`use_sliding_window`, `layer_types`) in their own KV group."""

from moebius.models.qwen2moe import forward
from moebius.models.qwen2moe.config import parse_config
from moebius.models.qwen2moe.floor_terms import floor_terms
from moebius.models.qwen2moe.weights import build_weights, weight_specs
from moebius.models.specs import Family

FAMILY = Family("qwen2moe", ("Qwen2MoeForCausalLM",), parse_config, weight_specs, build_weights, forward,
                checks_own_keys=True, floor_terms=floor_terms)
