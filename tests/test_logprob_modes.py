"""--logprobs-mode (vLLM's names) and the trainer-engine mismatch: a sampled token's log-probability from the engine
against transformers' forward over the same sequence (the trainer's computation), fp32 on CPU: raw_logprobs is
log_softmax(logits), processed_logprobs log_softmax(logits / T) with the top-k / top-p cut (-inf outside),
raw_logits / processed_logits the logits themselves; the mismatch stays below a stated bound in TP, EP and across
live switches."""

from __future__ import annotations

import importlib.util
import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from conftest import VOCAB, hf_logits, import_tool, make_llm, shared_llm

from moebius import LLM, SamplingParams
from moebius.bench import results
from moebius.config import ConfigError

# fp32 engine vs fp32 transformers: the same math summed in another order (measured: ~1e-6 mean, ~5e-6 max)
FP32_BOUND = 1e-4


def _prompts(seed: int, lens: tuple[int, ...]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(n)] for n in lens]


def expected(path: str, prompt: list[int], tokens: list[int], mode: str, temperature: float, top_k: int
             ) -> torch.Tensor:
    """transformers' value of each output token under `mode` ([n] float32)."""
    logits = hf_logits(path, prompt + tokens[:-1])[len(prompt) - 1:]  # the rows that predicted each output token
    if mode.startswith("processed"):
        logits = logits / temperature
        if top_k > 0:
            kth = logits.topk(top_k, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
    values = logits if mode.endswith("_logits") else torch.log_softmax(logits, dim=-1)
    return values.gather(1, torch.tensor(tokens)[:, None]).squeeze(1)


def engine_values(out: Any) -> torch.Tensor:
    c = out.outputs[0]
    return torch.tensor([lp[t] for lp, t in zip(c.logprobs, c.token_ids, strict=True)])


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits"])
@pytest.mark.parametrize("top_k", [-1, 5])
def test_logprobs_mode_matches_transformers(ckpt: Any, mode: str, top_k: int) -> None:
    """temperature 0.5 (and top_k 5): each mode's value of the sampled token equals transformers' at that
    position; raw values do not depend on the temperature, processed ones do (and differ from raw)."""
    path = ckpt("base")
    llm = shared_llm(path, logprobs_mode=mode)
    prompts = _prompts(5, (4, 19))
    params = SamplingParams(temperature=0.5, top_k=top_k, seed=11, max_tokens=10, logprobs=2)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, o in zip(prompts, outs, strict=True):
        got = engine_values(o)
        want = expected(path, prompt, o.outputs[0].token_ids, mode, 0.5, top_k)
        torch.testing.assert_close(got, want, atol=FP32_BOUND, rtol=0)
        if mode.startswith("processed"):
            raw = expected(path, prompt, o.outputs[0].token_ids, mode.replace("processed", "raw"), 0.5, top_k)
            assert (got - raw).abs().max() > 1e-2, "processed values equal the raw ones"
        if mode.endswith("_logprobs"):  # the top ones too are log-probabilities of the same distribution
            assert all(v <= 1e-6 for lp in o.outputs[0].logprobs for v in lp.values())


def test_logprobs_mode_refuses_unknown_names(ckpt: Any) -> None:
    with pytest.raises(ConfigError, match="logprobs_mode='processed'"):
        make_llm(ckpt("base"), logprobs_mode="processed")


def mismatch(path: str, prompts: list[list[int]], outs: list[Any]) -> tuple[float, float]:
    """Mean and max |engine - transformers| over every sampled token's raw log-probability."""
    diffs = torch.cat([(engine_values(o) - expected(path, p, o.outputs[0].token_ids, "raw_logprobs", 1.0, -1)).abs()
                       for p, o in zip(prompts, outs, strict=True)])
    return float(diffs.mean()), float(diffs.max())


def test_mismatch_one_rank(ckpt: Any) -> None:
    path = ckpt("base")
    llm = shared_llm(path)
    prompts = _prompts(9, (3, 12, 30, 41))
    outs = llm.generate(prompts, SamplingParams(temperature=1.0, seed=2, max_tokens=12, logprobs=0), use_tqdm=False)
    mean, worst = mismatch(path, prompts, outs)
    print(f"trainer-engine mismatch, P=1 fp32: mean {mean:.2e}, max {worst:.2e}")
    assert worst < FP32_BOUND


@pytest.fixture(scope="module")
def p2(ckpt: Any) -> Iterator[LLM]:
    llm = make_llm(ckpt("tied_mha_nonorm"), num_ranks=2, mode="ep", block_size=4, max_total_tokens=1024,
                   max_running_requests=8, max_num_batched_tokens=16)
    yield llm
    llm.close()


@pytest.mark.slow
@pytest.mark.parametrize("switches", [(), (1, 3, 5, 8)], ids=["no_switch", "switches"])
@pytest.mark.parametrize("mode", ["tp", "ep"])
def test_mismatch_two_ranks(ckpt: Any, p2: LLM, mode: str, switches: tuple[int, ...]) -> None:
    """P = 2 in TP, in EP, and with live switches between steps while the requests run: the sampled tokens'
    log-probabilities stay within the fp32 bound of transformers'."""
    path = ckpt("tied_mha_nonorm")
    if p2.engine.mode != mode:
        assert p2.switch_mode(mode).done
    prompts = _prompts(13, (2, 9, 27, 35))
    params = SamplingParams(temperature=1.0, seed=4, max_tokens=12, logprobs=0)
    rids = [p2.add_request(p, params) for p in prompts]
    last: dict[str, Any] = {}
    step = 0
    while p2.has_unfinished():
        if step in switches:
            assert p2.switch_mode("tp" if p2.engine.mode == "ep" else "ep").done
        for o in p2.step():
            last[o.request_id] = o
        step += 1
    mean, worst = mismatch(path, prompts, [last[r] for r in rids])
    print(f"trainer-engine mismatch, P=2 {mode} switches={switches}: mean {mean:.2e}, max {worst:.2e}")
    assert worst < FP32_BOUND


def test_fp32_head_logits_unit() -> None:
    """qwen3_moe.logits with fp32: float32 logits of the bf16 weights as they are (the float32 product), where the
    model's dtype rounds them to bfloat16."""
    from types import SimpleNamespace

    from moebius.models.qwen3_moe import forward as qwen3_moe

    g = torch.Generator().manual_seed(0)
    h = torch.randn(5, 64, generator=g).bfloat16()
    w = SimpleNamespace(lm_head_VD=(torch.randn(300, 64, generator=g) * 0.3).bfloat16())
    exact = h.float() @ w.lm_head_VD.float().t()
    fp32 = qwen3_moe.logits(h, w, fp32=True)  # type: ignore[arg-type]
    plain = qwen3_moe.logits(h, w)  # type: ignore[arg-type]
    assert fp32.dtype == torch.float32 and plain.dtype == torch.bfloat16
    torch.testing.assert_close(fp32, exact, atol=1e-5, rtol=1e-5)
    assert (plain.float() - exact).abs().max() > 1e-3


def _bf16_mismatch(path: str, head: str, prompts: list[list[int]]) -> tuple[float, float, torch.Tensor]:
    llm = make_llm(path, dtype="bfloat16", lm_head_dtype=head)
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=1.0, seed=2, max_tokens=12, logprobs=0),
                            use_tqdm=False)
        scored = llm.generate(prompts[:1], SamplingParams(max_tokens=1, prompt_logits=True), use_tqdm=False)
    finally:
        llm.close()
    mean, worst = mismatch(path, prompts, outs)
    return mean, worst, scored[0].prompt_logits


