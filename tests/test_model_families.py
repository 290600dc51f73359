"""The model interface: families found by a checkpoint's `architectures` (an unknown one refused naming those
served), a family's checkpoint names are what transformers writes, nothing outside a family's folder and the
registry imports a family, and the KV spec sizes the pool and the switch's KV plan (K/V heads, or one latent "head"
that TP replicates on every rank and EP holds once)."""

from __future__ import annotations

import json
import os
import re
import weakref

import pytest
import torch
from conftest import Checkpoints
from safetensors import safe_open
from test_import_graph import _graphs

from moebius.config import PRESETS, ConfigError, KVSpec, ModelConfig
from moebius.memory.kv_pool import KVPool
from moebius.memory.umm import MemoryPlan, UnifiedMemory
from moebius.models.registry import FAMILIES, family_for, family_of, model_config
from moebius.parallel.layout import Layout
from moebius.switch.plan import LiveKV, kv_ep_to_tp, kv_tp_to_ep


def test_an_unknown_architecture_names_those_served() -> None:
    served = ", ".join(a for f in FAMILIES.values() for a in f.architectures)
    assert {"Qwen3MoeForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM"} <= set(served.split(", "))
    with pytest.raises(ConfigError, match=re.escape(f"unsupported architecture ['LlamaForCausalLM'] in config.json; "
                                                    f"Moebius serves {served}") + "$"):
        model_config({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2})
    with pytest.raises(ConfigError, match="unsupported architecture 'mystery'"):
        family_for({"model_type": "mystery"})


def test_a_config_names_its_family_and_its_kv_spec() -> None:
    cfg = model_config(PRESETS["qwen3-30b-a3b"])
    assert family_of(cfg) is FAMILIES["qwen3_moe"] and cfg.family == "qwen3_moe"
    assert cfg.kv_spec == KVSpec(parts=2, heads=4, dim=128)


def test_the_checkpoint_names_are_transformers_own(ckpt: Checkpoints) -> None:
    """Every tensor transformers saved is one the family reads (its fused expert names besides), and no other."""
    path = ckpt("dense_layer")
    with open(os.path.join(path, "config.json")) as f:
        cfg = model_config(json.load(f))
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        saved = set(f.keys())
    known = family_of(cfg).checkpoint_tensors(cfg)
    fused = {n for n in known if n.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))}
    assert set(known) - fused == saved and fused


def test_no_module_outside_a_family_imports_it() -> None:
    files, _ = _graphs()
    for family in FAMILIES:
        pkg = f"moebius.models.{family}"
        users = {m for m, targets in files.items() if any(t == pkg or t.startswith(pkg + ".") for t in targets)}
        assert {m for m in users if not m.startswith(pkg + ".")} <= {"moebius.models.registry"}, users


def _latent_cfg(P: int) -> ModelConfig:
    """A Qwen3-shaped config whose cache is one latent "head" of 24 values a token (an MLA-like KV spec)."""
    cfg = model_config(PRESETS["qwen3-30b-a3b"], num_layers=2)
    return ModelConfig(**{**cfg.__dict__, "num_kv_heads": 1, "num_heads": 4 * P, "kv_parts": 1, "kv_dim": 24})


@pytest.mark.parametrize("P", [2, 4])
def test_a_latent_cache_is_replicated_in_tp_and_held_once_in_ep(P: int) -> None:
    cfg = _latent_cfg(P)
    spec = cfg.kv_spec
    assert spec == KVSpec(1, 1, 24)
    tp = [Layout(cfg, "tp", r, P) for r in range(P)]
    ep = Layout(cfg, "ep", 0, P)
    assert all(lay.num_kv_heads == 1 and lay.kv_heads == range(0, 1) for lay in tp)  # every TP rank, the whole
    assert ep.num_kv_heads == 1
    plan = MemoryPlan()
    page = KVPool.page_bytes(4, spec, 1, torch.float32)
    assert page == 4 * 24 * 4
    plan.add_slots([[(None, 3 * page)]])
    pool = KVPool(UnifiedMemory(plan, torch.device("cpu")), [0], [0], [3], [0], 4, spec, 1, torch.float32)
    assert pool.layers[0].shape == (3, 1, 4, 1, 24)
    # TP -> EP: only the lowest rank of the replicas sends each request's latent, to its new owner
    reqs = [LiveKV(owner=1, num_tokens=6, src_pages=[1, 2], dst_pages=[1, 2])]
    moves = [kv_tp_to_ep(reqs, me, tp, 4) for me in range(P)]
    senders = [me for me, m in enumerate(moves) if any(len(s) for s in m.send_slots)]
    assert senders == [0]
    # EP -> TP: the owner's latent goes to every rank
    move = kv_ep_to_tp(reqs, 1, tp, 4)
    assert all(len(s) == 6 for s in move.send_slots) and list(move.recv_heads[1]) == [0]


