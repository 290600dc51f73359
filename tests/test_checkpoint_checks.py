"""No checkpoint misread, clear errors for broken model directories and KV sizing (issue 42).

The catalogue: every broken checkpoint or sizing below is refused with its exception type and a message naming
what is wrong (the file, the tensor, the key, the setting and its numbers); quantized checkpoints are refused
naming their method; tensors no weight reads are listed in one warning. What the front end can check (config.json,
the safetensors headers, the KV token budget) is refused before any rank is built or spawned. After them, an engine
on the same checkpoint still gives transformers' greedy tokens.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable
from typing import Any

import psutil
import pytest
import torch
from conftest import PROMPTS, Checkpoints, hf_greedy, make_llm
from safetensors.torch import load_file, save_file
from test_bad_inputs import _edit_config

from moebius.config import PRESETS, ConfigError, EngineConfig
from moebius.memory.umm import MemoryPlan, UnifiedMemory
from moebius.models.source import hf_config_of, resolve_model
from moebius.sampling_params import SamplingParams
from moebius.worker import build

GOOD = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
WEIGHTS = "model.safetensors"
Q_PROJ = "model.layers.0.self_attn.q_proj.weight"
EXPERT = "model.layers.1.mlp.experts.3.gate_proj.weight"


# ---------------------------------------------------------------------------------------------------------------
# How a broken checkpoint is made (a fresh copy of "base" each)
# ---------------------------------------------------------------------------------------------------------------

def edit_config(**changes: Any) -> Callable[[str], None]:
    """config.json with keys set (None: removed)."""
    return lambda path: _edit_config(path, **changes)


def edit_tensors(fn: Callable[[dict[str, torch.Tensor]], None], file: str = WEIGHTS) -> Callable[[str], None]:
    def edit(path: str) -> None:
        f = os.path.join(path, file)
        tensors = load_file(f)
        fn(tensors)
        save_file(tensors, f, metadata={"format": "pt"})
    return edit


def retype(name: str, dtype: torch.dtype) -> Callable[[str], None]:
    def fn(t: dict[str, torch.Tensor]) -> None:
        t[name] = t[name].to(dtype)
    return edit_tensors(fn)


def cut_file(keep: Callable[[int], int], file: str = WEIGHTS) -> Callable[[str], None]:
    """The file's first keep(size) bytes only."""
    def edit(path: str) -> None:
        f = os.path.join(path, file)
        with open(f, "rb") as fh:
            data = fh.read()
        with open(f, "wb") as fh:
            fh.write(data[:keep(len(data))])
    return edit


def write_file(name: str, text: str) -> Callable[[str], None]:
    def edit(path: str) -> None:
        with open(os.path.join(path, name), "w") as fh:
            fh.write(text)
    return edit


def write_bytes(name: str, data: bytes) -> Callable[[str], None]:
    def edit(path: str) -> None:
        with open(os.path.join(path, name), "wb") as fh:
            fh.write(data)
    return edit


def append_bytes(extra: bytes) -> Callable[[str], None]:
    def edit(path: str) -> None:
        with open(os.path.join(path, WEIGHTS), "ab") as fh:
            fh.write(extra)
    return edit


def corrupt_header(path: str) -> None:
    """The header's first bytes overwritten (its length kept)."""
    with open(os.path.join(path, WEIGHTS), "r+b") as fh:
        fh.seek(8)
        fh.write(b"\xff\xfe<<<")


def split_duplicate(path: str) -> None:
    """A second file holding a tensor the first one holds too, and no index to say which counts."""
    t = load_file(os.path.join(path, WEIGHTS))
    save_file({Q_PROJ: t[Q_PROJ]}, os.path.join(path, "extra.safetensors"), metadata={"format": "pt"})


def index_lies(path: str) -> None:
    """An index that puts a tensor in a file that does not hold it."""
    t = load_file(os.path.join(path, WEIGHTS))
    save_file({"lm_head.weight": t.pop("lm_head.weight")}, os.path.join(path, "head.safetensors"),
              metadata={"format": "pt"})
    save_file(t, os.path.join(path, WEIGHTS), metadata={"format": "pt"})
    weight_map = {k: WEIGHTS for k in t} | {"lm_head.weight": WEIGHTS}  # should be head.safetensors
    write_file("model.safetensors.index.json", json.dumps({"metadata": {}, "weight_map": weight_map}))(path)


