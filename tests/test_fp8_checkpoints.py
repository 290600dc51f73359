"""Block-FP8 checkpoints (the Qwen3-MoE and DeepSeek-V3 FP8 releases' format) served on the CPU: each quantized
weight read by its name, dequantized as transformers dequantizes it, what the checkpoint left in bf16 read as stored;
the greedy tokens of transformers' model on the dequantized weights at P = 1 and P = 2 in TP and EP; a weight update
takes a float8 weight and its scales by name; a broken FP8 checkpoint is refused naming the tensor, fp8 on GPT-OSS
and a block size other than the releases' naming the setting.

Checkpoints: a tiny Qwen3MoeForCausalLM (moe_intermediate_size 160) and a tiny DeepseekV3ForCausalLM (dense
intermediate 160, experts' 144), random float weights of seed 0 (and 3: the update's source), each Linear weight
quantized here per 128 x 128 block as the releases store it (float8_e4m3fn, float32 `weight_scale_inv` of
ceil(out / 128) x ceil(in / 128): two blocks along a dim of 144 or 160, the second ragged) and every other tensor
stored in bf16, with the releases' quantization_config; each one's dequantized twin is transformers' own block
dequantization (finegrained_fp8's) of its weights, saved as a float checkpoint.
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
from conftest import PROMPTS as QWEN_PROMPTS
from conftest import write_checkpoint, write_deepseek_checkpoint
from family_cases import ENGINE_KW, hf_greedy, parity_across_switch, random_prompts, saved_tensors, unpacked_dtypes
from family_cases import hf_config as _config
from safetensors.torch import save_file

from moebius import LLM
from moebius.config import ConfigError
from moebius.models.loader import Checkpoint, check_checkpoint, check_update
from moebius.models.registry import model_config
from moebius.models.source import check_quantization, hf_config_of

WEIGHTS = "model.safetensors"
N_OUT = 8
BLOCK = 128
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max
# Qwen3's FP8 releases' quantization_config; layer 2's q_proj left in bf16 beside the routers and lm_head
QWEN_QUANT = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128],
              "modules_to_not_convert": ["lm_head", "model.layers.0.mlp.gate", "model.layers.1.mlp.gate",
                                         "model.layers.2.mlp.gate", "model.layers.2.self_attn.q_proj"]}
# DeepSeek-V3's: no modules_to_not_convert (the routers, norms, embeddings and lm_head are no Linear it quantizes)
DEEPSEEK_QUANT = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                  "weight_block_size": [128, 128]}
QWEN_EXPERT = "model.layers.1.mlp.experts.3.gate_proj.weight"  # [160, 64]: scales [2, 1]
QWEN_DOWN = "model.layers.0.mlp.experts.5.down_proj.weight"  # [64, 160]: scales [1, 2]
QWEN_KEPT = "model.layers.2.self_attn.q_proj.weight"  # modules_to_not_convert
DS_KV_A = "model.layers.1.self_attn.kv_a_proj_with_mqa.weight"  # [40, 64]: one ragged block
DS_DENSE = "model.layers.0.mlp.down_proj.weight"  # [64, 160]
DS_SHARED = "model.layers.2.mlp.shared_experts.up_proj.weight"  # [144, 64]


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 scale_inv [ceil(out / 128), ceil(in / 128)]): each block's max |w| at 448."""
    rows, cols = w.shape
    scale = torch.ones(-(-rows // BLOCK), -(-cols // BLOCK))
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            blk = w[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK].float()
            scale[i, j] = blk.abs().max().clamp(min=1e-12) / FP8_MAX
            q[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK] = (blk / scale[i, j]).to(torch.float8_e4m3fn)
    return q, scale


def quantized(name: str, t: torch.Tensor, keep: list[str]) -> bool:
    """Whether the release quantizes tensor `name`: a Linear's weight (no embedding, lm_head or router) outside
    modules_to_not_convert."""
    module = name.removesuffix(".weight")
    return (t.ndim == 2 and name.endswith(".weight")
            and not name.endswith(("embed_tokens.weight", "lm_head.weight", "mlp.gate.weight"))
            and not any(module == k or module.startswith(k + ".") for k in keep))


def write_json(path: str, hf: dict[str, Any]) -> None:
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f)


def to_fp8(path: str, quant: dict[str, Any]) -> str:
    """The float checkpoint at `path` rewritten in the released FP8 format (in place)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in saved_tensors(path).items():
        if quantized(name, t, quant.get("modules_to_not_convert", [])):
            out[name], out[name.removesuffix(".weight") + ".weight_scale_inv"] = quantize(t)
        else:
            out[name] = t.to(torch.bfloat16)
    save_file(out, os.path.join(path, WEIGHTS), metadata={"format": "pt"})
    write_json(path, {**_config(path), "quantization_config": quant})
    return path


def hf_dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """transformers' block dequantization (finegrained_fp8's, ragged edge blocks cut), in float32 then rounded once
    to `dtype`, as its loader's Fp8Dequantize rounds (its helper multiplies in `dtype`: a second rounding)."""
    from transformers.integrations import finegrained_fp8 as hf

    if hasattr(hf, "_dequantize_fp8_weight"):
        return hf._dequantize_fp8_weight(weight, scale_inv, [BLOCK, BLOCK], torch.float32).to(dtype)
    # (transformers before it, as on the lent GPU machine: its loader's op, the same block rule)
    return hf.Fp8Dequantize(None)._dequantize_one(weight, scale_inv, torch.float32).to(dtype)