def test_routers_stay_in_float32_where_transformers_keeps_them(ckpt: Checkpoints) -> None:
    """A bf16 DeepSeek-V3 rank holds each MoE layer's router and e_score_correction_bias in float32, bit for bit the
    checkpoint's (transformers' _keep_in_fp32_modules_strict: a bf16 copy of the bias could flip a near-tie between
    experts), the rest in bf16."""
    from moebius.config import EngineConfig
    from moebius.worker.build import build_rank
    from moebius.worker.rank import RankSpec

    path = ckpt("deepseek_v3")
    with open(os.path.join(path, "config.json")) as f:
        cfg = model_config(json.load(f))
    rank = build_rank(RankSpec(engine=EngineConfig.from_kwargs(model=path, device="cpu", max_total_tokens=256),
                               model=cfg, checkpoint=path, device="cpu", dtype="bfloat16", eos_token_ids=(),
                               max_model_len=64))
    layers = next(iter(rank.modes.values())).runner.weights.layers
    moe = [(i, lw.mlp) for i, lw in enumerate(layers) if cfg.is_moe_layer(i)]
    assert moe
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        for i, mlp in moe:
            p = f"model.layers.{i}.mlp.gate."
            assert mlp.gate_ED.dtype == mlp.bias_E.dtype == torch.float32
            assert torch.equal(mlp.gate_ED, f.get_tensor(p + "weight").float())
            assert torch.equal(mlp.bias_E, f.get_tensor(p + "e_score_correction_bias").float())
            assert mlp.w13_EFD.dtype == torch.bfloat16
    assert layers[0].attn.kv_a_AD.dtype == torch.bfloat16


@pytest.mark.parametrize("mode", ["tp", "ep"])
def test_a_layers_experts_are_fetched_as_the_ones_before_are_written(mode: str) -> None:
    """The load streams a layer's per-expert tensors into its slot: at most two sources alive at once (the one being
    written and the next fetched), never the layer's whole (DeepSeek-V3's experts, whole on one rank, are 2x a GPU's
    room beside the model in float32)."""
    from moebius.models.specs import ExpertCut

    cfg = model_config(PRESETS["qwen3-30b-a3b"], num_layers=1)
    lay = Layout(cfg, mode, 0, 2)
    I, D, E = 8, 4, cfg.num_experts
    alive, most = set(), [0]

    def fetch(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        t = torch.randn(shape)
        alive.add(id(t))
        weakref.finalize(t, alive.discard, id(t))
        most[0] = max(most[0], len(alive))
        return t

    for which, dst in (("w13", torch.zeros(lay.num_local_experts, 2 * I // lay.tp, D)),
                       ("w2", torch.zeros(lay.num_local_experts, D, I // lay.tp))):
        most[0] = 0
        cut = ExpertCut("model.layers.0.", which, lay, (E, 2 * I, D) if which == "w13" else (E, D, I),
                        ((I, D), (I, D)) if which == "w13" else ((D, I),))
        cut.fill(fetch, dst)
        assert dst.abs().sum(dim=tuple(range(1, dst.dim()))).ne(0).all()  # every local expert written
        assert most[0] <= 2, f"{which}: {most[0]} source tensors alive at once"
