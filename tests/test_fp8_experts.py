"""--quantization fp8: the routed experts held in block FP8 in their layer slots, as FP8 rows (kernels/fp8_rows.py:
each row its 128-column chunks, each chunk's float32 block scale beside its 128 float8 bytes), on the CPU; so are
the dense Linear weights (q|k|v, o_proj, dense and shared MLPs) where every rank's columns are whole chunks and the
checkpoint quantizes them (`specs.linear_spec`).

The oracle is transformers' own forward on the dequantized model: the FP8 path dequantizes an expert's rows, then
runs the float math, so in float32 its greedy tokens are transformers' on the weights dequantized by blocks (no
tolerance: the same products rounded the same way). A released block-FP8 checkpoint keeps its float8 values and
scales exactly; a float checkpoint is quantized at load (each 128 x 128 block's largest magnitude at 448), and its
oracle is the model with the experts quantized and dequantized here. Checked in TP and EP over P in {1, 2, 4}, across
switches (the switch moves FP8 rows as bytes), through weight updates (float8 with scales, or float quantized on the
way in), and the refusals: a TP cut inside a scale block, the GPU, a family whose experts have their own format.

Checkpoints: a tiny Qwen3MoeForCausalLM with moe_intermediate_size 512 (four 128-row blocks: TP 4 cuts whole
blocks; hidden 64, one ragged 128-column block) in the released FP8 format (test_fp8_checkpoints.py's writer), its
dequantized twin, and its float original; a tiny DeepseekV3ForCausalLM in its release's FP8 format.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from conftest import PROMPTS, write_checkpoint, write_deepseek_checkpoint
from family_cases import (
    ENGINE_KW,
    gpu_quantized_agreement,
    greedy_outputs,
    hf_greedy,
    lazy_checkpoints,
    parity_across_switch,
    random_prompts,
    saved_tensors,
    serve,
    stress_jobs,
    switch_stress,
)
from family_cases import hf_config as _config
from safetensors.torch import save_file
from test_fp8_checkpoints import DEEPSEEK_QUANT, QWEN_QUANT, WEIGHTS, hf_dequantize, to_fp8, write_dequantized

from moebius import LLM, SamplingParams
from moebius.config import ConfigError
from moebius.kernels.fp8_rows import column_block, pack_rows, packed_width, segment_chunks, unpack_rows
from moebius.models.registry import model_config

N_OUT = 8
INTER = 512
FP8 = dict(ENGINE_KW, quantization="fp8")
EXPERT = "model.layers.1.mlp.experts.6.down_proj.weight"  # [64, 512]: scales [1, 4]
EXPERT_UP = "model.layers.0.mlp.experts.2.up_proj.weight"  # [512, 64]: scales [4, 1]


def _quantized_at_p2(name: str) -> bool:
    """What --quantization fp8 quantizes of this tiny Qwen3 on two ranks: the routed experts and q, k, v (cut by
    rows); not o_proj, whose 64 columns TP cuts into 32 a rank (inside a 128-column chunk), nor the router."""
    return ".mlp.experts." in name or name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight"))


def write_requantized(path: str, float_ckpt: str) -> str:
    """The float checkpoint with every weight --quantization fp8 quantizes on two ranks quantized by 128 x 128
    blocks (`pack_rows`) and dequantized again (`unpack_rows`), in float32: the model that engine serves."""
    shutil.copytree(float_ckpt, path)
    tensors = saved_tensors(path)
    out = {n: unpack_rows(pack_rows(t.float()), t.shape[1], torch.float32).contiguous() if _quantized_at_p2(n)
           else t for n, t in tensors.items()}
    save_file(out, os.path.join(path, WEIGHTS), metadata={"format": "pt"})
    return path


MAKERS: dict[str, Callable[[str, Callable[[str], str]], str]] = {
    "float": lambda p, get: write_checkpoint(p, dict(moe_intermediate_size=INTER)),
    "float_b": lambda p, get: write_checkpoint(p, dict(moe_intermediate_size=INTER), seed=3),
    "fp8": lambda p, get: to_fp8(shutil.copytree(get("float"), p), QWEN_QUANT),
    "fp8_b": lambda p, get: to_fp8(shutil.copytree(get("float_b"), p), QWEN_QUANT),
    "fp8_deq": lambda p, get: write_dequantized(p, get("fp8")),
    "fp8_b_deq": lambda p, get: write_dequantized(p, get("fp8_b")),
    "float_q": lambda p, get: write_requantized(p, get("float")),
    "deepseek": lambda p, get: to_fp8(write_deepseek_checkpoint(p, 3, dict(intermediate_size=160,
                                                                          moe_intermediate_size=144)), DEEPSEEK_QUANT),
    "deepseek_deq": lambda p, get: write_dequantized(p, get("deepseek")),
}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], str]:
    return lazy_checkpoints(tmp_path_factory.mktemp("fp8_experts"), MAKERS)


# ---------------------------------------------------------------------------------------------------------------
# FP8 rows
# ---------------------------------------------------------------------------------------------------------------

def test_fp8_rows_keep_a_checkpoints_blocks_and_carry_their_scales_through_a_cut() -> None:
    """A released weight's dequantized values with its scales come back as the same float8 values and scales, and
    unpack to transformers' dequantization bit for bit (float32 and bf16, ragged edge blocks); a row cut at whole
    chunks (TP's cut of down's columns) unpacks to the same cut of the weight."""
    from test_fp8_checkpoints import quantize

    g = torch.Generator().manual_seed(0)
    w = torch.randn(200, 300, generator=g) * 0.05
    q, scale = quantize(w)
    for dtype in (torch.float32, torch.bfloat16):
        deq = hf_dequantize(q, scale, dtype)
        rows = pack_rows(deq, scale)
        assert rows.dtype == torch.uint8 and rows.shape == (200, packed_width(300)) == (200, 3 * 144)
        assert torch.equal(unpack_rows(rows, 300, dtype), deq)
        assert torch.equal(rows.unflatten(-1, (3, 144))[..., :128].reshape(200, 384)[:, :300].view(
            torch.float8_e4m3fn).float(), q.float())
        # one segment (a row no layout cuts by columns): the values, then the 3 scales, then zeros to 16 bytes
        whole = pack_rows(deq, scale, whole=True)
        assert whole.shape == (200, packed_width(300, True)) == (200, 400) and segment_chunks(400, 300) == 3
        assert torch.equal(unpack_rows(whole, 300, dtype), deq)
        assert torch.equal(whole[:, :300].view(torch.float8_e4m3fn).float(), q.float())
        assert torch.equal(whole[:, 384:396].contiguous().view(torch.float32), rows.unflatten(-1, (3, 144))[
            ..., 128:132].contiguous().view(torch.float32).squeeze(-1))
    rows = pack_rows(torch.randn(64, 512, generator=g))
    half = rows.unflatten(1, (2, -1))[:, 1]  # TP 2's second shard: 2 of the 4 chunks
    assert torch.equal(unpack_rows(half, 256, torch.float32), unpack_rows(rows, 512, torch.float32)[:, 256:])
    assert torch.equal(column_block(rows, 256, 512), half)  # o_proj's cut by heads
    with pytest.raises(ValueError, match="whole 128-column chunks, not at column 64"):
        column_block(rows, 64, 128)


@pytest.mark.parametrize("whole", [True, False], ids=["whole", "chunks"])
def test_expert_rows_hold_one_scale_over_each_128_row_block_of_gate_up_and_down(whole: bool) -> None:
    """The fused MoE reads one block scale a weight tile (`linear.tile_scale`: tiles of at most 128 rows at a multiple
    of their height in an expert's gate rows, its up rows or its down rows). That holds because the experts' rows are
    quantized gate and up apart, each in 128-row blocks from its own first row (`fp8_rows_fetch`): with 192
    intermediate rows (a ragged second block in each half) the up rows' blocks start at row 192, not at 256."""
    from moebius.kernels.fp8_rows import BLOCK, _parts
    from moebius.models.fp8_blocks import fp8_rows_fetch

    E, I, D = 2, 192, 256
    g = torch.Generator().manual_seed(0)
    w = {"w13": torch.randn(E, 2 * I, D, generator=g) * torch.rand(E, 2 * I, 1, generator=g),
         "w2": torch.randn(E, D, I, generator=g) * torch.rand(E, D, 1, generator=g)}
    for name, starts in (("w13", (0, I)), ("w2", (0,))):
        rows = fp8_rows_fetch(lambda n, shape: w[n], gate_up=name == "w13", whole=whole)(name, w[name].shape)
        cols = w[name].shape[-1]
        scales = _parts(rows, -(-cols // BLOCK[1]), whole)[1].contiguous().view(torch.float32)[..., 0]
        height = w[name].shape[1] // len(starts)
        for start in starts:
            for b0 in range(0, height, BLOCK[0]):
                block = scales[:, start + b0: start + min(b0 + BLOCK[0], height)]
                assert torch.equal(block, block[:, :1].expand_as(block)), (name, start, b0)
        if name == "w13":  # gate's last block and up's first are blocks of their own
            assert not torch.equal(scales[:, I - 1], scales[:, I])


# ---------------------------------------------------------------------------------------------------------------
# Served in FP8: transformers' tokens on the dequantized model in every layout, across switches
# ---------------------------------------------------------------------------------------------------------------

ENGINES = [(1, "tp"), (2, "ep"), (2, "tp"), (4, "tp"), (4, "ep")]
STRESSED = (2, "tp")  # the switch stress's engine (the others switch alike)


@pytest.fixture(scope="module", params=ENGINES, ids=[f"P{p}-{m}" for p, m in ENGINES])
def engine(request: pytest.FixtureRequest, ckpt: Callable[[str], str]) -> Iterator[tuple[tuple[int, str], LLM]]:
    for _, _, llm in serve(ckpt("fp8"), *request.param, FP8):
        yield request.param, llm


def test_greedy_equals_transformers_on_the_dequantized_model(engine: tuple[tuple[int, str], LLM],
                                                             ckpt: Callable[[str], str]) -> None:
    """Each engine in its start layout, then the other after a switch, and back."""
    _, llm = engine
    parity_across_switch(llm, ckpt("fp8_deq"), PROMPTS[:4], N_OUT)


def test_live_switches_change_no_token(engine: tuple[tuple[int, str], LLM], ckpt: Callable[[str], str]) -> None:
    which, llm = engine
    if which != STRESSED:
        pytest.skip("the switch stress runs on the P = 2 TP engine (the others switch alike)")
    switch_stress(llm, ckpt("fp8_deq"), stress_jobs(PROMPTS, aborted_tokens=8))


def test_the_slots_hold_fp8_rows_at_about_half_the_bytes(ckpt: Callable[[str], str]) -> None:
    """On one rank: each MoE layer's experts are uint8 FP8 rows in the slot (their scales inside), every row one
    segment (no TP over ranks cuts down's columns): 132 bytes a chunk of 128 values and the row's padding to 16
    (about 0.52 of bf16's bytes; this model's 64 columns pad to one chunk, 144 bytes); so are the attention's
    projections, but what the checkpoint leaves unquantized."""
    with LLM(model=ckpt("fp8"), **FP8) as llm:
        rank = llm.engine.ranks.rank
        for m, rt in rank.modes.items():
            lay = rt.layout
            for i, lw in enumerate(rt.weights.layers):
                assert lw.mlp.w13_EFD.dtype == lw.mlp.w2_EDF.dtype == torch.uint8, m
                assert lw.mlp.w13_EFD.shape[1:] == (2 * lay.moe_inter, packed_width(64, True))
                # the attention's projections too, but layer 2's q|k|v: its q_proj is left in bf16 by the
                # checkpoint (modules_to_not_convert)
                assert lw.attn.qkv_QD.dtype == (torch.float32 if i == 2 else torch.uint8)
                assert lw.attn.o_DQ.dtype == torch.uint8
            assert lay.expert_bytes(1) == lay.num_local_experts * (2 * INTER * 144 + 64 * 4 * 132)  # (down: 528)
            assert lw.mlp.w2_EDF.shape[1:] == (64, packed_width(INTER, True)) == (64, 4 * 132)


def test_a_memory_release_keeps_the_fp8_rows_and_a_dropped_one_takes_an_update(ckpt: Callable[[str], str]) -> None:
    """Weights released and resumed (kept in host memory): the same tokens (the slots' FP8 rows, scales inside,
    come back byte for byte); released without keeping them, an update from the FP8 checkpoint on disk restores
    them."""
    want = [hf_greedy(ckpt("fp8_deq"), tuple(p), N_OUT) for p in PROMPTS[:2]]
    with LLM(model=ckpt("fp8"), **FP8) as llm:
        assert greedy_outputs(llm, PROMPTS[:2], N_OUT) == want
        for keep in (True, False):
            assert llm.release_memory_occupation(["weights"], keep_weights=keep).done
            assert llm.resume_memory_occupation(["weights"]).done
            if not keep:
                assert llm.update_weights_from_disk(ckpt("fp8")).done
            assert greedy_outputs(llm, PROMPTS[:2], N_OUT) == want


def test_deepseek_experts_in_fp8(ckpt: Callable[[str], str]) -> None:
    """DeepSeek-V3's FP8 release format on one rank (experts of 144 rows: one ragged block, whole on a rank): its
    routed experts, its dense first layer, its shared experts and MLA's projections held as FP8 rows (kv_b_proj
    dequantized: the absorbed form folds it per head), transformers' tokens on the dequantized model in TP, then in EP
    after a switch."""
    prompts = random_prompts(7, (1, 5, 9, 17))
    with LLM(model=ckpt("deepseek"), **FP8) as llm:
        rank = llm.engine.ranks.rank
        dense, *moe = [lw.mlp for lw in rank.modes[rank.mode].weights.layers]
        assert dense.w13_FD.dtype == dense.w2_DF.dtype == torch.uint8
        assert all(m.w13_EFD.dtype == m.shared.w13_FD.dtype == torch.uint8 for m in moe)
        attn = [lw.attn for lw in rank.modes[rank.mode].weights.layers]
        assert all(w.dtype == torch.uint8 for a in attn for w in (a.qkv_QD, a.q_QL, a.kv_a_AD, a.o_DO))
        assert all(a.kv_b_UC.dtype == torch.float32 for a in attn)
        parity_across_switch(llm, ckpt("deepseek_deq"), prompts, N_OUT, back=False)


def test_deepseek_with_the_experts_scope_holds_its_dense_weights_in_the_dtype(ckpt: Callable[[str], str]) -> None:
    """DeepSeek-V3's FP8 release with --quantization-scope experts on one rank: the routed experts FP8 rows; the
    dense first layer, the shared experts and MLA's projections in the dtype; transformers' tokens on the
    dequantized model."""
    with LLM(model=ckpt("deepseek"), quantization_scope="experts", **FP8) as llm:
        rank = llm.engine.ranks.rank
        dense, *moe = [lw.mlp for lw in rank.modes[rank.mode].weights.layers]
        assert dense.w13_FD.dtype == dense.w2_DF.dtype == torch.float32
        assert all(m.w13_EFD.dtype == m.w2_EDF.dtype == torch.uint8 for m in moe)
        assert all(m.shared.w13_FD.dtype == m.shared.w2_DF.dtype == torch.float32 for m in moe)
        attn = [lw.attn for lw in rank.modes[rank.mode].weights.layers]
        assert all(w.dtype == torch.float32 for a in attn for w in (a.qkv_QD, a.q_QL, a.kv_a_AD, a.o_DO))
        assert greedy_outputs(llm, random_prompts(7, (1, 9)), N_OUT) == [
            hf_greedy(ckpt("deepseek_deq"), tuple(p), N_OUT) for p in random_prompts(7, (1, 9))]


def test_a_float_checkpoint_is_quantized_at_load(ckpt: Callable[[str], str]) -> None:
    """--quantization fp8 on a float checkpoint: the tokens of transformers' model whose experts and q|k|v were
    quantized by blocks and dequantized (float32, every layout over P = 2, across a switch); without the flag, the
    float model's, which differ (the quantization changes tokens)."""
    want = [hf_greedy(ckpt("float_q"), tuple(p), N_OUT) for p in PROMPTS[:4]]
    assert want != [hf_greedy(ckpt("float"), tuple(p), N_OUT) for p in PROMPTS[:4]]
    for _, _, llm in serve(ckpt("float"), 2, "ep", FP8):
        parity_across_switch(llm, ckpt("float_q"), PROMPTS[:4], N_OUT)


def test_updates_take_float8_with_scales_or_float_quantized_on_the_way_in(ckpt: Callable[[str], str],
                                                                         tmp_path: Any) -> None:
    """At P = 2 in TP, then EP: an update by name of a float8 expert weight with its scales (the other checkpoint's)
    keeps its float8 values exactly; a float expert weight is quantized by blocks as it lands; the tokens are
    transformers' on the dequantized model with those replaced. An update from the other FP8 checkpoint on disk
    gives its dequantized model's tokens."""
    raw_b = saved_tensors(ckpt("fp8_b"))
    float_b = saved_tensors(ckpt("float_b"))
    mixed = str(tmp_path / "mixed")
    shutil.copytree(ckpt("fp8_deq"), mixed)
    deq = saved_tensors(mixed)
    deq[EXPERT] = hf_dequantize(raw_b[EXPERT], raw_b[EXPERT + "_scale_inv"], torch.float32)
    up = float_b[EXPERT_UP].float()
    deq[EXPERT_UP] = unpack_rows(pack_rows(up), up.shape[1], torch.float32).contiguous()
    save_file(deq, os.path.join(mixed, WEIGHTS), metadata={"format": "pt"})
    prompts = PROMPTS[1:4]
    before = [hf_greedy(ckpt("fp8_deq"), tuple(p), N_OUT) for p in prompts]
    assert before != [hf_greedy(mixed, tuple(p), N_OUT) for p in prompts]  # the update changes tokens
    with LLM(model=ckpt("fp8"), num_ranks=2, mode="tp", **FP8) as llm:
        assert llm.update_weights([(EXPERT, raw_b[EXPERT]), (EXPERT + "_scale_inv", raw_b[EXPERT + "_scale_inv"]),
                                   (EXPERT_UP, float_b[EXPERT_UP])]).done
        parity_across_switch(llm, mixed, prompts, N_OUT, back=False)
        assert llm.update_weights_from_disk(ckpt("fp8_b")).done
        parity_across_switch(llm, ckpt("fp8_b_deq"), prompts, N_OUT, back=False)


def test_the_experts_scope_holds_the_dense_weights_in_the_dtype(ckpt: Callable[[str], str], tmp_path: Any) -> None:
    """--quantization-scope experts: the routed experts as FP8 rows, the attention's projections in the dtype (the
    checkpoint's float8 blocks dequantized at load: the values FP8 rows unpack to), so transformers' tokens on the
    dequantized model, in TP then EP after a switch; an update of an attention projection as float8 with its scales
    lands dequantized (transformers' tokens with it replaced)."""
    o_proj = "model.layers.1.self_attn.o_proj.weight"
    raw_b = saved_tensors(ckpt("fp8_b"))
    mixed = str(tmp_path / "mixed")
    shutil.copytree(ckpt("fp8_deq"), mixed)
    deq = saved_tensors(mixed)
    deq[o_proj] = hf_dequantize(raw_b[o_proj], raw_b[o_proj + "_scale_inv"], torch.float32)
    save_file(deq, os.path.join(mixed, WEIGHTS), metadata={"format": "pt"})
    prompts = PROMPTS[1:3]
    assert ([hf_greedy(ckpt("fp8_deq"), tuple(p), N_OUT) for p in prompts]
            != [hf_greedy(mixed, tuple(p), N_OUT) for p in prompts])  # the update changes tokens
    with LLM(model=ckpt("fp8"), quantization_scope="experts", **FP8) as llm:
        for rt in llm.engine.ranks.rank.modes.values():
            for lw in rt.weights.layers:
                assert lw.mlp.w13_EFD.dtype == lw.mlp.w2_EDF.dtype == torch.uint8
                assert lw.attn.qkv_QD.dtype == lw.attn.o_DQ.dtype == torch.float32
        parity_across_switch(llm, ckpt("fp8_deq"), PROMPTS[:3], N_OUT, back=False)
        assert llm.update_weights([(o_proj, raw_b[o_proj]), (o_proj + "_scale_inv", raw_b[o_proj + "_scale_inv"])]).done
        parity_across_switch(llm, mixed, prompts, N_OUT, back=False)


# ---------------------------------------------------------------------------------------------------------------
# Refusals
# ---------------------------------------------------------------------------------------------------------------

def test_a_quantization_scope_without_quantization_is_refused() -> None:
    from moebius.config import EngineConfig
    from moebius.models.source import resolve_model

    with pytest.raises(ConfigError, match=r"--quantization-scope experts needs --quantization"):
        resolve_model(EngineConfig(quantization_scope="experts"))


def test_o_proj_cut_by_heads_at_whole_chunks(ckpt: Callable[[str], str], tmp_path: Any) -> None:
    """head_dim 128, 4 heads, 2 ranks: TP cuts o_proj's 512 columns at whole 128-column chunks, so it is held in FP8
    in both layouts (`kernels.fp8_rows.column_block` takes each rank's chunks with their scales), where the tiny
    model's 64 columns stay in the dtype; transformers' tokens on the dequantized model in TP and after a switch to
    EP (where o_proj is whole)."""
    from moebius.models.registry import family_of
    from moebius.parallel.layout import Layout

    shape = dict(head_dim=128, moe_intermediate_size=256)
    path = to_fp8(write_checkpoint(str(tmp_path / "wide_heads"), shape, seed=1), QWEN_QUANT)
    deq = write_dequantized(str(tmp_path / "wide_heads_deq"), path)
    for ckpt_path, held in ((path, torch.uint8), (ckpt("fp8"), None)):  # (64 columns at P = 2: in the dtype)
        cfg = dataclasses.replace(model_config(_config(ckpt_path)), quantization="fp8")
        for mode in ("tp", "ep"):
            specs = family_of(cfg).weight_specs(cfg, Layout(cfg, mode, 1, 2), 4)
            assert {s.dtype for s in specs if ".o_proj." in s.name} == {held}, (ckpt_path, mode)
    with LLM(model=path, num_ranks=2, mode="tp", **FP8) as llm:
        parity_across_switch(llm, deq, PROMPTS[:3], N_OUT, back=False)


def test_a_tp_cut_inside_a_scale_block_is_refused_naming_the_sizes(tmp_path: Any) -> None:
    """moe_intermediate_size 384 (Qwen3-30B's 768 at TP 4 alike): TP over 2 ranks cuts 192 rows a rank, inside a
    128-row scale block: TP asked for is refused at start, naming the sizes and the layouts that serve it; EP alone
    serves (--mode ep holds it alone)."""
    path = to_fp8(write_checkpoint(str(tmp_path / "q384"), dict(moe_intermediate_size=384)), QWEN_QUANT)
    with pytest.raises(ConfigError, match=r"--quantization fp8 with TP over 2 ranks would cut each expert's "
                                          r"moe_intermediate_size 384 into 192 rows a rank, splitting its 128-row FP8 "
                                          r"scale blocks; EP keeps whole experts: serve it in EP alone "
                                          r"\(leave --mode unset, or --mode ep\)"):
        LLM(model=path, num_ranks=2, mode="tp", **FP8)
    with LLM(model=path, num_ranks=2, mode="ep", **FP8) as llm:
        assert llm.engine.held_layouts == ("ep",) and len(greedy_outputs(llm, PROMPTS[:2], 3)[1]) == 3


def test_experts_a_checkpoint_leaves_unquantized_are_refused(ckpt: Callable[[str], str], tmp_path: Any) -> None:
    """An FP8 checkpoint whose modules_to_not_convert names routed experts: --quantization fp8 would quantize what
    the checkpoint keeps in bf16, so it is refused, naming the module and the way out."""
    import json

    path = str(tmp_path / "experts_kept")
    shutil.copytree(ckpt("fp8"), path)
    hf = _config(path)
    hf["quantization_config"]["modules_to_not_convert"].append("model.layers.1.mlp.experts")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f)
    with pytest.raises(ConfigError, match=r"leaves model\.layers\.1\.mlp\.experts unquantized \(its "
                                          r"modules_to_not_convert\): serve it without --quantization"):
        LLM(model=path, **FP8)


def test_another_expert_format_is_refused(tmp_path: Any) -> None:
    """GPT-OSS serves no FP8 (its experts have their own format)."""
    from test_gpt_oss_family import write_gpt_oss_checkpoint

    gpt = write_gpt_oss_checkpoint(str(tmp_path / "gpt_oss"))
    with pytest.raises(ConfigError, match=r"--quantization fp8 is not served for the gpt_oss family "
                                          r"\(GptOssForCausalLM\)"):
        LLM(model=gpt, **FP8)


@pytest.mark.parametrize("preset,o_width", [("qwen3-30b-a3b", 32 * 128), ("deepseek-v2-lite", 16 * 128)])
def test_fp8_rows_are_whole_where_the_layout_keeps_whole_rows(preset: str, o_width: int) -> None:
    """At P = 2 the FP8 rows a layout keeps whole are one segment (kernels/fp8_rows.py), those it cuts by columns a
    segment a chunk: gate|up always; o_proj whole in EP, cut by heads in TP; the routed experts' down a segment a chunk
    in both (the switch moves TP's cuts of EP's rows as bytes). The regions' shapes are what the load writes."""
    from moebius.config import PRESETS
    from moebius.models.registry import family_of
    from moebius.parallel.layout import Layout

    cfg = dataclasses.replace(model_config(PRESETS[preset]), quantization="fp8")
    D, I = cfg.hidden_size, cfg.moe_intermediate_size
    for mode in ("ep", "tp"):
        lay = Layout(cfg, mode, 0, 2)
        specs = {s.name: s for s in family_of(cfg).weight_specs(cfg, lay, 2)}
        o = next(s for n, s in specs.items() if n.startswith("model.layers.1.") and "o_proj" in n)
        # (o_width: the heads' value columns, 32 of 128 and 16 of 128)
        assert o.dtype == torch.uint8 and o.shape[1] == packed_width(o_width // lay.tp, mode == "ep"), (mode, o.shape)
        w13, w2 = specs["model.layers.1.mlp.experts.w13"], specs["model.layers.1.mlp.experts.w2"]
        assert w13.shape[2] == packed_width(D, True) and w2.shape[2] == packed_width(I // lay.tp), (mode, w2.shape)


def test_the_floor_model_counts_fp8_rows_bytes() -> None:
    """Qwen3-30B-A3B's shapes with --quantization fp8: a decode step's routed-expert and attention weight bytes and a
    switch's weight bytes are the released format's, (1 + 4 / 128²) / 2 of bf16's (a byte a value and a float32 scale
    a 128 x 128 block; not the engine's rows', whose repeated scales and padding are its own cost), the rest (the
    cache, activations, lm_head) unchanged."""
    ratio = (1 + 4 / 128**2) / 2
    from moebius.bench.floor import decode_step_terms, switch_floor_ms
    from moebius.config import PRESETS

    bf16 = model_config(PRESETS["qwen3-30b-a3b"])
    fp8 = dataclasses.replace(bf16, quantization="fp8")
    for mode in ("tp", "ep"):
        a, b = decode_step_terms(bf16, 4, mode, 64, 1024), decode_step_terms(fp8, 4, mode, 64, 1024)
        scaled = ("experts_bytes", "weights_bytes", "shared_bytes")
        assert all(b[k] == pytest.approx(a[k] * ratio) for k in scaled)
        assert {k: v for k, v in a.items() if k.endswith("_bytes") and k not in (*scaled, "hbm_bytes")} == {
            k: v for k, v in b.items() if k.endswith("_bytes") and k not in (*scaled, "hbm_bytes")}
    assert switch_floor_ms(fp8, 4, 0) == pytest.approx(switch_floor_ms(bf16, 4, 0) * ratio)


def test_fp8_rows_launch_by_their_own_tables() -> None:
    """The fused MoE on FP8 rows picks its block shapes from FP8_CONFIGS (searched on FP8 rows: at prompt sizes
    bf16's 128-row TMA blocks took twice as long as 64-row ones; 128-row blocks without TMA from 64 pairs an expert)
    or in W8A8 W8A8_CONFIGS (64-row blocks), MXFP4 rows from MXFP4_CONFIGS (decode's 16-row blocks up to 24 pairs an
    expert, where CONFIGS takes 32-row ones), other experts from bf16's CONFIGS or their shape's own (SHAPE_CONFIGS);
    the projection's launch grows with the rows and keeps BT within a step's rows."""
    from moebius.kernels import fused_moe as fm
    from moebius.kernels import linear
    from moebius.kernels.rows import FORMATS

    D, I, E = 256, 128, 4
    w = torch.randn(E, 2 * I, D)
    assert fm.table_for(FORMATS["fp8"].rows_of(w), D) is fm.FP8_CONFIGS
    assert fm.table_for(FORMATS["fp8"].rows_of(w), D, act8=True) is fm.W8A8_CONFIGS
    assert fm.table_for(FORMATS["mxfp4"].rows_of(w), D) is fm.MXFP4_CONFIGS
    assert [fm.pick_config(p, fm.MXFP4_CONFIGS).BM for p in (2, 12, 16, 24, 25, 4096)] == [16, 16, 16, 16, 64, 128]
    assert fm.pick_config(16, fm.CONFIGS).BM == 32 and fm.MXFP4_CONFIGS[2:] == fm.CONFIGS[3:]
    assert fm.table_for(w.bfloat16(), D) is fm.CONFIGS
    # bf16 experts of GPT-OSS's shape on one rank: their own searched table (one 128-row block an expert from 48 pairs
    # an expert, half blocks), CONFIGS' at few pairs and prompt sizes; a TP shard of them CONFIGS
    gpt_oss = fm.table_for(torch.empty(32, 2 * 2880, 2880, dtype=torch.bfloat16, device="meta"), 2880)
    assert gpt_oss is fm.SHAPE_CONFIGS[(2880, 2880)] and gpt_oss[:3] == fm.CONFIGS[:3]
    assert [(c.BM, c.gate_up.halves) for c in (fm.pick_config(p, gpt_oss) for p in (32, 64, 128, 4096))] == [
        (64, False), (128, True), (128, True), (128, False)] and fm.pick_config(4096, gpt_oss) == fm.CONFIGS[-1][1]
    assert fm.table_for(torch.empty(32, 2880, 2880, dtype=torch.bfloat16, device="meta"), 2880) is fm.CONFIGS
    assert fm.table_for(FORMATS["mxfp4"].rows_of(torch.empty(4, 2 * 2880, 2880, device="meta")), 2880) is (
        fm.MXFP4_CONFIGS)
    # prompt sizes' unpacked experts: Qwen3-30B-A3B's 128 on one rank in one pass (in five 256 MiB passes its prompt
    # steps took longer, the host never waiting on the device), DeepSeek-V3's 32 a rank of EP 8 in two
    assert fm.unpack_share(128, 768, 2048, 2) == 128 and fm.unpack_share(32, 2048, 7168, 2) == 24
    prompt, short = (fm.config_for(tokens * 8, 128, 1, fm.FP8_CONFIGS) for tokens in (2048, 1024))
    assert (prompt.BM, short.BM) == (128, 64) and not prompt.gate_up.tma and fm.config_for(2048 * 8, 128).BM == 128
    assert fm.config_for(2048 * 8, 128, 1, fm.W8A8_CONFIGS).BM == 64
    for act8 in (False, True):
        launches = [linear.fp8_launch(T, 4096, act8) for T in (3, 8, 64, 256, 2048)]
        assert all(BT <= max(16, 1 << (T - 1).bit_length()) for T, (_, BT, *_) in zip((3, 8, 64, 256, 2048),
                                                                                        launches, strict=True))
        assert launches[-1][0] == 128 and launches[-1][4] == 1  # (prompt sizes: the tallest weight tiles, K whole)


@pytest.mark.gpu
@pytest.mark.parametrize("scope", ["all", "experts"])
def test_fp8_rows_on_the_gpu_agree_with_the_dequantized_model(ckpt: Callable[[str], str], scope: str) -> None:
    """On a GPU in bf16 (benchmarks/families_device_run.sh's `fp8tests` step): the fused MoE and the projections on
    FP8 rows in W8A16 (the default; with --quantization-scope experts the projections in bf16), through prompt and
    decode steps in both layouts, against the engine on the dequantized checkpoint position by position
    (`gpu_quantized_agreement`: the fused MoE's gate/up in decode's blocks multiplies the exact float8 values, where
    the dequantized checkpoint holds them rounded to bf16, and the K steps differ, so nearly every position, not
    all; counted on the free-running tokens at d7f68ec, 28 of 32 agreed, one flip carrying over the tokens after
    it). W8A8 rounds the activations to float8 too, which on this tiny random model's close logits moved most tokens
    (7 of 32 kept on an H100, free-running): its kernels are checked against their reference in test_gpu.py
    instead."""
    gpu_quantized_agreement(ckpt("fp8"), ckpt("fp8_deq"), "fp8", PROMPTS[:4], N_OUT, quantization_scope=scope)


@pytest.mark.parametrize("quant,ratio", [("fp8", (144, 256)), ("mxfp4", (17, 64))])
def test_a_switch_sends_the_quantized_rows_bytes(tmp_path: Any, quant: str, ratio: tuple[int, int]) -> None:
    """P = 2, a model whose rows are whole chunks of both formats (hidden 128, moe_intermediate_size 256): a TP -> EP
    switch with requests live sends, by its plan (`SwitchOutcome.weight_bytes`), the rows' share of the bfloat16
    engine's expert bytes (each rank's half of its experts' shards: FP8 144 / 256, MXFP4 17 / 64); the KV rows it
    sends are the bfloat16 engine's."""
    path = write_checkpoint(str(tmp_path / "wide"), dict(hidden_size=128, moe_intermediate_size=256))
    sent = {}
    for q in (None, quant):
        kw = {**ENGINE_KW, "dtype": "bfloat16", "quantization": q}
        with LLM(model=path, num_ranks=2, mode="tp", **kw) as llm:
            for p in PROMPTS[:3]:
                llm.add_request(p, SamplingParams(temperature=0.0, max_tokens=6))
            llm.step()
            out = llm.switch_mode("ep")
            assert out.done
            sent[q] = (out.weight_bytes, out.kv_bytes)
            while llm.has_unfinished():
                llm.step()
    cfg = model_config(_config(path))
    layers, E, D, I = cfg.num_layers, cfg.num_experts, 128, 256
    assert sent[None][0] == layers * E * 3 * I * D * 2 // 2 // 2  # bf16: a rank sends half of its TP shards
    assert sent[quant][0] * ratio[1] == sent[None][0] * ratio[0]
    assert sent[quant][1] == sent[None][1] > 0