def write_dequantized(path: str, packed: str) -> str:
    """The FP8 checkpoint `packed` dequantized by transformers, saved as a float32 checkpoint without its
    quantization_config."""
    os.makedirs(path)
    raw = saved_tensors(packed)
    out = {n: (hf_dequantize(t, raw[n + "_scale_inv"], torch.float32) if n + "_scale_inv" in raw else t.float())
           for n, t in raw.items() if not n.endswith("_scale_inv")}
    save_file(out, os.path.join(path, WEIGHTS), metadata={"format": "pt"})
    hf = _config(packed)
    del hf["quantization_config"]
    write_json(path, hf)
    return path


MAKERS: dict[str, Callable[[str], str]] = {
    "qwen": lambda p: to_fp8(write_checkpoint(p, dict(moe_intermediate_size=160)), QWEN_QUANT),
    "qwen_b": lambda p: to_fp8(write_checkpoint(p, dict(moe_intermediate_size=160), seed=3), QWEN_QUANT),
    "deepseek": lambda p: to_fp8(write_deepseek_checkpoint(p, 3, dict(intermediate_size=160,
                                                                     moe_intermediate_size=144)), DEEPSEEK_QUANT),
}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], str]:
    """By name: MAKERS' FP8 checkpoints, and "<name>_deq" each one's dequantized twin."""
    root = tmp_path_factory.mktemp("fp8")
    paths: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in paths:
            path = str(root / name)
            packed = name.removesuffix("_deq")
            paths[name] = write_dequantized(path, get(packed)) if packed != name else MAKERS[name](path)
        return paths[name]

    return get


def broken_copy(ckpt: Callable[[str], str], tmp_path: Any, name: str,
                edit: Callable[[dict[str, torch.Tensor]], None]) -> str:
    path = str(tmp_path / "broken")
    shutil.copytree(ckpt(name), path)
    tensors = saved_tensors(path)
    edit(tensors)
    save_file(tensors, os.path.join(path, WEIGHTS), metadata={"format": "pt"})
    return path