FP8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
# transformers' per-channel FP8 (float8 weights, a weight_scale a row): a method no family reads
FBGEMM_FP8 = {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0}


def fp8_without_scales(path: str) -> None:
    """Block FP8's quantization_config, q_proj stored as float8 but no weight_scale_inv beside it."""
    edit_config(quantization_config=FP8)(path)
    retype(Q_PROJ, torch.float8_e4m3fn)(path)


# (id, how the checkpoint is broken, exception type, what the message must say)
BROKEN: list[tuple[str, Callable[[str], None], type[Exception], str]] = [
    # quantized checkpoints: refused naming the method (block FP8, which Qwen3-MoE reads: naming what is amiss)
    ("fbgemm-fp8", edit_config(quantization_config=FBGEMM_FP8), ConfigError,
     r"config\.json has a quantization_config \(quant_method 'fbgemm_fp8'\): a quantized checkpoint, and Moebius "
     r"reads no such one for \['Qwen3MoeForCausalLM'\] \(it reads fp8 for Qwen3MoeForCausalLM, .*; mxfp4 for "
     r"GptOssForCausalLM\)"),
    ("fp8-block-64", edit_config(quantization_config={**FP8, "weight_block_size": [64, 64]}), ConfigError,
     r"config\.json has a quantization_config \(quant_method 'fp8'\) with weight_block_size \[64, 64\]: Moebius "
     r"reads block FP8 with weight_block_size \[128, 128\] only"),
    ("fp8-without-scales", fp8_without_scales, ConfigError,
     rf"is missing tensor {re.escape(Q_PROJ)}_scale_inv \(one of the fp8 pieces"),
    # MXFP4 is GPT-OSS's format: on another architecture it is refused the same way
    ("mxfp4", edit_config(quantization_config={"quant_method": "mxfp4"}), ConfigError,
     r"quant_method 'mxfp4'\): a quantized checkpoint, and Moebius reads no such one for \['Qwen3MoeForCausalLM'\]"),
    ("awq", edit_config(quantization_config={"quant_method": "awq", "bits": 4, "group_size": 128}), ConfigError,
     r"quant_method 'awq'"),
    ("gptq", edit_config(quantization_config={"quant_method": "gptq", "bits": 4}), ConfigError,
     r"quant_method 'gptq'"),
    ("compressed-tensors", edit_config(quantization_config={"quant_method": "compressed-tensors"}), ConfigError,
     r"quant_method 'compressed-tensors'"),
    ("bitsandbytes-old", edit_config(quantization_config={"load_in_4bit": True}), ConfigError,
     r"quant_method 'bitsandbytes'"),
    ("compression_config", edit_config(compression_config={"quant_method": "compressed-tensors"}), ConfigError,
     r"has a compression_config \(quant_method 'compressed-tensors'\)"),
    ("quantize_config.json", write_file("quantize_config.json", '{"bits": 4, "group_size": 128}'), ConfigError,
     r"quantize_config\.json marks a quantized"),
    # tensors a plain cast would misread, with no quantization_config to say so
    ("float8-tensor", retype(Q_PROJ, torch.float8_e4m3fn), ConfigError,
     rf"tensor {re.escape(Q_PROJ)} in '.*model\.safetensors' is stored as F8_E4M3 \(float8\).*reinterpret or cast"),
    ("float8-e5m2-expert", retype(EXPERT, torch.float8_e5m2), ConfigError,
     rf"tensor {re.escape(EXPERT)} .* is stored as F8_E5M2 \(float8\)"),
    ("int8-tensor", retype("lm_head.weight", torch.int8), ConfigError,
     r"tensor lm_head\.weight .* is stored as I8 \(integer"),
    ("uint8-tensor", retype("model.norm.weight", torch.uint8), ConfigError,
     r"tensor model\.norm\.weight .* is stored as U8 \(integer"),
    ("int32-packed", edit_tensors(lambda t: t.update({Q_PROJ: torch.zeros(64, 8, dtype=torch.int32)})), ConfigError,
     rf"tensor {re.escape(Q_PROJ)} .* is stored as I32 \(integer \(packed"),
    ("every-expert-float8", edit_tensors(lambda t: t.update({k: v.to(torch.float8_e4m3fn) for k, v in t.items()
                                                             if ".experts." in k})), ConfigError,
     r"is stored as F8_E4M3 \(float8\), and so are 71 more the model reads \(model\.layers\.0\.mlp\.experts\.0\."),
    # broken files
    ("safetensors-cut-in-header", cut_file(lambda n: 100), ConfigError,
     r"safetensors file '.*model\.safetensors' is truncated or not a safetensors file: its first 8 bytes give a "
     r"header of \d+ bytes, but the file holds 92"),
    ("safetensors-cut-in-data", cut_file(lambda n: n - 1000), ConfigError,
     r"'.*model\.safetensors' is truncated: its header lists \d+ bytes of tensor data, the file holds \d+"),
    ("safetensors-empty", cut_file(lambda n: 0), ConfigError,
     r"'.*model\.safetensors' is truncated: it holds 0 bytes"),
    ("safetensors-trailing-bytes", append_bytes(b"junk"), ConfigError,
     r"'.*model\.safetensors' is corrupt: it holds \d+ bytes of tensor data where its header lists \d+"),
    ("safetensors-header-not-json", corrupt_header, ConfigError,
     r"'.*model\.safetensors' has a corrupt header \(not JSON"),
    ("tensor-in-two-files", split_duplicate, ConfigError,
     rf"tensor {re.escape(Q_PROJ)} is in both '.*extra\.safetensors' and '.*model\.safetensors'"),
    ("index-not-json", write_file("model.safetensors.index.json", '{"weight_map": {'), ConfigError,
     r"model\.safetensors\.index\.json is not valid JSON: Expecting property name .* at line 1 column 17"),
    ("index-without-weight-map", write_file("model.safetensors.index.json", '{"metadata": {}}'), ConfigError,
     r"index\.json has no \"weight_map\""),
    ("index-puts-tensor-in-wrong-file", index_lies, ConfigError,
     r"index\.json puts tensor lm_head\.weight in 'model\.safetensors', which holds no tensor of that name"),
    # config.json
    ("config-not-json", write_file("config.json", '{"architectures": ["Qwen3MoeForCausalLM"],\n "vocab_size": }'),
     ConfigError, r"config\.json is not valid JSON\W+Expecting value\W+(at )?line 2 column 16"),
    ("config-a-list", write_file("config.json", "[1, 2]"), ConfigError,
     r"config\.json holds a JSON list, not an object"),
    ("config-not-text", write_bytes("config.json", b"\xff\xfe\x00garbage"), ConfigError,
     r"config\.json is not (UTF-8 text|valid JSON)"),
    ("config-without-moe-keys", edit_config(num_local_experts=None, num_experts_per_tok=None,
                                            moe_intermediate_size=None), ConfigError,
     r"config\.json lacks num_experts, num_experts_per_tok, moe_intermediate_size: a Qwen3-MoE model's config\.json "
     r"needs them"),
    ("config-without-shapes", edit_config(hidden_size=None, num_hidden_layers=None, num_key_value_heads=None),
     ConfigError, r"config\.json lacks hidden_size, num_hidden_layers, num_key_value_heads:"),
    ("config-dense-layer-without-intermediate_size", edit_config(mlp_only_layers=[1], intermediate_size=None),
     ConfigError, r"config\.json lacks intermediate_size"),
    ("config-wrong-types", edit_config(num_experts_per_tok="2", hidden_size=64.0, rms_norm_eps=-1), ConfigError,
     r"config\.json: hidden_size must be an integer >= 1, got 64\.0; num_experts_per_tok must be an integer >= 1, "
     r"got '2'; rms_norm_eps must be a positive number, got -1"),
]


