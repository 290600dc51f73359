"""GPT-OSS's MXFP4 checkpoints (the releases' format) served on the CPU: loaded dequantized, with transformers' greedy
tokens on the model transformers' own dequantization gives (Mxfp4Config(dequantize=True)), at P = 1 and P = 2 in TP
and EP; a weight update takes the packed pieces by name and from disk; a broken packed checkpoint, another method
and MXFP4 on another architecture are refused by name.

Checkpoints: test_gpt_oss_family.py's tiny GptOssForCausalLM (its float weights of seed 0 or 3) with every expert
projection replaced by random MXFP4 pieces written as transformers stores them (transformers' own quantizer needs a
hub kernel: the pieces are drawn instead, every e2m1 code, exponents 2^-5 .. 2^-2) and the releases'
quantization_config; each one's dequantized twin is transformers' load of it with dequantize=True, saved.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from family_cases import unpacked_dtypes
from safetensors.torch import load_file, save_file
from test_gpt_oss_family import (
    ENGINE_KW,
    N_OUT,
    PROMPTS,
    _config,
    assert_kv_free,
    greedy_outputs,
    hf_greedy,
    write_gpt_oss_checkpoint,
)

from moebius import LLM
from moebius.config import ConfigError
from moebius.models.loader import Checkpoint, check_update
from moebius.models.registry import model_config
from moebius.models.source import check_quantization, hf_config_of

WEIGHTS = "model.safetensors"
PACKED = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
# the releases' quantization_config (openai/gpt-oss-20b's config.json)
QUANTIZATION = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
GATE_UP_0 = "model.layers.0.mlp.experts.gate_up_proj"
DOWN_1 = "model.layers.1.mlp.experts.down_proj"


def edit_config(path: str, **changes: Any) -> None:
    hf = _config(path)
    hf.update(changes)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f)


def edit_tensors(path: str, fn: Callable[[dict[str, torch.Tensor]], None]) -> None:
    tensors = load_file(os.path.join(path, WEIGHTS))
    fn(tensors)
    save_file(tensors, os.path.join(path, WEIGHTS), metadata={"format": "pt"})


def write_mxfp4_checkpoint(path: str, seed: int, overrides: dict[str, Any] | None = None) -> str:
    """The float checkpoint of `seed` (its config with `overrides`), its expert projections ([E, K, R]) stored as
    random MXFP4 pieces instead: `_blocks` [E, R, K / 32, 16] and `_scales` [E, R, K / 32], uint8."""
    write_gpt_oss_checkpoint(path, overrides, seed=seed)
    g = torch.Generator().manual_seed(seed)

    def pack(t: dict[str, torch.Tensor]) -> None:
        for name in [k for k in t if k.endswith(PACKED)]:
            E, K, R = t.pop(name).shape
            t[name + "_blocks"] = torch.randint(0, 256, (E, R, K // 32, 16), generator=g, dtype=torch.uint8)
            t[name + "_scales"] = torch.randint(122, 126, (E, R, K // 32), generator=g, dtype=torch.uint8)

    edit_tensors(path, pack)
    edit_config(path, quantization_config=QUANTIZATION)
    return path


def write_dequantized(path: str, packed: str) -> str:
    """transformers' dequantization of `packed` (Mxfp4Config(dequantize=True)), saved as a float32 checkpoint: its
    state dict written here, the config without its quantization_config (5.17's save_pretrained of a dequantized
    model drops the experts, and its dequantized experts are bf16: the same values, e2m1 times a power of two)."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    model = AutoModelForCausalLM.from_pretrained(packed, dtype=torch.float32,
                                                 quantization_config=Mxfp4Config(dequantize=True))
    os.makedirs(path, exist_ok=True)
    save_file({n: t.float().contiguous() for n, t in model.state_dict().items()},
              os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    config = {k: v for k, v in _config(packed).items() if k != "quantization_config"}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], str]:
    """"mx" / "mx_b": packed checkpoints of seed 0 / 3; "deq" / "deq_b": transformers' dequantization of each."""
    root = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    paths: dict[str, str] = {}
    makers: dict[str, Callable[[str], str]] = {
        "mx": lambda p: write_mxfp4_checkpoint(p, 0),
        "mx_b": lambda p: write_mxfp4_checkpoint(p, 3),
        "deq": lambda p: write_dequantized(p, get("mx")),
        "deq_b": lambda p: write_dequantized(p, get("mx_b")),
    }

    def get(name: str) -> str:
        if name not in paths:
            paths[name] = makers[name](str(root / name))
        return paths[name]

    return get