def test_fp32_head_in_a_bf16_engine(ckpt: Any) -> None:
    """dtype bfloat16 on the CPU, against transformers' fp32 forward on the same sequences: with --lm-head-dtype
    float32 the logits come out of the head unrounded (not all bf16 values, as the bf16 head's are) and the
    sampled tokens' log-probabilities are no further from the trainer's (the bf16 weights and activations of the
    rest of the model dominate the mismatch of this tiny random model: measured mean ~0.15 both ways, the fp32 head
    a little closer)."""
    path = ckpt("base")
    prompts = _prompts(9, (3, 12, 30, 41))
    mean_16, worst_16, logits_16 = _bf16_mismatch(path, "auto", prompts)
    mean_32, worst_32, logits_32 = _bf16_mismatch(path, "float32", prompts)
    print(f"trainer-engine mismatch, P=1 bf16: mean {mean_16:.3e} max {worst_16:.3e}; fp32 head: mean "
          f"{mean_32:.3e} max {worst_32:.3e}")
    assert torch.equal(logits_16, logits_16.bfloat16().float())
    assert not torch.equal(logits_32, logits_32.bfloat16().float())
    assert mean_32 <= mean_16


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fp32_head_on_the_gpu(ckpt: Any) -> None:
    """bf16 on the GPU (graphs replayed): with --lm-head-dtype float32 the head's matmul returns float32 logits
    (not all bf16 values); the mismatch of both against transformers' fp32 forward is recorded."""
    path = ckpt("base")
    prompts = _prompts(9, (3, 12, 30, 41))
    got = {}
    for head in ("auto", "float32"):
        with LLM(path, device="cuda", dtype="bfloat16", lm_head_dtype=head, block_size=16, max_total_tokens=4096,
                 warmup="none", cuda_graph_max_bs=8) as llm:
            outs = llm.generate(prompts, SamplingParams(temperature=1.0, seed=2, max_tokens=12, logprobs=0),
                                use_tqdm=False)
            scored = llm.generate(prompts[:1], SamplingParams(max_tokens=1, prompt_logits=True), use_tqdm=False)
            got[head] = (*mismatch(path, prompts, outs), scored[0].prompt_logits)
    print("trainer-engine mismatch, GPU bf16 (mean, max):", {h: v[:2] for h, v in got.items()})
    assert torch.equal(got["auto"][2], got["auto"][2].bfloat16().float())
    assert not torch.equal(got["float32"][2], got["float32"][2].bfloat16().float())
    assert got["float32"][0] <= got["auto"][0] * 1.05