@pytest.mark.parametrize("edit,exc,pattern", [pytest.param(*b[1:], id=b[0]) for b in BROKEN])
def test_broken_checkpoint_is_refused_naming_what_is_wrong(ckpt: Checkpoints, edit: Callable[[str], None],
                                                           exc: type[Exception], pattern: str) -> None:
    path = ckpt.copy("base", "broken")
    edit(path)
    with pytest.raises(exc, match=pattern):
        make_llm(path)


def test_the_front_end_refuses_them_before_any_rank_is_spawned(ckpt: Checkpoints,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """With --num-ranks 2 every broken checkpoint above is refused by the front end, with the same message, before
    a rank process is spawned."""
    def no_spawn(*a: Any) -> None:
        raise AssertionError("rank processes were spawned before the checkpoint was refused")

    monkeypatch.setattr("moebius.frontend.core.SpawnedRanks", no_spawn)
    for _, edit, exc, pattern in BROKEN:
        path = ckpt.copy("base", "broken-front")
        edit(path)
        with pytest.raises(exc, match=pattern):
            make_llm(path, num_ranks=2, mode="tp")


def test_a_checkpoint_misread_fails_without_the_checks(ckpt: Checkpoints, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the checks stop: an FP8 quantization_config no family reads, with float8 tensors, would otherwise load as
    garbage weights. The tensor check holds on its own too: with the config check off, the float8 tensor is still
    refused."""
    path = ckpt.copy("base", "fp8-both")
    edit_config(quantization_config=FBGEMM_FP8)(path)
    retype(Q_PROJ, torch.float8_e4m3fn)(path)
    with pytest.raises(ConfigError, match="quant_method 'fbgemm_fp8'"):
        make_llm(path)
    monkeypatch.setattr("moebius.models.source.check_quantization", lambda *a: None)
    with pytest.raises(ConfigError, match=rf"{re.escape(Q_PROJ)} .* F8_E4M3"):
        make_llm(path)


def test_the_rank_side_loader_refuses_a_float8_tensor_too(ckpt: Checkpoints) -> None:
    """A rank reading a checkpoint (build_rank's Checkpoint.get) checks the dtype itself, not only the front end."""
    from moebius.models.loader import Checkpoint

    path = ckpt.copy("base", "rank-float8")
    retype(Q_PROJ, torch.float8_e4m3fn)(path)
    c = Checkpoint(path)
    with pytest.raises(ConfigError, match=rf"{re.escape(Q_PROJ)} .* F8_E4M3 \(float8\)"):
        c.get(Q_PROJ, (64, 64))
    assert c.get("model.norm.weight", (64,)).dtype == torch.float32


# ---------------------------------------------------------------------------------------------------------------
# Tensors no weight reads: one warning, and the model loads
# ---------------------------------------------------------------------------------------------------------------

def add_extras(t: dict[str, torch.Tensor]) -> None:
    """What an FP8 release's block scales and a multi-token-prediction layer look like beside the weights."""
    for k in [k for k in t if k.endswith("_proj.weight")]:
        t[k.removesuffix(".weight") + ".weight_scale_inv"] = torch.ones(1, 1)
    t["mtp.layers.0.eh_proj.weight"] = torch.zeros(64, 128)
    t["mtp.layers.0.enorm.weight"] = torch.ones(64)


def test_unread_tensors_are_listed_in_one_warning_and_the_model_loads(ckpt: Checkpoints,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    path = ckpt.copy("base", "extras")
    edit_tensors(add_extras)(path)
    with caplog.at_level(logging.WARNING, logger="moebius"):
        llm = make_llm(path)
    warnings = [r.getMessage() for r in caplog.records if "no Moebius weight reads" in r.getMessage()]
    assert len(warnings) == 1, warnings
    # 3 layers of 8 experts' 3 projections and 4 attention projections, and the MTP layer's 2
    assert re.fullmatch(r"checkpoint '.*extras' holds 86 tensors no Moebius weight reads \(ignored\): "
                        r"(model\.layers\.0\.\S+\.weight_scale_inv, ){4}model\.layers\.0\.\S+\.weight_scale_inv "
                        r"and 81 more", warnings[0]), warnings[0]
    base = ckpt("base")
    assert llm.generate(PROMPTS[2], GOOD)[0].token_ids == hf_greedy(base, PROMPTS[2], 6)


def test_layers_left_out_by_num_layers_are_not_listed(ckpt: Checkpoints, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="moebius"):
        make_llm(ckpt("base"), num_layers=1)
    assert not [r for r in caplog.records if "no Moebius weight reads" in r.getMessage()]


# ---------------------------------------------------------------------------------------------------------------
# KV sizing
# ---------------------------------------------------------------------------------------------------------------

KV_SIZINGS = [
    pytest.param(dict(max_total_tokens=20, block_size=16),
                 r"--max-total-tokens 20 with --block-size 16 makes 1 KV page of 16 tokens, and page 0 is reserved.*"
                 r"set --max-total-tokens to at least 32", id="budget-one-page"),
    pytest.param(dict(max_total_tokens=64, block_size=64),
                 r"--max-total-tokens 64 with --block-size 64 makes 1 KV page", id="block-as-large-as-budget"),
    pytest.param(dict(max_total_tokens=None, block_size=65536),
                 r"the CPU's default KV budget of 65536 tokens \(--max-total-tokens unset\) with --block-size 65536 "
                 r"makes 1 KV page.*lower --block-size to at most 32768", id="cpu-default-one-page"),
    pytest.param(dict(max_total_tokens=None, block_size=131072),
                 r"default KV budget of 65536 tokens .* --block-size 131072 makes 0 KV pages", id="cpu-default-none"),
    pytest.param(dict(max_total_tokens=2**40),
                 r"the unified buffer of this rank would take \d+\.\d\d GiB \(\d+\.\d\d GiB of it the KV cache of "
                 r"--max-total-tokens 1099511627776 over 4 layer slots.*more than the \d+\.\d\d GiB cpu has "
                 r"available: lower --max-total-tokens", id="budget-beyond-memory"),
]


@pytest.mark.parametrize("kw,pattern", KV_SIZINGS)
def test_kv_sizing_without_a_usable_page_names_the_setting(ckpt: Checkpoints, monkeypatch: pytest.MonkeyPatch,
                                                           kw: dict[str, Any], pattern: str) -> None:
    def no_allocation(*a: Any) -> None:
        raise AssertionError("the buffer was allocated before the sizing was refused")

    monkeypatch.setattr(build, "UnifiedMemory", no_allocation)
    with pytest.raises(ConfigError, match=pattern):
        make_llm(ckpt("base"), **kw)


def test_gpu_sizing_by_mem_fraction_names_the_numbers(monkeypatch: pytest.MonkeyPatch) -> None:
    """--mem-fraction leaving no KV page (a GPU's memory faked): the fraction, the GPU's memory, what the weights and
    step buffers take and the flags that size them (the experts of the slots that hold them: not the first, a dense
    layer's), and what the least KV cache needs."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (70 * 2**30, 80 * 2**30))
    ecfg = EngineConfig(mem_fraction=0.05, max_num_batched_tokens=8192)
    sizes = build.BufferSizes(dense=3 * 2**30, static=2**29, expert=2**25, slot_experts=(False,) + (True,) * 48)
    with pytest.raises(ConfigError, match=r"--mem-fraction 0\.05 of cuda \(80\.0 GiB, 70\.0 GiB free\) gives the "
                                          r"unified buffer 4\.00 GiB; the weights take 4\.50 GiB of it \(1\.50 GiB of "
                                          r"experts in 48 of 49 layer slots\) and the step buffers 0\.50 GiB "
                                          r"\(--max-num-batched-tokens 8192, --max-running-requests 256, "
                                          r"--max-model-len 40960\), leaving -1\.00 GiB.*raise --mem-fraction"):
        build._num_pages(ecfg, torch.device("cuda"), sizes, lambda pages: 49 * pages * 2**17, 40960)
    # enough memory: the pages it leaves, unchanged
    left = 40 * 2**30 - 3 * 2**30 - 2**29 - 48 * 2**25
    assert build._num_pages(EngineConfig(mem_fraction=0.5), torch.device("cuda"), sizes,
                            lambda pages: 49 * pages * 2**17, 40960) == left // (49 * 2**17)
    # sliding layers' slots (every other one) capped at 1000 pages: the full layers' slots take the rest
    slot_kv = build.SlotKV((frozenset({0}), frozenset({1})) * 24 + (frozenset({0}),), (None, 1000 * 2**17), 2**17)
    pages = build._num_pages(EngineConfig(mem_fraction=0.5), torch.device("cuda"), sizes, slot_kv.total, 40960)
    assert pages == (left - 24 * 1000 * 2**17) // (25 * 2**17) > 1.7 * left // (49 * 2**17)
    assert slot_kv.slot_bytes(pages)[:2] == [pages * 2**17, 1000 * 2**17]
    assert slot_kv.total(pages) <= left < slot_kv.total(pages + 1)


def test_a_buffer_that_cannot_be_allocated_is_a_memory_error_naming_its_size() -> None:
    plan = MemoryPlan()
    plan.add_slots([[(None, 2**48)]] * 4)
    with pytest.raises(MemoryError, match=r"could not allocate the unified buffer of 1048576\.00 GiB \(4 layer slots "
                                          r"of 1048576\.000 GiB in all\) on cpu"):
        UnifiedMemory(plan, torch.device("cpu"))


def rank_processes() -> set[int]:
    """This test process's live children but multiprocessing's resource tracker (the first spawn starts it, and it
    stays for the life of the process by design)."""
    return {p.pid for p in psutil.Process().children(recursive=True) if p.is_running()
            and p.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in " ".join(p.cmdline())}


def test_spawned_ranks_give_the_same_message_and_leave_no_process(ckpt: Checkpoints) -> None:
    """--num-ranks 2: a budget the front end can size is refused there (nothing spawned); the EP layout's pages,
    which only the ranks size (its 2 KV heads a rank against TP's 1 halve them), reach the user as the ranks' message,
    and every rank process is gone afterwards."""
    base = ckpt("base")
    before = rank_processes()
    with pytest.raises(ConfigError, match=r"--max-total-tokens 20 with --block-size 16 makes 1 KV page"):
        make_llm(base, num_ranks=2, mode="tp", max_total_tokens=20)
    assert rank_processes() == before
    # every rank gives it: raised once, as the ConfigError one rank in this process raises
    ep_short = (r"the EP layout holds 2 KV heads a rank against the TP layout's 1, so the KV bytes of "
                r"--max-total-tokens 48 \(3 TP pages of --block-size 16 tokens\) make 1 EP page, and page 0 is "
                r"reserved.*set --max-total-tokens to at least 64")
    with pytest.raises(ConfigError, match="^" + ep_short):  # (no "rank N:" before it)
        make_llm(base, num_ranks=2, mode="tp", max_total_tokens=48)
    assert rank_processes() == before


# ---------------------------------------------------------------------------------------------------------------
# What is unchanged
# ---------------------------------------------------------------------------------------------------------------

def test_presets_and_dummy_weights_are_unchanged(ckpt: Checkpoints) -> None:
    """Presets pass the config checks; --load-format dummy reads no safetensors file, so a checkpoint directory
    whose weights are cut short still runs on dummy weights (as before)."""
    for name in PRESETS:
        assert hf_config_of(name) is PRESETS[name]
    path = ckpt.copy("base", "dummy-over-broken")
    cut_file(lambda n: 100)(path)
    resolved = resolve_model(EngineConfig(model=path, load_format="dummy", device="cpu"))
    assert resolved.checkpoint is None
    out = make_llm(path, load_format="dummy").generate(PROMPTS[1], GOOD)[0]
    assert len(out.token_ids) == 6


@pytest.mark.parametrize("name", ["base", "base_sharded", "tied_mha_nonorm", "dense_layer"])
def test_good_checkpoints_still_give_transformers_tokens(ckpt: Checkpoints, caplog: pytest.LogCaptureFixture,
                                                         name: str) -> None:
    """After the catalogue: the same checkpoints, unbroken, load without a warning and give the greedy tokens."""
    path = ckpt(name)
    with caplog.at_level(logging.WARNING, logger="moebius"):
        llm = make_llm(path)
    assert not [r for r in caplog.records if "no Moebius weight reads" in r.getMessage()]
    outs = llm.generate([PROMPTS[1], PROMPTS[3]], GOOD)
    assert [o.token_ids for o in outs] == [hf_greedy(path, p, 6) for p in (PROMPTS[1], PROMPTS[3])]


def test_the_catalogue_holds_at_least_20_cases() -> None:
    assert len(BROKEN) + len(KV_SIZINGS) + 3 >= 20  # + the mem-fraction, allocation and EP layout's pages tests


def test_the_ranks_start_up_errors_are_merged() -> None:
    """Start-up errors from rank processes: one every rank gave is raised once as its own type; one some ranks gave
    names them; different ones are listed by rank in a RankError."""
    from moebius.worker.launch import RankError, startup_error

    def err(rank: int, kind: str = "ConfigError", message: str = "no usable KV page") -> dict[str, object]:
        return {"rank": rank, "type": kind, "message": message}

    e = startup_error([err(0), err(1)], 2)
    assert type(e) is ConfigError and str(e) == "no usable KV page"
    e = startup_error([err(1, "ValueError", "bad")], 2)
    assert type(e) is ValueError and str(e) == "rank 1: bad"
    e = startup_error([err(0, "KeyError", "'x'"), err(2, "KeyError", "'x'")], 4)
    assert type(e) is RankError and str(e) == "ranks 0, 2: KeyError: 'x'"
    e = startup_error([err(0), err(1, "OSError", "disk")], 2)
    assert type(e) is RankError and str(e) == "rank 0: ConfigError: no usable KV page; rank 1: OSError: disk"
