"""DeepSeek-V2 / V3 forward (transformers' DeepseekV2ForCausalLM / DeepseekV3ForCausalLM semantics), reading weight
views handed to it, over the `Communicator`: the same math in every layout (head counts from the weight shapes, the
shared experts' shard from theirs). MLA is `mla.py`'s over the paged latent cache (on the GPU absorbed through the
Triton kernels; on the CPU the torch reference, decodes absorbed and prompt chunks expanded), the MoE block
models/grouped_moe.py's (shared with GLM-4.5).
Shapes: T tokens, D hidden, K top-k, V vocab; P pages, S page size, A one latent cache entry.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moebius.config import ModelConfig
from moebius.kernels import KernelConfig, triton_available
from moebius.layers.attention import AttentionGeometry, AttentionMetadata
from moebius.layers.moe import dense_mlp
from moebius.layers.norm import add_rms_norm
from moebius.models.deepseek.config import DeepseekConfig
from moebius.models.deepseek.mla import attend_absorbed, mla_attention, rope_table
from moebius.models.grouped_moe import GroupedMoEWeights, moe
from moebius.models.weights import DenseWeights, ModelWeights, MoEWeights, logits  # noqa: F401  (the family's)
from moebius.parallel.dispatch import Communicator


def family_rope_table(cfg: ModelConfig, device: torch.device) -> torch.Tensor:
    """The region "rope": [max_position_embeddings, qk_rope_head_dim] float32, YaRN's where the config says."""
    ext = cfg.extra
    assert isinstance(ext, DeepseekConfig)
    return rope_table(ext.mla, cfg.max_position_embeddings, device)


def forward(input_ids_T: torch.Tensor, meta: AttentionMetadata, weights: ModelWeights, kv: list[torch.Tensor],
            cfg: ModelConfig, comm: Communicator, kc: KernelConfig, routed_TLK: torch.Tensor | None = None
            ) -> torch.Tensor:
    """Final-normed hidden states [T, D] of the new tokens; their latent cache entries are written into `kv` (one
    [pages, 1, page size, 1, A] cache a layer). Each sublayer's output is summed over ranks (attention:
    `reduce_add_norm`; experts: `combine_add_norm`), added to the residual and normed for the next sublayer.
    routed_TLK: a [>= T, MoE layers, K] integer buffer the router's expert ids of every MoE layer are written into."""
    ext = cfg.extra
    assert isinstance(ext, DeepseekConfig)
    eps = cfg.rms_norm_eps
    residual = F.embedding(input_ids_T, weights.embed_VD)
    h, residual = add_rms_norm(residual, None, weights.layers[0].input_norm, eps, kc=kc)
    norms = [layer.input_norm for layer in weights.layers[1:]] + [weights.norm]
    j = 0  # the MoE layer's index among the MoE layers (dense layers route nothing)
    for layer, cache, next_norm in zip(weights.layers, kv, norms, strict=True):
        cache_PSA = cache[:, 0, :, 0]  # the one part and the one latent "head" of the pool's view
        a = mla_attention(h, layer.attn, cache_PSA, meta, ext.mla, weights.rope, kc=kc)
        h, residual = comm.reduce_add_norm(a, residual, layer.post_norm, eps, kc=kc)
        if isinstance(layer.mlp, GroupedMoEWeights):
            record = None
            if routed_TLK is not None:
                record, j = routed_TLK[:, j], j + 1
            y, handle = moe(h, layer.mlp, ext.moe, comm, kc, record)
        else:
            assert isinstance(layer.mlp, DenseWeights)
            y, handle = dense_mlp(h, layer.mlp.w13_FD, layer.mlp.w2_DF, kc=kc), None  # no dispatch: nothing to combine
        h, residual = comm.combine_add_norm(y, handle, residual, next_norm, eps, kc=kc)
    return h


def num_moe_layers(weights: ModelWeights) -> int:
    """Layers with routed experts (the second dim of `forward`'s routed_TLK)."""
    return sum(isinstance(layer.mlp, MoEWeights) for layer in weights.layers)


def attention_geometry(cfg: ModelConfig, weights: ModelWeights, kv: list[torch.Tensor]) -> AttentionGeometry:
    """A rank's latent attention: between step pieces the absorbed query (C + R a head) and the weighted latent
    sums (C a head); a decoding sequence's programs are its head blocks (kernels/mla.py's HEAD_BLOCK heads each);
    no query-block table."""
    ext = cfg.extra
    assert isinstance(ext, DeepseekConfig)
    mla = ext.mla
    heads = weights.layers[0].attn.q_QL.shape[0] // (mla.qk_nope_head_dim + mla.qk_rope_head_dim)
    block = heads  # (off the GPU's kernels no step splits its keys: any value)
    if triton_available():
        from moebius.kernels.mla import HEAD_BLOCK as block
    return AttentionGeometry(heads=heads, q_dim=mla.cache_dim, o_dim=mla.kv_lora_rank,
                             split_units=-(-heads // block), group=None)


attend = attend_absorbed  # a layer's attention between two step pieces