def test_mismatch_benchmark_harness(tmp_path: Any) -> None:
    """benchmarks/rl/logprob_mismatch.py on the CPU with tiny shapes in float32 (engine and trainer alike): the
    sampled tokens line up with transformers' rows (mismatch within the fp32 bound), the head scaled to the target
    entropy gives non-degenerate distributions, and the result file holds the tables."""
    tool = import_tool("rl/logprob_mismatch.py")
    out = tmp_path / "mismatch.json"
    args = tool.parser().parse_args(["--device", "cpu", "--tiny", "--num-layers", "1", "--dtype", "float32",
                                     "--heads", "bf16", "--set", "vocab_size=2048", "--prompt-lens", "3", "20",
                                     "--prompts-per-len", "1", "--max-tokens", "8", "--output", str(out)])
    tool.run(args)
    r = results.load_result(str(out))
    (row,) = results.table(r, "mismatch")
    assert (row["engine_head"], row["reference"], row["tokens"]) == ("bf16", "hf_fp32", 16)
    assert row["max_abs"] < FP32_BOUND
    s = results.summary_of(r)
    assert s["entropy_ok"] and abs(s["calib_entropy_after"] - 2.0) < 0.01 and 0.5 < s["entropy_mean"] < 4
    assert [x["prompt_len"] for x in results.table(r, "per_length")] == [3, 20]
    # (the plot needs the bench extra's matplotlib, which CI does not install)
    assert (tmp_path / "mismatch.png").is_file() == (importlib.util.find_spec("matplotlib") is not None)
