"""benchmarks/models/greedy_agreement.py on the CPU with tiny DeepSeek-V2-Lite shapes: in float32 the engine's and
transformers' greedy tokens are the fp32 argmax at every position (agreement 1.0 at margin 0) and the result file
holds its tables; in bf16 it runs and its fractions are fractions. The margin scoring and the tiny shapes alone."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from conftest import import_tool

from moebius.bench import results
from moebius.config import PRESETS

LENS = [3, 20]
PER_LEN = 2
MAX_TOKENS = 8
POSITIONS = len(LENS) * PER_LEN * MAX_TOKENS


@pytest.fixture(scope="module")
def tool() -> Any:
    return import_tool("models/greedy_agreement.py")


def _run(tool: Any, out: Any, dtype: str) -> tuple[dict[str, Any], dict[str, Any]]:
    got = tool.main(["--device", "cpu", "--tiny", "--num-layers", "2", "--dtype", dtype, "--set", "vocab_size=8192",
                     "--prompt-lens", *map(str, LENS), "--per-len", str(PER_LEN), "--max-tokens", str(MAX_TOKENS),
                     "--output", str(out)])
    return got, results.load_result(str(out))


def test_float32_agrees_exactly_and_writes_the_tables(tool: Any, tmp_path: Any) -> None:
    got, r = _run(tool, tmp_path / "f32.json", "float32")
    assert results.table_names(r) == ["agreement", "per_length", "cdf", "summary"]
    rows = {x["system"]: x for x in results.table(r, "agreement")}
    assert set(rows) == {"engine", "transformers"}
    for row in rows.values():  # float32 both: every chosen token is the fp32 argmax
        assert row["positions"] == POSITIONS and row["dtype"] == "float32"
        assert row["exact_fraction"] == 1.0 and row["within_margin_fraction"] == 1.0
        assert row["max_margin"] == 0.0 and row["mean_margin"] == 0.0
    s = results.summary_of(r)
    assert s["engine_at_least_transformers"] and s["exact_engine_at_least_transformers"]
    assert s["identical_sequences"] == s["sequences"] == len(LENS) * PER_LEN
    assert s["entropy_ok"] and abs(s["calib_entropy_after"] - 2.0) < 0.01
    assert all(len(t) == MAX_TOKENS for seqs in got["seqs"].values() for t in seqs)
    per = results.table(r, "per_length")
    assert [(x["system"], x["prompt_len"]) for x in per] == [(y, n) for y in ("engine", "transformers") for n in LENS]
    assert all(x["positions"] == PER_LEN * MAX_TOKENS and x["exact_fraction"] == 1.0 for x in per)
    cdf = [x for x in results.table(r, "cdf") if x["system"] == "engine"]
    assert cdf[0]["margin"] == 0.0 and 0.1 in [x["margin"] for x in cdf] and all(x["fraction"] == 1.0 for x in cdf)
    assert r["params"]["preset"] == "deepseek-v2-lite" and r["params"]["overrides"]["kv_lora_rank"] == 32
    # (the plot needs the bench extra's matplotlib)
    assert (tmp_path / "f32.png").is_file() == (importlib.util.find_spec("matplotlib") is not None)


def test_bfloat16_runs_and_reports_fractions(tool: Any, tmp_path: Any) -> None:
    _, r = _run(tool, tmp_path / "bf16.json", "bfloat16")
    rows = {x["system"]: x for x in results.table(r, "agreement")}
    for row in rows.values():
        assert row["positions"] == POSITIONS and row["dtype"] == "bfloat16"
        assert 0.0 <= row["exact_fraction"] <= row["within_margin_fraction"] <= 1.0
        assert 0.0 <= row["mean_margin"] <= row["max_margin"]
    s = results.summary_of(r)
    assert s["engine_at_least_transformers"] == (rows["engine"]["within_margin_fraction"]
                                                 >= rows["transformers"]["within_margin_fraction"])
    for system in ("engine", "transformers"):  # the CDF rises to 1 and holds each row's fractions
        cdf = [x for x in results.table(r, "cdf") if x["system"] == system]
        fr = [x["fraction"] for x in cdf]
        assert fr == sorted(fr) and fr[0] == rows[system]["exact_fraction"] and fr[-1] <= 1.0
        assert next(x["fraction"] for x in cdf if x["margin"] == 0.1) == rows[system]["within_margin_fraction"]


class _FixedLogits(torch.nn.Module):
    """A 'model' whose logits at every position are one fixed row."""

    def __init__(self, row: list[float]) -> None:
        super().__init__()
        self.row = torch.tensor(row)

    def forward(self, input_ids: torch.Tensor, use_cache: bool, logits_to_keep: int) -> Any:
        return SimpleNamespace(logits=self.row.expand(1, logits_to_keep, -1))


def test_margin_is_the_gap_to_the_fp32_max(tool: Any) -> None:
    model = _FixedLogits([0.0, 3.0, 2.5, -1.0])
    got = tool.score(model, [0, 1], [1, 2, 3], "cpu")
    assert got["margin"].tolist() == [0.0, 0.5, 4.0] and got["gap"].tolist() == [0.5] * 3
    a = tool.agreement(got["margin"], got["gap"], got["entropy"], 0.5)
    assert a["positions"] == 3 and a["exact_fraction"] == pytest.approx(1 / 3)
    assert a["within_margin_fraction"] == pytest.approx(2 / 3) and a["max_margin"] == 4.0
    assert a["near_tie_fraction"] == 0.0 and tool.agreement(got["margin"], got["gap"], got["entropy"], 0.6)[
        "near_tie_fraction"] == 1.0


def test_tiny_shapes_keep_each_family_s_features(tool: Any) -> None:
    v2 = tool.tiny_shapes(PRESETS["deepseek-v2-lite"])
    assert "q_lora_rank" not in v2 and v2["num_key_value_heads"] == v2["num_attention_heads"]
    assert v2["kv_lora_rank"] == 32 and "n_group" not in v2 and "num_experts" not in v2
    v3 = tool.tiny_shapes(PRESETS["deepseek-v3"])
    assert v3["q_lora_rank"] and (v3["n_group"], v3["first_k_dense_replace"]) == (4, 1)
    assert v3["n_routed_experts"] % v3["n_group"] == 0 and 1 <= v3["topk_group"] < v3["n_group"]
    qwen = tool.tiny_shapes(PRESETS["qwen3-30b-a3b"])
    assert qwen == tool.lm.TINY  # the same smoke shapes as benchmarks/rl/logprob_mismatch.py's
