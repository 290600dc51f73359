"""DeepSeek-V2 / V3 forward (transformers' DeepseekV2ForCausalLM / DeepseekV3ForCausalLM semantics), reading weight
views handed to it, over the `Communicator`: the same math in every layout (head counts from the weight shapes, the
shared experts' shard from theirs). MLA is `mla.py`'s over the paged latent cache (on the GPU absorbed through the
Triton kernels; on the CPU the torch reference, decodes absorbed and prompt chunks expanded), the MoE block
models/grouped_moe.py's (shared with GLM-4.5).
Shapes: T tokens, D hidden, K top-k, V vocab; P pages, S page size, A one latent cache entry.
"""

from __future__ import annotations

import torch

from moebius.config import ModelConfig
from moebius.kernels import KernelConfig, triton_available
from moebius.layers.attention import AttentionGeometry, AttentionMetadata
from moebius.models.decoder import decoder, num_moe_layers  # noqa: F401  (the family's)
from moebius.models.deepseek.config import DeepseekConfig
from moebius.models.deepseek.mla import attend_absorbed, mla_attention, rope_table
from moebius.models.grouped_moe import moe
from moebius.models.weights import DenseWeights, ModelWeights, MoEWeights, logits  # noqa: F401  (the family's)
from moebius.parallel.dispatch import Communicator


def family_rope_table(cfg: ModelConfig, device: torch.device) -> torch.Tensor:
    """The region "rope": [max_position_embeddings, qk_rope_head_dim] float32, YaRN's where the config says."""
    ext = cfg.extra_as(DeepseekConfig)
    return rope_table(ext.mla, cfg.max_position_embeddings, device)


def forward(input_ids_T: torch.Tensor, meta: AttentionMetadata, weights: ModelWeights, kv: list[torch.Tensor],
            cfg: ModelConfig, comm: Communicator, kc: KernelConfig, routed_TLK: torch.Tensor | None = None
            ) -> torch.Tensor:
    """Final-normed hidden states [T, D] of the new tokens (`decoder`); DeepSeek's layers: MLA over the latent cache,
    the grouped MoE block with shared experts (or a dense MLP)."""
    ext = cfg.extra_as(DeepseekConfig)
    return decoder(input_ids_T, weights, kv, cfg, comm, kc, routed_TLK,
                   # the one part and the one latent "head" of the pool's view: [pages, page size, A]
                   lambda i, h, w, cache: mla_attention(h, w, cache[:, 0, :, 0], meta, ext.mla, weights.rope, kc=kc),
                   lambda h, w, record: moe(h, w, ext.moe, comm, kc, record))



def attention_geometry(cfg: ModelConfig, weights: ModelWeights, kv: list[torch.Tensor]) -> AttentionGeometry:
    """A rank's latent attention: between step pieces the absorbed query (C + R a head) and the weighted latent
    sums (C a head); a decoding sequence's programs are its head blocks (kernels/mla.py's `decode_head_block`);
    no query-block table."""
    ext = cfg.extra_as(DeepseekConfig)
    mla = ext.mla
    heads = weights.layers[0].attn.q_QL.shape[0] // (mla.qk_nope_head_dim + mla.qk_rope_head_dim)
    block, programs = heads, 0  # (off the GPU's kernels no step splits its keys: any value)
    if triton_available():
        from moebius.kernels.mla import DECODE_MIN_PROGRAMS as programs
        from moebius.kernels.mla import decode_head_block

        block = decode_head_block(heads, kv[0])  # (the cache's dtype and device: the launch's)
    return AttentionGeometry(heads=heads, q_dim=mla.cache_dim, o_dim=mla.kv_lora_rank,
                             split_units=-(-heads // block), group=None, min_programs=programs)


attend = attend_absorbed  # a layer's attention between two step pieces
