"""--quantization mxfp4: the routed experts held in MXFP4 in their layer slots, as MXFP4 rows (kernels/mxfp4_rows.py:
each row its 32-column chunks, each chunk's 16 bytes of e2m1 codes and its scale byte), on the CPU; the dense
weights stay in the dtype (as the releases keep them).

The oracle is transformers' own forward on the dequantized model: the MXFP4 path dequantizes an expert's rows, then
runs the float math, so in float32 its greedy tokens are transformers' on the weights dequantized by blocks (no
tolerance). GPT-OSS's MXFP4 release format keeps its values exactly (its oracle is transformers' own dequantization);
a float checkpoint is quantized at load (OCP MX: each 32-value block's scale 2^(floor(log2(amax)) - 2), values
rounded to the nearest e2m1, ties to even), and its oracle is the model with the experts quantized and dequantized
here. Checked in TP and EP over P in {1, 2, 4}, across switches (the switch moves MXFP4 rows as bytes), through weight
updates (float quantized on the way in, MXFP4 pieces) and memory release, and the refusals: a TP cut inside a block,
rows of no whole blocks, a checkpoint stored in another format, the GPU.

Checkpoints: a tiny Qwen3MoeForCausalLM with moe_intermediate_size 128 (TP 4 cuts 32 columns of down a rank: one
block), its requantized twin; a tiny GptOssForCausalLM (intermediate_size 64: TP 2 cuts whole blocks) in its
release's MXFP4 format (test_gpt_oss_mxfp4.py's writer) and transformers' dequantization of it.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from conftest import PROMPTS, write_checkpoint
from family_cases import (
    ENGINE_KW,
    gpu_quantized_agreement,
    greedy_outputs,
    hf_greedy,
    lazy_checkpoints,
    parity_across_switch,
    saved_tensors,
    serve,
    stress_jobs,
    switch_stress,
)
from safetensors.torch import save_file
from test_fp8_checkpoints import QWEN_QUANT, to_fp8
from test_gpt_oss_mxfp4 import write_dequantized, write_mxfp4_checkpoint

from moebius import LLM
from moebius.config import ConfigError
from moebius.kernels import fp8_rows
from moebius.kernels.mxfp4_rows import FP4_VALUES, pack_rows, packed_width, unpack_rows
from moebius.kernels.rows import FP8, MXFP4, format_of
from moebius.models.registry import model_config

N_OUT = 8
INTER = 128
WEIGHTS = "model.safetensors"
MX = dict(ENGINE_KW, quantization="mxfp4")
GPT_OSS = dict(intermediate_size=64)
EXPERT = "model.layers.1.mlp.experts.6.down_proj.weight"  # [64, 128]
EXPERT_UP = "model.layers.0.mlp.experts.2.up_proj.weight"  # [128, 64]


def requantized(t: torch.Tensor) -> torch.Tensor:
    """A float weight [R, C] as --quantization mxfp4 holds it: quantized by 32-value blocks, dequantized (float32)."""
    return unpack_rows(pack_rows(t.float()), t.shape[-1], torch.float32).contiguous()


def write_requantized(path: str, float_ckpt: str, transposed: bool = False) -> str:
    """The float checkpoint with every routed expert weight requantized along its input columns (the last dim of
    per-expert and transformers-5 fused weights; `transposed`: GPT-OSS's fused [E, in, out] weights, dim 1), the
    biases, routers and shared experts as they are: the model the MXFP4 engine serves."""
    shutil.copytree(float_ckpt, path)
    tensors = saved_tensors(path)

    def held(n: str, t: torch.Tensor) -> torch.Tensor:
        if ".experts." not in n or n.endswith("_bias"):
            return t
        if transposed:
            return requantized(t.transpose(-1, -2)).transpose(-1, -2).contiguous()
        return requantized(t)

    out = {n: held(n, t) for n, t in tensors.items()}
    save_file(out, os.path.join(path, WEIGHTS), metadata={"format": "pt"})
    return path


MAKERS: dict[str, Callable[[str, Callable[[str], str]], str]] = {
    "float": lambda p, get: write_checkpoint(p, dict(moe_intermediate_size=INTER)),
    "float_b": lambda p, get: write_checkpoint(p, dict(moe_intermediate_size=INTER), seed=3),
    "float_q": lambda p, get: write_requantized(p, get("float")),
    "mx": lambda p, get: write_mxfp4_checkpoint(p, 0, GPT_OSS),
    "mx_b": lambda p, get: write_mxfp4_checkpoint(p, 3, GPT_OSS),
    "deq": lambda p, get: write_dequantized(p, get("mx")),
    "deq_b": lambda p, get: write_dequantized(p, get("mx_b")),
}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], str]:
    return lazy_checkpoints(tmp_path_factory.mktemp("mxfp4_experts"), MAKERS)


# ---------------------------------------------------------------------------------------------------------------
# MXFP4 rows
# ---------------------------------------------------------------------------------------------------------------

def test_a_releases_blocks_come_back_and_unpack_as_transformers() -> None:
    """Random release blocks (every code, scales 2^-17 .. 2^12), dequantized by transformers and packed again: the
    same codes and scale bytes in each 17-byte chunk (a block whose largest code is below 4 would come back as the
    same values under another scale: none is here), and `unpack_rows` is transformers' dequantization bit for bit
    (float32 and bf16); a cut of the bytes at whole chunks (TP's cut of down's columns) unpacks to the same cut of the
    weight."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    E, R, G = 2, 24, 6
    blocks = torch.randint(0, 256, (E, R, G, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(110, 140, (E, R, G), generator=g, dtype=torch.uint8)
    for dtype in (torch.float32, torch.bfloat16):
        w = convert_moe_packed_tensors(blocks, scales, dtype=dtype).transpose(1, 2)  # [E, R, K]: rows of K = 192
        rows = pack_rows(w)
        assert rows.dtype == torch.uint8 and rows.shape == (E, R, packed_width(192)) == (E, R, 6 * 17)
        chunks = rows.unflatten(-1, (G, 17))
        assert torch.equal(chunks[..., :16], blocks) and torch.equal(chunks[..., 16], scales)
        assert torch.equal(unpack_rows(rows, 192, dtype), w)
    half = rows.unflatten(-1, (2, -1))[..., 1, :]  # TP 2's second shard: 3 of the 6 chunks
    assert torch.equal(unpack_rows(half, 96, torch.float32), unpack_rows(rows, 192, torch.float32)[..., 96:])
    with pytest.raises(ValueError, match="48 columns is not a multiple of 32"):
        pack_rows(torch.zeros(2, 48))


def test_float_weights_are_quantized_as_the_mx_specification_says() -> None:
    """Each 32-value block: scale 2^(floor(log2(amax)) - 2), each value the nearest e2m1 value times the scale
    (brute force over the sixteen), ties to the even code, past 6 saturated; an all-zero block has scale 1 and
    the sign of a zero is kept."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(16, 256, generator=g) * torch.logspace(-6, 3, 16)[:, None]
    w[3, :32] = 0.0
    w[4, 32:64] = -0.0
    got = unpack_rows(pack_rows(w), 256, torch.float32)
    blocks = w.unflatten(-1, (8, 32))
    amax = blocks.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, torch.pow(2.0, torch.floor(torch.log2(amax.double())).float() - 2),
                        torch.ones_like(amax))
    grid = torch.tensor(FP4_VALUES)
    x = (blocks / scale).clamp(-6, 6)
    nearest = grid[(x[..., None] - grid).abs().argmin(-1)]
    tie = ((x[..., None] - grid).abs() == (x[..., None] - grid).abs().min(-1, keepdim=True).values).sum(-1) > 2
    assert torch.equal(got.unflatten(-1, (8, 32))[~tie], (nearest * scale)[~tie])  # (±0 ties counted twice)
    ties = torch.tensor([[0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 6.0, -2.5] + [0.0] * 22])
    assert unpack_rows(pack_rows(ties), 32, torch.float32)[0, :10].tolist() == [0, 1, 1, 2, 2, 4, 4, 6, 6, -2]
    assert torch.signbit(got[4, 32:64]).all() and not torch.signbit(got[3, :32]).any()
    # a block's largest magnitude just below 2^k: its scale is 2^(k - 3), where float32's log2 rounds up to k
    below = torch.nextafter(torch.pow(2.0, torch.arange(-100.0, 100.0)), torch.tensor(0.0))
    scale = pack_rows(torch.nn.functional.pad(below[:, None], (0, 31)))[:, 16].long() - 127
    assert torch.equal(scale, torch.arange(-100, 100) - 1 - 2)
    assert ((got - w).norm() / w.norm()) < 0.15


def test_packing_goes_a_few_rows_at_a_time_over_any_view(monkeypatch: pytest.MonkeyPatch) -> None:
    """A strided view (GPT-OSS's transposed, de-interleaved experts) packed in pieces of a few rows (the rounding's
    temporaries bounded) gives the bytes of its contiguous copy packed whole."""
    from moebius.kernels import mxfp4_rows

    g = torch.Generator().manual_seed(2)
    w = torch.randn(3, 64, 2, 40, generator=g).permute(0, 2, 3, 1)  # [3, 2, 40, 64], even its last dim strided
    whole = pack_rows(w.contiguous())
    monkeypatch.setattr(mxfp4_rows, "_PIECE", 3 * 64)  # three rows a piece: 14 pieces a matrix, the last of one row
    assert torch.equal(pack_rows(w), whole) and whole.shape == (3, 2, 40, 34)


def test_the_format_of_rows_is_told_by_their_width() -> None:
    w = torch.randn(4, 256)
    assert format_of(pack_rows(w), 256) is MXFP4 and format_of(fp8_rows.pack_rows(w), 256) is FP8
    # the floor's bytes: the releases' own (MXFP4's are its rows'; FP8's rows repeat a block's scale on each row, and
    # pad: 144 bytes a chunk, or 132 and the row's padding)
    assert MXFP4.release_bytes_per_value == 17 / 32 and FP8.release_bytes_per_value == 1 + 4 / 128**2
    assert format_of(fp8_rows.pack_rows(w, whole=True), 256) is FP8  # (FP8's one segment a row: 272 bytes)
    with pytest.raises(ValueError, match=r"uint8 rows of 100 bytes hold 256 columns in no quantized format \(fp8: "
                                         r"272 or 288 bytes, mxfp4: 136 bytes\)"):
        format_of(torch.zeros(4, 100, dtype=torch.uint8), 256)


# ---------------------------------------------------------------------------------------------------------------
# Served in MXFP4: transformers' tokens on the dequantized model in every layout, across switches
# ---------------------------------------------------------------------------------------------------------------

ENGINES = [(1, "tp"), (2, "ep"), (2, "tp"), (4, "tp"), (4, "ep")]
STRESSED = (2, "ep")  # the switch stress's engine (the others switch alike)


@pytest.fixture(scope="module", params=ENGINES, ids=[f"P{p}-{m}" for p, m in ENGINES])
def engine(request: pytest.FixtureRequest, ckpt: Callable[[str], str]) -> Iterator[tuple[tuple[int, str], LLM]]:
    for _, _, llm in serve(ckpt("float"), *request.param, MX):
        yield request.param, llm


def test_greedy_equals_transformers_on_the_requantized_model(engine: tuple[tuple[int, str], LLM],
                                                             ckpt: Callable[[str], str]) -> None:
    """A float checkpoint quantized at load: each engine in its start layout, then the other after a switch, and
    back; the quantization changes tokens (the float model's differ)."""
    _, llm = engine
    want = [hf_greedy(ckpt("float_q"), tuple(p), N_OUT) for p in PROMPTS[:4]]
    assert want != [hf_greedy(ckpt("float"), tuple(p), N_OUT) for p in PROMPTS[:4]]
    parity_across_switch(llm, ckpt("float_q"), PROMPTS[:4], N_OUT)


def test_live_switches_change_no_token(engine: tuple[tuple[int, str], LLM], ckpt: Callable[[str], str]) -> None:
    which, llm = engine
    if which != STRESSED:
        pytest.skip("the switch stress runs on the P = 2 EP engine (the others switch alike)")
    switch_stress(llm, ckpt("float_q"), stress_jobs(PROMPTS, aborted_tokens=8))


def test_the_slots_hold_mxfp4_rows_at_about_a_quarter_of_the_bytes(ckpt: Callable[[str], str]) -> None:
    """On one rank: each MoE layer's experts are uint8 MXFP4 rows in the slot (17 bytes a 32-value block: 17 / 64 of
    bf16's bytes); the attention's projections stay in the dtype."""
    with LLM(model=ckpt("float"), **MX) as llm:
        rank = llm.engine.ranks.rank
        for m, rt in rank.modes.items():
            lay = rt.layout
            for lw in rt.weights.layers:
                assert lw.mlp.w13_EFD.dtype == lw.mlp.w2_EDF.dtype == torch.uint8, m
                assert lw.mlp.w13_EFD.shape[1:] == (2 * lay.moe_inter, 2 * 17)
                assert lw.mlp.w2_EDF.shape[1:] == (64, lay.moe_inter // 32 * 17)
                assert lw.attn.qkv_QD.dtype == lw.attn.o_DQ.dtype == torch.float32
            assert lay.expert_bytes(2) * 64 == 3 * lay.num_local_experts * INTER * 64 * 2 * 17


def test_a_memory_release_keeps_the_rows_and_a_dropped_one_takes_an_update(ckpt: Callable[[str], str]) -> None:
    """Weights released and resumed (kept in host memory): the same tokens; released without keeping them, an
    update from the float checkpoint on disk quantizes them again on the way in."""
    want = [hf_greedy(ckpt("float_q"), tuple(p), N_OUT) for p in PROMPTS[:2]]
    with LLM(model=ckpt("float"), **MX) as llm:
        assert greedy_outputs(llm, PROMPTS[:2], N_OUT) == want
        for keep in (True, False):
            assert llm.release_memory_occupation(["weights"], keep_weights=keep).done
            assert llm.resume_memory_occupation(["weights"]).done
            if not keep:
                assert llm.update_weights_from_disk(ckpt("float")).done
            assert greedy_outputs(llm, PROMPTS[:2], N_OUT) == want


def test_float_updates_are_quantized_on_the_way_in(ckpt: Callable[[str], str], tmp_path: Any) -> None:
    """At P = 2 in TP, then EP: an update by name of two float expert weights (the other checkpoint's) gives the
    tokens of transformers' requantized model with those two requantized in."""
    float_b = saved_tensors(ckpt("float_b"))
    mixed = str(tmp_path / "mixed")
    shutil.copytree(ckpt("float_q"), mixed)
    tensors = saved_tensors(mixed)
    for name in (EXPERT, EXPERT_UP):
        tensors[name] = requantized(float_b[name])
    save_file(tensors, os.path.join(mixed, WEIGHTS), metadata={"format": "pt"})
    prompts = PROMPTS[1:4]
    want = [hf_greedy(mixed, tuple(p), N_OUT) for p in prompts]
    assert want != [hf_greedy(ckpt("float_q"), tuple(p), N_OUT) for p in prompts]  # the update changes tokens
    with LLM(model=ckpt("float"), num_ranks=2, mode="tp", **MX) as llm:
        assert llm.update_weights([(EXPERT, float_b[EXPERT]), (EXPERT_UP, float_b[EXPERT_UP])]).done
        parity_across_switch(llm, mixed, prompts, N_OUT, back=False)


def _family_writers() -> dict[str, Callable[[str], str]]:
    from conftest import write_deepseek_checkpoint
    from test_glm4_moe_family import write_glm_checkpoint
    from test_gpt_oss_family import write_gpt_oss_checkpoint
    from test_mixtral_family import write_mixtral
    from test_olmoe_family import write_olmoe_checkpoint
    from test_qwen2_moe_family import write_qwen2_moe

    return {"deepseek_v3": lambda p: write_deepseek_checkpoint(p, 3),
            "gpt_oss": lambda p: write_gpt_oss_checkpoint(p, GPT_OSS),
            "glm4_moe": lambda p: write_glm_checkpoint(p, {}, 0),
            "mixtral": lambda p: write_mixtral(p, {}, 0),
            "olmoe": lambda p: write_olmoe_checkpoint(p, {}, 0),
            "qwen2_moe": lambda p: write_qwen2_moe(p, {}, 0)}


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe", "gpt_oss", "mixtral", "olmoe", "qwen2_moe"])
def test_every_family_serves_its_experts_in_mxfp4(family: str, tmp_path: Any) -> None:
    """Each family's tiny float checkpoint (experts 32 or 64 wide) quantized at load on one rank: transformers' tokens
    on its requantized twin in TP, then EP after a switch (shared experts, expert biases and dense layers in the
    dtype)."""
    path = _family_writers()[family](str(tmp_path / family))
    twin = write_requantized(str(tmp_path / (family + "_q")), path, transposed=family == "gpt_oss")
    with LLM(model=path, **MX) as llm:
        w = [lw.mlp for lw in llm.engine.ranks.rank.modes["tp"].weights.layers]
        assert any(getattr(m, "w13_EFD", None) is not None and m.w13_EFD.dtype == torch.uint8 for m in w)
        parity_across_switch(llm, twin, PROMPTS[:3], N_OUT, back=False)


def test_a_fused_update_packs_each_ranks_experts(ckpt: Callable[[str], str], tmp_path: Any) -> None:
    """At P = 2 in EP, then TP: an update of a layer's fused down_proj [E, D, I] (a trainer's transformers-5 tensor,
    float32) on a bfloat16 engine: each rank packs its own experts, from the given float32 as the load packs a stored
    tensor (one rounding); the tokens are the engine's on a checkpoint holding those weights."""
    float_b = saved_tensors(ckpt("float_b"))
    names = [f"model.layers.1.mlp.experts.{e}.down_proj.weight" for e in range(8)]
    fused = torch.stack([float_b[n] for n in names])  # [8, 64, 128]
    mixed = str(tmp_path / "mixed")
    shutil.copytree(ckpt("float"), mixed)
    tensors = saved_tensors(mixed)
    tensors.update({n: float_b[n] for n in names})
    save_file(tensors, os.path.join(mixed, WEIGHTS), metadata={"format": "pt"})
    kw = dict(MX, dtype="bfloat16")
    want = {}
    with LLM(model=mixed, num_ranks=2, mode="ep", **kw) as llm:  # (bf16: each layout's own sums)
        want["ep"] = greedy_outputs(llm, PROMPTS[:3], N_OUT)
        assert llm.switch_mode("tp").done
        want["tp"] = greedy_outputs(llm, PROMPTS[:3], N_OUT)
    with LLM(model=ckpt("float"), num_ranks=2, mode="ep", **kw) as llm:
        assert greedy_outputs(llm, PROMPTS[:3], N_OUT) != want["ep"]  # the update changes tokens
        assert llm.update_weights([("model.layers.1.mlp.experts.down_proj", fused)]).done
        assert greedy_outputs(llm, PROMPTS[:3], N_OUT) == want["ep"]
        assert llm.switch_mode("tp").done
        assert greedy_outputs(llm, PROMPTS[:3], N_OUT) == want["tp"]


# ---------------------------------------------------------------------------------------------------------------
# GPT-OSS's MXFP4 release format, kept as it is stored
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("P,mode", [(1, "tp"), (2, "tp"), (2, "ep")])
def test_a_release_is_served_as_stored(ckpt: Callable[[str], str], P: int, mode: str) -> None:
    """GPT-OSS's MXFP4 checkpoint with --quantization mxfp4: the slots hold its values exactly (a rank's experts
    unpack to transformers' dequantization of the blocks, bit for bit), and the tokens are transformers' on its
    dequantized model in the start layout and the other after a switch, and back."""
    deq = saved_tensors(ckpt("deq"))
    with LLM(model=ckpt("mx"), num_ranks=P, mode=mode, **MX) as llm:
        if P == 1:
            w = llm.engine.ranks.rank.modes["tp"].weights.layers[1].mlp
            assert w.w13_EFD.dtype == torch.uint8
            gate_up = deq["model.layers.1.mlp.experts.gate_up_proj"]  # [E, D, 2I], gate and up interleaved
            w13 = unpack_rows(w.w13_EFD, 64, torch.float32)  # [E, 2I, D]: gate rows, then up rows
            assert torch.equal(w13[:, :64], gate_up[..., 0::2].transpose(1, 2))
            assert torch.equal(w13[:, 64:], gate_up[..., 1::2].transpose(1, 2))
            down = deq["model.layers.1.mlp.experts.down_proj"]  # [E, I, D]
            assert torch.equal(unpack_rows(w.w2_EDF, 64, torch.float32), down.transpose(1, 2))
        parity_across_switch(llm, ckpt("deq"), PROMPTS[:4], N_OUT)


def test_a_release_takes_packed_updates(ckpt: Callable[[str], str]) -> None:
    """At P = 2 in EP: an update from the other MXFP4 checkpoint on disk gives its dequantized model's tokens, in
    both layouts."""
    with LLM(model=ckpt("mx"), num_ranks=2, mode="ep", **MX) as llm:
        assert llm.update_weights_from_disk(ckpt("mx_b")).done
        parity_across_switch(llm, ckpt("deq_b"), PROMPTS[:3], N_OUT, back=False)


# ---------------------------------------------------------------------------------------------------------------
# Refusals
# ---------------------------------------------------------------------------------------------------------------

def test_a_tp_cut_inside_a_block_is_refused_naming_the_sizes(tmp_path: Any) -> None:
    """moe_intermediate_size 96 (gpt-oss's 2880 at TP 4 alike): TP over 2 ranks cuts down's columns into 48 a rank,
    inside a 32-value block: TP or auto asked for is refused at start, naming the sizes and the layout that serves
    it; EP alone serves (--mode ep holds it alone)."""
    path = write_checkpoint(str(tmp_path / "q96"), dict(moe_intermediate_size=96))
    with pytest.raises(ConfigError, match=r"--quantization mxfp4 with TP over 2 ranks would cut each expert's "
                                          r"moe_intermediate_size 96 into 48 rows a rank, splitting its 32-column "
                                          r"MXFP4 scale blocks; EP keeps whole experts: serve it in EP alone "
                                          r"\(leave --mode unset, or --mode ep\)"):
        LLM(model=path, num_ranks=2, mode="tp", **MX)
    with LLM(model=path, num_ranks=2, mode="ep", **MX) as llm:
        assert llm.engine.held_layouts == ("ep",) and len(greedy_outputs(llm, PROMPTS[:2], 3)[1]) == 3
    with pytest.raises(ConfigError, match=r"would cut each expert's moe_intermediate_size 96 into 48 rows a rank"):
        LLM(model=path, num_ranks=2, mode="auto", **MX)  # asked for: auto needs TP too


def test_by_default_a_model_tp_cannot_cut_is_served_in_ep_alone(tmp_path: Any,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    """No --mode (auto by default with several ranks) and a model TP would cut inside its blocks: the engine starts
    in EP holding it alone, says why, and refuses a switch to TP naming that; the same tokens as an EP engine asked
    for."""
    path = write_checkpoint(str(tmp_path / "q96"), dict(moe_intermediate_size=96))
    with LLM(model=path, num_ranks=2, mode="ep", static_layout=True, **MX) as llm:
        want = greedy_outputs(llm, PROMPTS[:3], N_OUT)
    with caplog.at_level("WARNING", logger="moebius"), LLM(model=path, num_ranks=2, **MX) as llm:
        assert llm.mode == "ep" and llm.engine.auto is None and llm.engine.held_layouts == ("ep",)
        assert greedy_outputs(llm, PROMPTS[:3], N_OUT) == want
        out = llm.switch_mode("tp")
        assert not out.done and "holds only the ep layout" in out.reason
    assert any("serving in EP alone: TP over 2 ranks would cut the quantized experts" in r.getMessage()
               for r in caplog.records)


def test_rows_of_no_whole_blocks_are_refused(tmp_path: Any) -> None:
    path = write_checkpoint(str(tmp_path / "q48"), dict(moe_intermediate_size=48))
    with pytest.raises(ConfigError, match=r"--quantization mxfp4 holds the experts' rows in whole 32-value MXFP4 "
                                          r"blocks, and this model's moe_intermediate_size 48 is not a multiple of "
                                          r"32: serve it without --quantization"):
        LLM(model=path, **MX)


def test_another_checkpoint_format_is_refused(ckpt: Callable[[str], str], tmp_path: Any) -> None:
    """A block-FP8 checkpoint is not quantized a second time (and an MXFP4 one not in FP8: GPT-OSS serves no FP8)."""
    fp8 = to_fp8(shutil.copytree(ckpt("float"), str(tmp_path / "fp8")), QWEN_QUANT)
    with pytest.raises(ConfigError, match=r"--quantization mxfp4 would quantize again a checkpoint stored in fp8: "
                                          r"serve it with --quantization fp8 \(where its family serves that\) or "
                                          r"without --quantization"):
        LLM(model=fp8, **MX)
    with LLM(model=ckpt("float"), **MX) as llm:  # nor by an update from disk
        with pytest.raises(ConfigError, match=r"--quantization mxfp4 would quantize again the weight update's "
                                              r"checkpoint .* stored in fp8: update from a float checkpoint or one "
                                              r"stored in mxfp4"):
            llm.update_weights_from_disk(fp8)
    with pytest.raises(ConfigError, match=r"--quantization fp8 is not served for the gpt_oss family"):
        LLM(model=ckpt("mx"), **dict(ENGINE_KW, quantization="fp8"))


# ---------------------------------------------------------------------------------------------------------------
# What it saves
# ---------------------------------------------------------------------------------------------------------------

def test_the_floor_model_counts_mxfp4_rows_bytes() -> None:
    """gpt-oss-20b's and Qwen3-30B-A3B's shapes: a decode step's routed-expert bytes and a switch's weight bytes are
    17 / 64 of bf16's (half a byte a value and a scale byte a 32-value block); the dense weights, the cache, the
    activations and lm_head unchanged."""
    from moebius.bench.floor import decode_step_terms, switch_floor_ms
    from moebius.config import PRESETS

    for preset in ("gpt-oss-20b", "qwen3-30b-a3b"):
        bf16 = model_config(PRESETS[preset])
        mx = dataclasses.replace(bf16, quantization="mxfp4")
        for mode in ("tp", "ep"):
            a, b = decode_step_terms(bf16, 2, mode, 64, 1024), decode_step_terms(mx, 2, mode, 64, 1024)
            assert b["experts_bytes"] == pytest.approx(a["experts_bytes"] * 17 / 64)
            assert {k: v for k, v in a.items() if k.endswith("_bytes") and k not in ("experts_bytes", "hbm_bytes")} \
                == {k: v for k, v in b.items() if k.endswith("_bytes") and k not in ("experts_bytes", "hbm_bytes")}
        assert switch_floor_ms(mx, 2, 0) == pytest.approx(switch_floor_ms(bf16, 2, 0) * 17 / 64)


def test_gpt_oss_120b_fits_one_gpu_in_mxfp4() -> None:
    """A rank's weights (the floor model's sizing, as worker/build.py plans them): gpt-oss-120b's do not fit one
    H200 in bf16 and do in MXFP4; at P = 4, where TP would cut its 2880-wide experts into 720 columns (inside a
    block), a rank holds EP's regions alone."""
    from moebius.bench.floor import Hardware, rank_weight_bytes
    from moebius.config import PRESETS
    from moebius.parallel.layout import tp_cuts_whole_blocks

    bf16 = model_config(PRESETS["gpt-oss-120b"])
    mx = dataclasses.replace(bf16, quantization="mxfp4")
    gpu = Hardware().memory_bytes
    assert rank_weight_bytes(mx, 1) < 0.5 * gpu < gpu < rank_weight_bytes(bf16, 1)
    assert not tp_cuts_whole_blocks(mx, 4) and tp_cuts_whole_blocks(mx, 2)  # (TP 4's specs cannot be cut at all)
    assert rank_weight_bytes(mx, 4) < rank_weight_bytes(mx, 2) < rank_weight_bytes(mx, 1)


@pytest.mark.gpu
def test_mxfp4_rows_on_the_gpu_agree_with_the_dequantized_model(ckpt: Callable[[str], str]) -> None:
    """On a GPU in bf16 (benchmarks/families_device_run.sh's `mxfp4tests` step): the fused
    MoE on MXFP4 rows, through prompt and decode steps in both layouts, against the engine on transformers'
    dequantization of the same release position by position (`gpu_quantized_agreement`; the same bf16 weight values,
    W4A16; the kernels' K steps differ, so nearly every position, not all)."""
    gpu_quantized_agreement(ckpt("mx"), ckpt("deq"), "mxfp4", PROMPTS[:4], N_OUT)