def broken_copy(ckpt: Callable[[str], str], tmp_path: Any, edit: Callable[[dict[str, torch.Tensor]], None]) -> str:
    path = str(tmp_path / "broken")
    shutil.copytree(ckpt("mx"), path)
    edit_tensors(path, edit)
    return path


# ---------------------------------------------------------------------------------------------------------------
# The packed checkpoint as the loader reads it
# ---------------------------------------------------------------------------------------------------------------

def test_a_packed_tensor_is_served_by_name_as_transformers_dequantizes_it(ckpt: Callable[[str], str]) -> None:
    """The checkpoint serves each expert projection by its float name, dequantized to the asked dtype: transformers'
    own load with dequantize=True (float32) and its `convert_moe_packed_tensors` (bfloat16), bit for bit; every
    other tensor as stored."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    c, deq = Checkpoint(ckpt("mx")), load_file(os.path.join(ckpt("deq"), WEIGHTS))
    raw = load_file(os.path.join(ckpt("mx"), WEIGHTS))
    assert c.packing is not None and c.packing.method == "mxfp4"
    for name in (GATE_UP_0, DOWN_1):
        shape = tuple(deq[name].shape)
        assert name in c and name not in c.names
        assert torch.equal(c.get(name, shape), deq[name])
        want = convert_moe_packed_tensors(raw[name + "_blocks"], raw[name + "_scales"], dtype=torch.bfloat16)
        got = c.get(name, shape, torch.bfloat16)
        assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    bias = GATE_UP_0 + "_bias"
    assert torch.equal(c.get(bias, tuple(deq[bias].shape), torch.bfloat16), deq[bias])


def test_the_checks_read_the_pieces_for_their_names(ckpt: Callable[[str], str],
                                                    caplog: pytest.LogCaptureFixture) -> None:
    """The front end's checks take each projection's pieces for the name they stand for: the config parses, the
    checkpoint passes, and no piece is listed as a tensor nothing reads."""
    path = ckpt("mx")
    cfg = model_config(hf_config_of(path))
    from moebius.models.loader import check_checkpoint

    with caplog.at_level("WARNING", logger="moebius"):
        check_checkpoint(Checkpoint(path), cfg, cfg.num_layers)
    assert not [r for r in caplog.records if "no Moebius weight reads" in r.getMessage()]


# (id, how the packed checkpoint is broken, the float tensor it breaks, what the message must say)
BROKEN: list[tuple[str, Callable[[dict[str, torch.Tensor]], None], str, str]] = [
    ("missing-scales", lambda t: t.pop(DOWN_1 + "_scales"), DOWN_1,
     rf"missing tensor {re.escape(DOWN_1)}_scales \(one of the mxfp4 pieces \({re.escape(DOWN_1)}_blocks, "
     rf"{re.escape(DOWN_1)}_scales\) of {re.escape(DOWN_1)}, \(8, 32, 64\)\)"),
    ("blocks-of-a-wrong-shape", lambda t: t.update({GATE_UP_0 + "_blocks": t[GATE_UP_0 + "_blocks"][:, :, :1].clone()}),
     GATE_UP_0,
     rf"tensor {re.escape(GATE_UP_0)}_blocks in '.*' has shape \(8, 64, 1, 16\), expected \(8, 64, 2, 16\) \(the "
     rf"mxfp4 pieces .* of {re.escape(GATE_UP_0)}, \(8, 64, 64\)\)"),
    ("scales-not-uint8", lambda t: t.update({DOWN_1 + "_scales": t[DOWN_1 + "_scales"].to(torch.int32)}), DOWN_1,
     rf"tensor {re.escape(DOWN_1)}_scales in '.*' is stored as I32, expected U8"),
]


@pytest.mark.parametrize("edit,name,pattern", [pytest.param(*b[1:], id=b[0]) for b in BROKEN])
def test_a_broken_packed_checkpoint_is_refused_naming_the_piece(ckpt: Callable[[str], str], tmp_path: Any,
                                                                 edit: Callable[[dict[str, torch.Tensor]], None],
                                                                 name: str, pattern: str) -> None:
    """At start-up (the front end's checks, before any rank) and on a rank's own read of the checkpoint."""
    path = broken_copy(ckpt, tmp_path, edit)
    with pytest.raises(ConfigError, match=pattern):
        LLM(model=path, **ENGINE_KW)
    shape = (8, 32, 64) if name == DOWN_1 else (8, 64, 64)
    with pytest.raises((ConfigError, KeyError), match=re.escape(name + "_")):  # (the piece named)
        Checkpoint(path).get(name, shape)


@pytest.mark.parametrize("quant,arch", [
    ({"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}, "GptOssForCausalLM"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128}, "GptOssForCausalLM"),
    (QUANTIZATION, "Qwen3MoeForCausalLM"),
    (QUANTIZATION, "DeepseekV3ForCausalLM"),
])
def test_another_method_or_mxfp4_elsewhere_is_refused(quant: dict[str, Any], arch: str) -> None:
    """GPT-OSS reads MXFP4 only, and MXFP4 is read for GPT-OSS only: the message names the method, the
    architecture and what is read where."""
    method = re.escape(repr(quant["quant_method"]))
    with pytest.raises(ConfigError, match=rf"config\.json has a quantization_config \(quant_method {method}.*\): a "
                                          rf"quantized checkpoint, and Moebius reads no such one for \['{arch}'\] "
                                          r"\(it reads fp8 for Qwen3MoeForCausalLM, DeepseekV3ForCausalLM, "
                                          r"DeepseekV2ForCausalLM; mxfp4 for GptOssForCausalLM\)"):
        check_quantization({"architectures": [arch], "quantization_config": quant}, "config.json", None)
    check_quantization({"architectures": ["GptOssForCausalLM"], "quantization_config": QUANTIZATION}, "config.json",
                       None)


def test_an_update_by_name_checks_the_pieces(ckpt: Callable[[str], str]) -> None:
    """Pieces of the model's packed names are taken whole (kept as given), each of its shape and dtype, never one
    without the others, never beside the float tensor they stand for; a model whose family reads no MXFP4 knows
    no such name."""
    cfg = model_config(_config(ckpt("deq")))
    raw = load_file(os.path.join(ckpt("mx_b"), WEIGHTS))
    pieces = {n: raw[n] for n in (DOWN_1 + "_blocks", DOWN_1 + "_scales")}
    out = check_update(cfg, pieces)
    assert out.keys() == pieces.keys() and all(out[n] is not None and out[n].dtype == torch.uint8 for n in out)
    with pytest.raises(ValueError, match=rf"tensor {re.escape(DOWN_1)}_scales is missing: {re.escape(DOWN_1)} given "
                                         r"as mxfp4 pieces needs all of"):
        check_update(cfg, {DOWN_1 + "_blocks": raw[DOWN_1 + "_blocks"]})
    with pytest.raises(ValueError, match=rf"tensor {re.escape(DOWN_1)}_blocks has shape \(8, 64, 2, 16\); as the "
                                         r"mxfp4 piece of the model's .* it is \(8, 64, 1, 16\)"):
        check_update(cfg, {**pieces, DOWN_1 + "_blocks": torch.zeros(8, 64, 2, 16, dtype=torch.uint8)})
    with pytest.raises(ValueError, match=rf"tensor {re.escape(DOWN_1)}_scales is torch.float32; as the mxfp4 piece"):
        check_update(cfg, {**pieces, DOWN_1 + "_scales": pieces[DOWN_1 + "_scales"].float()})
    with pytest.raises(ValueError, match=r"is given twice .*the mxfp4 pieces of"):
        check_update(cfg, {**pieces, DOWN_1: torch.zeros(8, 32, 64)})


# ---------------------------------------------------------------------------------------------------------------
# Served: transformers' tokens on its dequantized model, and updates of packed pieces
# ---------------------------------------------------------------------------------------------------------------

ENGINES = [(1, "tp"), (2, "ep")]


@pytest.fixture(scope="module", params=ENGINES, ids=[f"P{p}-{m}" for p, m in ENGINES])
def engine(request: pytest.FixtureRequest, ckpt: Callable[[str], str]) -> Iterator[tuple[int, LLM]]:
    P, mode = request.param
    llm = LLM(model=ckpt("mx"), num_ranks=P, mode=mode, **ENGINE_KW)
    yield P, llm
    llm.close()


def test_greedy_equals_transformers_on_its_dequantized_model(engine: tuple[int, LLM],
                                                             ckpt: Callable[[str], str]) -> None:
    """The packed checkpoint served in its start layout, then the other after a switch: the greedy tokens of
    transformers' model dequantized by transformers."""
    P, llm = engine
    want = [hf_greedy(ckpt("deq"), tuple(p), N_OUT) for p in PROMPTS]
    start = llm.mode
    for mode in (start, "ep" if start == "tp" else "tp"):
        if llm.mode != mode:
            assert llm.switch_mode(mode).done
        assert greedy_outputs(llm, PROMPTS) == want, f"P = {P} {mode}"
        assert_kv_free(llm)


def test_updates_take_packed_pieces(engine: tuple[int, LLM], ckpt: Callable[[str], str], tmp_path: Any) -> None:
    """At P = 2: an update by name of packed pieces (layer 0's gate_up_proj, layer 1's down_proj, from the other
    checkpoint) gives the tokens of transformers' dequantized model with those two replaced, in both layouts; an
    update from a packed directory with a missing piece is refused naming it; one from the other packed
    checkpoint gives its dequantized model's tokens."""
    P, llm = engine
    if P != 2:
        pytest.skip("the update runs on the P = 2 engine (TP and EP)")
    from transformers import AutoModelForCausalLM

    raw_b = load_file(os.path.join(ckpt("mx_b"), WEIGHTS))
    names = [n + s for n in (GATE_UP_0, DOWN_1) for s in ("_blocks", "_scales")]
    deq_b = load_file(os.path.join(ckpt("deq_b"), WEIGHTS))
    model = AutoModelForCausalLM.from_pretrained(ckpt("deq"), dtype=torch.float32)
    model.load_state_dict({n: deq_b[n] for n in (GATE_UP_0, DOWN_1)}, strict=False)
    mixed = str(tmp_path / "mixed")
    model.save_pretrained(mixed)
    prompts = PROMPTS[2:4]
    want = [hf_greedy(mixed, tuple(p), N_OUT) for p in prompts]
    assert want != [hf_greedy(ckpt("deq"), tuple(p), N_OUT) for p in prompts]  # the update changes tokens
    assert llm.update_weights([(n, raw_b[n]) for n in names]).done
    for mode in ("tp", "ep"):
        if llm.mode != mode:
            assert llm.switch_mode(mode).done
        assert greedy_outputs(llm, prompts) == want, mode
    broken = broken_copy(ckpt, tmp_path, lambda t: t.pop(GATE_UP_0 + "_scales"))
    with pytest.raises(ConfigError, match=rf"missing tensor {re.escape(GATE_UP_0)}_scales"):
        llm.update_weights_from_disk(broken)
    assert greedy_outputs(llm, prompts) == want  # nothing written
    assert llm.update_weights_from_disk(ckpt("mx_b")).done
    want = [hf_greedy(ckpt("deq_b"), tuple(p), N_OUT) for p in prompts]
    for mode in ("tp", "ep"):
        if llm.mode != mode:
            assert llm.switch_mode(mode).done
        assert greedy_outputs(llm, prompts) == want, mode
    assert_kv_free(llm)


def test_pieces_without_a_quantization_config_are_named(ckpt: Callable[[str], str], tmp_path: Any) -> None:
    """Packed pieces whose config.json names no method are not read as anything: the float tensor is missing, and
    the message says which pieces are there and what config.json lacks."""
    path = broken_copy(ckpt, tmp_path, lambda t: None)
    edit_config(path, quantization_config=None)
    with pytest.raises(ConfigError, match=rf"is missing tensors {re.escape(GATE_UP_0)}, .* \(it stores "
                                          rf"{re.escape(GATE_UP_0)}_blocks, {re.escape(GATE_UP_0)}_scales, the mxfp4 "
                                          r"pieces of it, but no quantization_config in its config\.json names "
                                          r"quant_method 'mxfp4'\)"):
        LLM(model=path, **ENGINE_KW)


def test_a_bfloat16_engine_dequantizes_straight_to_bfloat16(ckpt: Callable[[str], str],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The load dequantizes each packed projection once, to the engine's dtype (no float32 copy of a layer's
    experts), and the engine serves."""
    from moebius.models.gpt_oss.mxfp4 import Mxfp4Packing

    seen = unpacked_dtypes(Mxfp4Packing, ckpt("mx"), PROMPTS[0], monkeypatch)
    assert seen == [torch.bfloat16] * 6  # 3 layers, 2 projections