# ---------------------------------------------------------------------------------------------------------------
# The checkpoint as the loader reads it
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,weights,kept", [
    ("qwen", (QWEN_EXPERT, QWEN_DOWN), (QWEN_KEPT, "lm_head.weight", "model.layers.1.mlp.gate.weight",
                                        "model.norm.weight")),
    ("deepseek", (DS_KV_A, DS_DENSE, DS_SHARED), ("model.layers.1.mlp.gate.weight", "model.embed_tokens.weight",
                                                   "model.layers.1.self_attn.kv_a_layernorm.weight")),
])
def test_a_weight_is_served_by_name_as_transformers_dequantizes_it(ckpt: Callable[[str], str], name: str,
                                                                   weights: tuple[str, ...],
                                                                   kept: tuple[str, ...]) -> None:
    """Each quantized weight by its float name, in the asked dtype: transformers' block dequantization bit for bit
    (the ragged edge blocks included); what the checkpoint left in bf16 as stored, its bytes unchanged."""
    c, raw = Checkpoint(ckpt(name)), saved_tensors(ckpt(name))
    assert c.packing is not None and c.packing.method == "fp8"
    for w in weights:
        scale = raw[w + "_scale_inv"]
        assert scale.shape[0] * BLOCK != raw[w].shape[0] or scale.shape[1] * BLOCK != raw[w].shape[1]  # ragged
        assert c.packed(w) == (w, w + "_scale_inv")
        for dtype in (torch.float32, torch.bfloat16):
            got = c.get(w, tuple(raw[w].shape), dtype)
            assert got.dtype == dtype and torch.equal(got, hf_dequantize(raw[w], scale, dtype))
    for k in kept:
        assert raw[k].dtype == torch.bfloat16 and c.packed(k) is None
        assert torch.equal(c.get(k, tuple(raw[k].shape)), raw[k])


def test_transformers_loader_reads_a_weight_of_one_block_alike(ckpt: Callable[[str], str]) -> None:
    """transformers' own FP8 loader (it dequantizes on the CPU) reads every attention weight of one block, and the
    one left in bf16, as the engine does; a ragged expert weight it misreads (it derives the block from the scales'
    grid, 160 columns in 2 scales: blocks of 80, no release's layout): why the oracle is finegrained_fp8's block
    dequantization, which keeps 128."""
    from transformers import AutoModelForCausalLM

    theirs = AutoModelForCausalLM.from_pretrained(ckpt("qwen"), dtype=torch.float32).state_dict()
    c, raw = Checkpoint(ckpt("qwen")), saved_tensors(ckpt("qwen"))
    for n in [f"model.layers.{i}.self_attn.{p}_proj.weight" for i in (0, 2) for p in "qkvo"]:
        assert torch.equal(theirs[n], c.get(n, tuple(raw[n].shape))), n
    assert not torch.equal(theirs["model.layers.0.mlp.experts.down_proj"][5], c.get(QWEN_DOWN, (64, 160)))


