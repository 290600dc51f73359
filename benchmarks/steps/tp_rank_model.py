"""One TP rank's local work as a one-GPU model: a preset's config with the heads, KV heads, expert intermediate
size and vocabulary cut by P (what each of P TP ranks holds), written as a model directory for
`--load-format dummy`. Run at P = 1 it replays a TP rank's kernels exactly, minus the all-reduces (one GPU adds and
normalizes locally), so kernel changes for small TP batches can be timed in the step on a single GPU.

A helper, not run by itself: `python benchmarks/steps/decode_ab.py --tp-rank-of 2 --num-ranks 1 ...` and
`python benchmarks/steps/profile_decode.py --tp-rank-of 2 ...` use it."""

from __future__ import annotations

import json
import os
import tempfile

from moebius.config import PRESETS

# the families whose config cuts this way (GQA heads of a fixed head_dim, routed experts' intermediate): Qwen3-MoE's
# and DeepSeek's presets; others (a head_dim derived from hidden_size, fused expert layouts) would change shape
CUT_FAMILIES = ("Qwen3MoeForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM")


def tp_rank_model_dir(preset: str, P: int) -> str:
    cfg = dict(PRESETS[preset])
    if not set(cfg.get("architectures", ())) & set(CUT_FAMILIES):
        raise ValueError(f"{preset}: its architecture {cfg.get('architectures')} is not one this cut holds "
                         f"({', '.join(CUT_FAMILIES)})")
    for key in ("num_attention_heads", "num_key_value_heads", "moe_intermediate_size", "intermediate_size",
                "vocab_size"):
        if cfg[key] % P:
            raise ValueError(f"{preset}: {key} {cfg[key]} is not divisible by {P}")
        cfg[key] //= P
    path = tempfile.mkdtemp(prefix=f"{preset}-tp{P}-rank-")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path
