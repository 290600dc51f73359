"""The built-in default model: a tiny Qwen3-MoE that runs in seconds on a CPU, paired with Tokenizer.builtin()."""

from __future__ import annotations

from typing import Any

from moebius.tokenizer import BUILTIN_SPECIAL_IDS, BUILTIN_VOCAB_SIZE, ENDOFTEXT, IM_END

BUILTIN_NOTICE = (
    "Serving the built-in demo model: it has random weights, so the text it generates is meaningless. "
    "For a real model pass --model /path/to/hf/dir (a local Qwen3-MoE checkpoint), or "
    "--model qwen3-30b-a3b --load-format dummy for the real shapes with random weights."
)


def builtin_hf_config() -> dict[str, Any]:
    """config.json of the built-in model. 4 KV heads and 8 experts split evenly over 1, 2 or 4 ranks."""
    return dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=BUILTIN_VOCAB_SIZE,
        hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, head_dim=16, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None, max_position_embeddings=4096,
        tie_word_embeddings=False, attention_bias=False, mlp_only_layers=[], decoder_sparse_step=1,
        hidden_act="silu", use_sliding_window=False, bos_token_id=BUILTIN_SPECIAL_IDS[ENDOFTEXT],
        eos_token_id=BUILTIN_SPECIAL_IDS[IM_END],
    )