@pytest.mark.parametrize("name", ["qwen", "deepseek"])
def test_the_checks_read_the_pieces_for_their_names(ckpt: Callable[[str], str], name: str,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    """The front end's checks take each weight and its scales for the weight's name: the config parses, the
    checkpoint passes, and no scales are listed as a tensor nothing reads."""
    path = ckpt(name)
    cfg = model_config(hf_config_of(path))
    with caplog.at_level("WARNING", logger="moebius"):
        check_checkpoint(Checkpoint(path), cfg, cfg.num_layers)
    assert not [r for r in caplog.records if "no Moebius weight reads" in r.getMessage()]


def _swap(piece: str, make: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[dict[str, torch.Tensor]], None]:
    """An edit of a checkpoint's tensors: `piece` replaced by make(piece)."""
    return lambda t: t.update({piece: make(t[piece])})


# (id, checkpoint, how it is broken, the weight it breaks and its shape, what the message must say)
BROKEN: list[tuple[str, str, Callable[[dict[str, torch.Tensor]], None], str, tuple[int, int], str]] = [
    ("missing-scales", "qwen", lambda t: t.pop(QWEN_EXPERT + "_scale_inv"), QWEN_EXPERT, (160, 64),
     rf"missing tensor {re.escape(QWEN_EXPERT)}_scale_inv \(one of the fp8 pieces \({re.escape(QWEN_EXPERT)}, "
     rf"{re.escape(QWEN_EXPERT)}_scale_inv\) of {re.escape(QWEN_EXPERT)}, \(160, 64\)\)"),
    ("scales-of-a-wrong-shape", "qwen", _swap(QWEN_DOWN + "_scale_inv", lambda s: s[:, :1].clone()),
     QWEN_DOWN, (64, 160),
     rf"tensor {re.escape(QWEN_DOWN)}_scale_inv in '.*' has shape \(1, 1\), expected \(1, 2\) \(the fp8 pieces"),
    ("scales-not-float32", "deepseek", _swap(DS_KV_A + "_scale_inv", lambda s: s.bfloat16()), DS_KV_A,
     (40, 64), rf"tensor {re.escape(DS_KV_A)}_scale_inv in '.*' is stored as BF16, expected F32"),
    ("weight-not-float8", "deepseek", _swap(DS_DENSE, lambda w: w.bfloat16()), DS_DENSE, (64, 160),
     rf"tensor {re.escape(DS_DENSE)} in '.*' is stored as BF16, expected F8_E4M3"),
]


@pytest.mark.parametrize("name,edit,weight,shape,pattern", [pytest.param(*b[1:], id=b[0]) for b in BROKEN])
def test_a_broken_fp8_checkpoint_is_refused_naming_the_tensor(ckpt: Callable[[str], str], tmp_path: Any, name: str,
                                                              edit: Callable[[dict[str, torch.Tensor]], None],
                                                              weight: str, shape: tuple[int, int],
                                                              pattern: str) -> None:
    """At start-up (the front end's checks, before any rank) and on a rank's own read of the checkpoint."""
    path = broken_copy(ckpt, tmp_path, name, edit)
    with pytest.raises(ConfigError, match=pattern):
        LLM(model=path, **ENGINE_KW)
    with pytest.raises((ConfigError, KeyError), match=re.escape(weight)):
        Checkpoint(path).get(weight, shape)


@pytest.mark.parametrize("quant,arch,named", [
    (DEEPSEEK_QUANT, "GptOssForCausalLM", r"quant_method 'fp8', weight_block_size \[128, 128\]\): a quantized "
     r"checkpoint, and Moebius reads no such one for \['GptOssForCausalLM'\] \(it reads fp8 for Qwen3MoeForCausalLM, "
     r"DeepseekV3ForCausalLM, DeepseekV2ForCausalLM; mxfp4 for GptOssForCausalLM\)"),
    ({"quant_method": "awq", "bits": 4}, "Qwen3MoeForCausalLM", r"quant_method 'awq'\): a quantized checkpoint, and "
     r"Moebius reads no such one for \['Qwen3MoeForCausalLM'\]"),
    ({"quant_method": "mxfp4"}, "DeepseekV3ForCausalLM", r"quant_method 'mxfp4'\): a quantized checkpoint"),
    ({**QWEN_QUANT, "weight_block_size": [64, 64]}, "Qwen3MoeForCausalLM",
     r"weight_block_size \[64, 64\]: Moebius reads block FP8 with weight_block_size \[128, 128\] only"),
    ({**DEEPSEEK_QUANT, "fmt": "e5m2"}, "DeepseekV3ForCausalLM", r"fmt 'e5m2': Moebius reads block FP8 of fmt 'e4m3'"),
    ({**DEEPSEEK_QUANT, "weight_block_size": None}, "DeepseekV3ForCausalLM", r"weight_block_size None: Moebius reads"),
])
def test_fp8_elsewhere_another_method_or_block_is_refused(quant: dict[str, Any], arch: str, named: str) -> None:
    """FP8 is read for Qwen3-MoE and DeepSeek only, in the releases' 128 x 128 e4m3 blocks; the message names the
    method (or the setting) and the architecture."""
    with pytest.raises(ConfigError, match=r"config\.json has a quantization_config .*" + named):
        check_quantization({"architectures": [arch], "quantization_config": quant}, "config.json", None)
    for arch, ok in (("Qwen3MoeForCausalLM", QWEN_QUANT), ("DeepseekV3ForCausalLM", DEEPSEEK_QUANT),
                     ("DeepseekV2ForCausalLM", DEEPSEEK_QUANT)):
        check_quantization({"architectures": [arch], "quantization_config": ok}, "config.json", None)


def test_an_update_by_name_checks_the_pair(ckpt: Callable[[str], str]) -> None:
    """A float8 weight comes with its scales (kept as given), each of its shape and dtype, never one without the
    other, never as a float tensor beside scales; a float tensor alone is still a plain update."""
    cfg = model_config(_config(ckpt("qwen_deq")))
    raw = saved_tensors(ckpt("qwen_b"))
    pair = {n: raw[n] for n in (QWEN_DOWN, QWEN_DOWN + "_scale_inv")}
    out = check_update(cfg, pair)
    assert out.keys() == pair.keys() and out[QWEN_DOWN].dtype == torch.float8_e4m3fn
    assert check_update(cfg, {QWEN_DOWN: torch.zeros(64, 160)}).keys() == {QWEN_DOWN}
    with pytest.raises(ValueError, match=rf"tensor {re.escape(QWEN_DOWN)} is torch.float8_e4m3fn, float8 .*: an update "
                                         r"takes float32, .* tensors, or as fp8 pieces, all of .*: "
                                         rf"{re.escape(QWEN_DOWN)}_scale_inv is missing"):
        check_update(cfg, {QWEN_DOWN: raw[QWEN_DOWN]})
    with pytest.raises(ValueError, match=rf"tensor {re.escape(QWEN_DOWN)} is missing: {re.escape(QWEN_DOWN)} given as "
                                         r"fp8 pieces needs all of"):
        check_update(cfg, {QWEN_DOWN + "_scale_inv": pair[QWEN_DOWN + "_scale_inv"]})
    with pytest.raises(ValueError, match=rf"tensor {re.escape(QWEN_DOWN)}_scale_inv has shape \(1, 1\); as the fp8 "
                                         r"piece of the model's .* \(64, 160\) it is \(1, 2\)"):
        check_update(cfg, {**pair, QWEN_DOWN + "_scale_inv": torch.ones(1, 1)})
    with pytest.raises(ValueError, match=rf"tensor {re.escape(QWEN_DOWN)} is torch.float32; as the fp8 piece"):
        check_update(cfg, {**pair, QWEN_DOWN: pair[QWEN_DOWN].float()})


# ---------------------------------------------------------------------------------------------------------------
# Served: transformers' tokens on its dequantized model, and an update of a float8 weight with its scales
# ---------------------------------------------------------------------------------------------------------------

PROMPTS = {"qwen": QWEN_PROMPTS[:4], "deepseek": random_prompts(7, (1, 5, 9, 17))}
ENGINES = [("qwen", 1, "tp"), ("qwen", 2, "ep"), ("deepseek", 1, "ep"), ("deepseek", 2, "tp")]


@pytest.fixture(scope="module", params=ENGINES, ids=[f"{n}-P{p}-{m}" for n, p, m in ENGINES])
def engine(request: pytest.FixtureRequest, ckpt: Callable[[str], str]) -> Iterator[tuple[str, int, LLM]]:
    name, P, mode = request.param
    with LLM(model=ckpt(name), num_ranks=P, mode=mode, **ENGINE_KW) as llm:
        yield name, P, llm


def test_greedy_equals_transformers_on_the_dequantized_model(engine: tuple[str, int, LLM],
                                                             ckpt: Callable[[str], str]) -> None:
    """The FP8 checkpoint served in its start layout, then the other after a switch: the greedy tokens of
    transformers' model on the weights transformers dequantizes."""
    name, _, llm = engine
    parity_across_switch(llm, ckpt(name + "_deq"), PROMPTS[name], N_OUT, back=False)


def test_an_update_takes_a_float8_weight_and_its_scales(engine: tuple[str, int, LLM],
                                                       ckpt: Callable[[str], str], tmp_path: Any) -> None:
    """On Qwen3 at P = 2: an update by name of float8 weights with their scales (an expert's down_proj, an attention
    projection, from the other checkpoint) gives the tokens of transformers' dequantized model with those two
    replaced, in both layouts; an update from the other FP8 checkpoint on disk, its dequantized model's tokens."""
    name, P, llm = engine
    if (name, P) != ("qwen", 2):
        pytest.skip("the update runs on Qwen3's P = 2 engine (TP and EP)")
    replaced = (QWEN_DOWN, "model.layers.1.self_attn.o_proj.weight")
    raw_b = saved_tensors(ckpt("qwen_b"))
    mixed = str(tmp_path / "mixed")
    shutil.copytree(ckpt("qwen_deq"), mixed)
    deq = saved_tensors(mixed)
    deq.update({n: hf_dequantize(raw_b[n], raw_b[n + "_scale_inv"], torch.float32) for n in replaced})
    save_file(deq, os.path.join(mixed, WEIGHTS), metadata={"format": "pt"})
    prompts = PROMPTS["qwen"][1:3]
    tokens = {path: [hf_greedy(path, p, N_OUT) for p in prompts] for path in (ckpt("qwen_deq"), mixed,
                                                                               ckpt("qwen_b_deq"))}
    assert len({tuple(map(tuple, t)) for t in tokens.values()}) == 3  # each update changes tokens
    assert llm.update_weights([(n + s, raw_b[n + s]) for n in replaced for s in ("", "_scale_inv")]).done
    parity_across_switch(llm, mixed, prompts, N_OUT, back=False)
    assert llm.update_weights_from_disk(ckpt("qwen_b")).done
    parity_across_switch(llm, ckpt("qwen_b_deq"), prompts, N_OUT, back=False)


def test_a_bfloat16_engine_dequantizes_straight_to_bfloat16(ckpt: Callable[[str], str],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The load dequantizes each quantized weight once, to the engine's dtype (no float32 copy kept), and serves."""
    from moebius.models.fp8_blocks import BlockFp8Packing

    seen = unpacked_dtypes(BlockFp8Packing, ckpt("qwen"), PROMPTS["qwen"][0], monkeypatch)
    # 3 layers: 8 experts' 3 projections and 4 attention projections, but layer 2's q_proj (left in bf16)
    assert seen == [torch.bfloat16] * (3 * (8 * 3 + 4) - 1)


def test_served_without_quantization_the_load_says_how_to_keep_it(ckpt: Callable[[str], str],
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """A block-FP8 checkpoint served without --quantization is dequantized at load: a warning says so and names the
    flag that keeps it as stored (vLLM keeps it by default); with the flag, or for a float checkpoint, no warning."""
    from moebius.config import EngineConfig
    from moebius.models.source import resolve_model

    def warned(**kw: Any) -> list[str]:
        caplog.clear()
        with caplog.at_level("WARNING", logger="moebius"):
            resolve_model(EngineConfig(**kw))
        return [r.getMessage() for r in caplog.records if "dequantized at load" in r.getMessage()]

    (said,) = warned(model=ckpt("qwen"))
    assert "stored in fp8" in said and "--quantization fp8 keeps it" in said
    assert warned(model=ckpt("qwen"), quantization="fp8") == []
    assert warned(model=ckpt("qwen_deq")) == []
