"""The transformers baseline of the benchmarks (moebius/bench/hf_baseline.py) builds the model class the config.json
names, for every family: DeepSeek-V2 (MLA) and Qwen3-MoE through continuous batching and eager decode, on the CPU."""

from __future__ import annotations

import random
from typing import Any

import pytest
from conftest import BASE_CONFIG, DEEPSEEK_V2_CONFIG

from moebius.bench.hf_baseline import BaselineSpec, hf_model_class, run_one_gpu, run_tensor_parallel, run_throughput

VOCAB = 512
DEEPSEEK_V2 = {**DEEPSEEK_V2_CONFIG, "vocab_size": VOCAB, "architectures": ["DeepseekV2ForCausalLM"],
               "model_type": "deepseek_v2"}
QWEN3 = {**BASE_CONFIG, "vocab_size": VOCAB, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe"}


def _jobs(n: int, seed: int) -> list[tuple[list[int], int]]:
    """n requests of random prompts (3..20 tokens) and output lengths (2..6 tokens)."""
    rng = random.Random(seed)
    return [([rng.randrange(VOCAB) for _ in range(rng.randint(3, 20))], rng.randint(2, 6)) for _ in range(n)]


@pytest.mark.parametrize(("cfg_dict", "cls_name"), [(DEEPSEEK_V2, "DeepseekV2ForCausalLM"),
                                                    (QWEN3, "Qwen3MoeForCausalLM")])
def test_throughput_baseline_serves_every_request_through_the_named_class(cfg_dict: dict[str, Any],
                                                                          cls_name: str) -> None:
    jobs = _jobs(5, seed=1)
    r = run_throughput(cfg_dict, 2, jobs, warmup_requests=2)
    assert "error" not in r, r
    assert r["model"] == cls_name and r["attn_implementation"] == "sdpa" and r["method"] == "continuous batching"
    assert r["output_tokens"] == sum(n for _, n in jobs)  # no EOS: every request runs its whole length
    assert r["wall_s"] > 0 and r["requests_per_s"] == pytest.approx(len(jobs) / r["wall_s"])


def test_where_continuous_batching_fails_the_baseline_is_generate_in_static_batches(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers 5.17's continuous batching fails DeepSeek-V2's keys (and ran out of memory for gpt-oss-20b on an
    H100): the baseline is then its generate() in padded batches, every request its whole length, saying so and
    why."""
    from moebius.bench import hf_baseline

    def fails(*_: Any) -> None:
        raise RuntimeError("index_copy_(): Source/destination tensor must have same slice shapes")

    calls: list[int] = []
    generate = hf_baseline._serve_static

    def counted(model: Any, jobs: list[tuple[list[int], int]], dev: Any) -> tuple[float, int]:
        calls.append(len(jobs))
        return generate(model, jobs, dev)

    monkeypatch.setattr(hf_baseline, "_serve_cb", fails)
    monkeypatch.setattr(hf_baseline, "_serve_static", counted)
    monkeypatch.setattr(hf_baseline, "STATIC_BATCH", 3)
    jobs = _jobs(7, seed=3)
    r = run_throughput(DEEPSEEK_V2, 2, jobs, warmup_requests=2)
    assert "error" not in r, r
    assert r["method"].startswith("generate() in static batches of 3 (continuous batching failed: RuntimeError: "
                                  "index_copy_()")
    assert calls == [2, 7] and r["output_tokens"] == sum(n for _, n in jobs) and r["wall_s"] > 0
    assert run_throughput(QWEN3, 2, jobs[:2], warmup_requests=0)["method"] == "generate() in static batches of 3 " \
        "(continuous batching failed: RuntimeError: index_copy_(): Source/destination tensor must have same slice " \
        "shapes)"


def test_config_is_the_class_own_and_cut_to_the_asked_layers() -> None:
    import transformers

    cls, cfg = hf_model_class(DEEPSEEK_V2, 1)
    assert cls is transformers.DeepseekV2ForCausalLM and isinstance(cfg, transformers.DeepseekV2Config)
    assert cfg.num_hidden_layers == 1 and cfg.kv_lora_rank == 32 and cfg.qk_rope_head_dim == 8
    # a model_type transformers lacks on an architecture it has (Kimi-K2's): the architecture's own config
    cls, cfg = hf_model_class({**DEEPSEEK_V2, "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2"}, 2)
    assert cls is transformers.DeepseekV3ForCausalLM and isinstance(cfg, transformers.DeepseekV3Config)
    # no architectures: the model_type's causal-LM class
    cls, cfg = hf_model_class({k: v for k, v in QWEN3.items() if k != "architectures"}, 2)
    assert cls is transformers.Qwen3MoeForCausalLM and isinstance(cfg, transformers.Qwen3MoeConfig)


def test_a_model_transformers_lacks_is_a_clear_error_not_a_crash() -> None:
    unknown = {**DEEPSEEK_V2, "architectures": ["NoSuchMoeForCausalLM"], "model_type": "no_such_moe"}
    r = run_throughput(unknown, 2, _jobs(2, seed=2))
    assert set(r) == {"error"} and "no_such_moe" in r["error"], r
    spec = BaselineSpec(cfg_dict=unknown, num_layers=2, batches=[1, 2], context_len=8, steps=2, warmup=1)
    points = run_one_gpu(spec)
    assert [(p["mode"], p["batch"]) for p in points] == [("hf-eager-1gpu", 1), ("hf-cb-1gpu", 1),
                                                         ("hf-eager-1gpu", 2), ("hf-cb-1gpu", 2)]
    assert all("NoSuchMoeForCausalLM" in p["error"] for p in points), points


def test_sweep_baseline_times_deepseek_eager_and_continuous_batching() -> None:
    spec = BaselineSpec(cfg_dict=DEEPSEEK_V2, num_layers=2, batches=[2], context_len=16, steps=3, warmup=1)
    points = run_one_gpu(spec)
    assert [p["mode"] for p in points] == ["hf-eager-1gpu", "hf-cb-1gpu"]
    for p in points:
        assert "error" not in p, p
        assert p["batch"] == 2 and p["context_len"] == 16 and p["step_ms"] > 0 and p["floor_ms"] > 0
        assert p["model"] == "DeepseekV2ForCausalLM" and p["attn_implementation"] == "sdpa"


@pytest.mark.slow
def test_tensor_parallel_worker_shards_deepseek_by_its_own_plan() -> None:
    """Two gloo ranks under torch.distributed.run build DeepseekV2ForCausalLM, shard it by its tensor-parallel plan
    (MLA's kv_a projection, its experts) and time both modes."""
    spec = BaselineSpec(cfg_dict=DEEPSEEK_V2, num_layers=2, batches=[2], context_len=16, steps=3, warmup=1)
    points = run_tensor_parallel(spec, 2, timeout_s=300)
    assert [p["mode"] for p in points] == ["hf-eager-tp2", "hf-cb-tp2"]
    for p in points:
        assert "error" not in p, p
        assert p["batch"] == 2 and p["step_ms"] > 0 and p["model"] == "DeepseekV2ForCausalLM"
