"""Bad requests and bad model directories raise clear errors (ValueError / ConfigError / TypeError naming the
problem), and the engine keeps serving correctly afterwards."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
from conftest import PROMPTS, assert_kv_all_free, hf_greedy, make_llm, shared_llm
from safetensors.torch import load_file, save_file

from moebius.config import ConfigError
from moebius.sampling_params import SamplingParams

MAX_MODEL_LEN = 64
GOOD = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(ckpt):
    """The text checkpoint (has a tokenizer, so text prompts work) with a short context."""
    return shared_llm(ckpt("text"), block_size=4, max_model_len=MAX_MODEL_LEN)


def assert_still_works(llm, path: str) -> None:
    assert not llm.has_unfinished()
    assert_kv_all_free(llm)
    outs = llm.generate([PROMPTS[1], PROMPTS[2]], GOOD)
    assert [o.token_ids for o in outs] == [hf_greedy(path, p, 8) for p in (PROMPTS[1], PROMPTS[2])]
    assert all(o.finish_reason == "length" for o in outs)
    assert_kv_all_free(llm)


BAD_PROMPTS = [
    pytest.param("", r"empty", id="empty-str"),
    pytest.param([], r"empty", id="empty-ids"),
    pytest.param([i % 256 for i in range(MAX_MODEL_LEN + 1)], r"max_model_len", id="too-long"),
    pytest.param([i % 256 for i in range(3 * MAX_MODEL_LEN)], r"max_model_len", id="much-too-long"),
    pytest.param([5, 300], r"300.*vocab|vocab.*300", id="id-equal-vocab"),
    pytest.param([5, 10_000], r"10000.*vocab|vocab.*10000", id="id-beyond-vocab"),
    pytest.param([-1, 5], r"-1.*vocab|vocab.*-1", id="negative-id"),
]


@pytest.mark.parametrize("prompt,pattern", BAD_PROMPTS)
@pytest.mark.parametrize("api", ["generate", "add_request"])
def test_bad_prompt(ckpt, llm, api, prompt, pattern):
    with pytest.raises(ValueError) as excinfo:
        if api == "generate":
            # generate([]) is an empty batch (returns []), so an empty token-id prompt must be wrapped: [[]].
            llm.generate(prompt if prompt else [prompt], GOOD)
        else:
            llm.add_request(prompt, GOOD)
    assert re.search(pattern, str(excinfo.value), re.IGNORECASE), str(excinfo.value)
    assert_still_works(llm, ckpt("text"))


def test_bad_prompt_inside_a_batch_admits_nothing(ckpt, llm):
    """One bad prompt among good ones: the call fails and leaves no request behind."""
    with pytest.raises(ValueError, match="(?i)empty"):
        llm.generate([PROMPTS[1], [], PROMPTS[2]], GOOD)
    assert_still_works(llm, ckpt("text"))
    with pytest.raises(ValueError, match="(?i)vocab"):
        llm.generate([PROMPTS[1], PROMPTS[2], [1, 2, 999]], GOOD)
    assert_still_works(llm, ckpt("text"))


def test_sampling_params_list_length_mismatch(ckpt, llm):
    with pytest.raises(ValueError):
        llm.generate([PROMPTS[1], PROMPTS[2]], [GOOD, GOOD, GOOD])
    assert_still_works(llm, ckpt("text"))


BAD_PARAMS = [
    pytest.param(dict(max_tokens=0), "max_tokens", id="max_tokens-0"),
    pytest.param(dict(max_tokens=-3), "max_tokens", id="max_tokens-negative"),
    pytest.param(dict(temperature=-0.5), "temperature", id="temperature-negative"),
    pytest.param(dict(top_p=0.0), "top_p", id="top_p-0"),
    pytest.param(dict(top_p=1.5), "top_p", id="top_p-1.5"),
    pytest.param(dict(top_k=-2), "top_k", id="top_k-negative"),
    pytest.param(dict(n=0), "n must", id="n-0"),
    pytest.param(dict(min_tokens=10, max_tokens=5), "min_tokens", id="min_tokens-gt-max"),
    pytest.param(dict(stop=[""]), "stop", id="empty-stop-string"),
]


@pytest.mark.parametrize("kw,pattern", BAD_PARAMS)
def test_bad_sampling_params(ckpt, llm, kw, pattern):
    with pytest.raises(ValueError, match=pattern):
        SamplingParams(**kw)
    assert_still_works(llm, ckpt("text"))


def test_unknown_llm_kwarg():
    from moebius import LLM

    with pytest.raises(TypeError, match="no_such_option"):
        LLM(model="/nonexistent", no_such_option=1)


@pytest.mark.parametrize("kw,pattern", [
    pytest.param(dict(block_size=3), "block_size", id="block_size-not-pow2"),
    pytest.param(dict(max_num_batched_tokens=0), "max_num_batched_tokens", id="batched-tokens-0"),
    pytest.param(dict(dtype="float64"), "dtype", id="bad-dtype"),
    pytest.param(dict(max_model_len=100_000), "max_model_len|max_position_embeddings", id="max_model_len-too-big"),
    pytest.param(dict(prefill_attention="flash"), "prefill-attention flash on cpu: not a CUDA device",
                 id="flash-attention-on-cpu"),
    pytest.param(dict(prefill_attention="cudnn"), "prefill_attention", id="bad-prefill-attention"),
])
def test_bad_engine_options(ckpt, kw, pattern):
    with pytest.raises(ValueError, match=pattern):
        make_llm(ckpt("base"), **kw)


def test_unknown_model_path(tmp_path):
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(ValueError, match=re.escape(missing)):
        make_llm(missing)


# ---------------------------------------------------------------------------------------------------------------
# Broken checkpoints
# ---------------------------------------------------------------------------------------------------------------

def _rewrite_tensors(path: str, edit) -> None:
    f = os.path.join(path, "model.safetensors")
    tensors = load_file(f)
    edit(tensors)
    save_file(tensors, f, metadata={"format": "pt"})


@pytest.mark.parametrize("name", [
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.2.mlp.experts.5.down_proj.weight",
    "model.layers.1.mlp.gate.weight",
    "model.norm.weight",
    "lm_head.weight",
])
def test_missing_tensor_is_named(ckpt, name):
    path = ckpt.copy("base", "missing-" + name)
    _rewrite_tensors(path, lambda t: t.pop(name))
    with pytest.raises(ValueError, match=re.escape(name)):
        make_llm(path)


@pytest.mark.parametrize("name,shape", [
    ("model.layers.1.self_attn.k_proj.weight", (16, 64)),
    ("model.layers.0.mlp.experts.3.up_proj.weight", (32, 65)),
    ("model.embed_tokens.weight", (299, 64)),
])
def test_misshaped_tensor_is_named(ckpt, name, shape):
    path = ckpt.copy("base", "misshaped-" + name)

    def edit(t):
        t[name] = torch.zeros(shape)

    _rewrite_tensors(path, edit)
    with pytest.raises(ValueError, match=re.escape(name)):
        make_llm(path)


def test_missing_shard_file(ckpt):
    path = ckpt.copy("base_sharded", "missing-shard")
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    shard = weight_map["model.layers.1.self_attn.q_proj.weight"]
    os.remove(os.path.join(path, shard))
    names = [re.escape(shard)] + [re.escape(k) for k, v in weight_map.items() if v == shard]
    with pytest.raises(ValueError, match="|".join(names)):
        make_llm(path)


def test_no_weight_files(ckpt):
    path = ckpt.copy("base", "no-weights")
    os.remove(os.path.join(path, "model.safetensors"))
    with pytest.raises(ValueError, match="(?i)safetensors"):
        make_llm(path)


def _edit_config(path: str, **changes) -> None:
    f = os.path.join(path, "config.json")
    with open(f) as fh:
        cfg = json.load(fh)
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    with open(f, "w") as fh:
        json.dump(cfg, fh)


YARN = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0, "original_max_position_embeddings": 128}


@pytest.mark.parametrize("changes,pattern", [
    pytest.param(dict(architectures=["LlamaForCausalLM"], model_type="llama"), "LlamaForCausalLM", id="llama"),
    pytest.param(dict(rope_parameters=YARN), "yarn", id="yarn-rope_parameters"),
    pytest.param(dict(rope_parameters=None, rope_theta=10000.0, rope_scaling={"type": "yarn", "factor": 4.0}),
                 "yarn", id="yarn-rope_scaling"),
    pytest.param(dict(hidden_act="gelu"), "hidden_act|gelu", id="gelu"),
    pytest.param(dict(use_sliding_window=True, sliding_window=16), "(?i)sliding", id="sliding-window"),
])
def test_unsupported_config(ckpt, changes, pattern):
    path = ckpt.copy("base", "config-" + "-".join(changes))
    _edit_config(path, **changes)
    with pytest.raises(ConfigError, match=pattern):
        make_llm(path)


def test_missing_config_json(ckpt):
    path = ckpt.copy("base", "no-config")
    os.remove(os.path.join(path, "config.json"))
    with pytest.raises(ValueError, match="config.json"):
        make_llm(path)


def test_engine_still_works_after_load_failures(ckpt, llm):
    """Failed constructions leave no global state behind: a new engine and the existing one both work."""
    path = ckpt.copy("base", "load-fail-then-ok")
    _edit_config(path, architectures=["LlamaForCausalLM"])
    with pytest.raises(ConfigError):
        make_llm(path)
    base = ckpt("base")
    fresh = make_llm(base, block_size=4)
    assert fresh.generate(PROMPTS[2], GOOD)[0].token_ids == hf_greedy(base, PROMPTS[2], 8)
    assert_still_works(llm, ckpt("text"))


@pytest.mark.parametrize("mode", ["dp", "", "TP"])
def test_unknown_switch_target_is_rejected_before_anything_moves(llm, ckpt, mode: str) -> None:
    """Both switch entry points name the bad layout; a rejected request_switch leaves no switch pending."""
    last = llm.engine.last_switch
    with pytest.raises(ValueError, match="mode must be 'tp' or 'ep'"):
        llm.switch_mode(mode)
    with pytest.raises(ValueError, match="mode must be 'tp' or 'ep'"):
        llm.engine.request_switch(mode)
    before = llm.mode
    llm.step()  # the step a pending switch would ride on
    assert llm.mode == before and llm.engine.last_switch is last
    assert_still_works(llm, ckpt("text"))


def test_switch_without_memory_for_staging_is_refused_before_anything_moves(llm, ckpt, monkeypatch) -> None:
    """The switch takes one layer of expert staging before it changes anything: a device that cannot give it
    refuses the switch with the reason, the engine serves on in its layout, and a later switch goes through."""
    from moebius.switch import executor

    def no_memory(*_: object) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 402.00 MiB\nmore detail")

    before_mode = llm.mode
    target = "ep" if before_mode == "tp" else "tp"
    before = llm.engine.query("fingerprint")
    with monkeypatch.context() as m:
        m.setattr(executor, "staging_like", no_memory)
        out = llm.switch_mode(target)
    assert out.done is False, out
    assert re.search(r"staging.*rank 0: CUDA out of memory. Tried to allocate 402.00 MiB\)$", out.reason), out
    assert llm.mode == before_mode and llm.engine.query("fingerprint") == before
    assert_still_works(llm, ckpt("text"))
    assert llm.switch_mode(target).done is True
    assert_still_works(llm, ckpt("text"))
    assert llm.switch_mode(before_mode).done is True


@pytest.mark.slow
def test_a_script_without_the_main_guard_is_told_to_add_it(tmp_path: object) -> None:
    """Spawned rank processes import the user's script again; one that builds a multi-rank engine at import time
    gets an error naming the fix, not only 'rank process exited'."""
    import subprocess
    import sys

    script = os.path.join(str(tmp_path), "no_guard.py")
    with open(script, "w") as f:
        f.write("from moebius import LLM\nllm = LLM(num_ranks=2)\nllm.close()\n")
    run = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=240)
    assert run.returncode != 0
    assert 'if __name__ == "__main__":' in run.stderr, run.stderr[-3000:]
