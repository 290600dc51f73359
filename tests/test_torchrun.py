"""The same entry under torchrun (env:// rendezvous, the multi-machine path): `moebius generate` on 2 ranks gives
the tokens of a single-process run, in both layouts."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from moebius import LLM, SamplingParams

PROMPTS = ["hello there", "the quick brown fox", "x"]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["tp", "ep"])
def test_torchrun_two_ranks_match_single_process(mode: str, tmp_path: object) -> None:
    with LLM() as llm:
        want = [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12,
                                                                           ignore_eos=True))]
    out = f"{tmp_path}/out.jsonl"
    # --standalone: torchrun's own rendezvous on a port the OS assigns when it binds (a port picked here and released
    # before torchrun binds it could be taken in between)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "moebius.entrypoints.cli", "generate", "--mode", mode,
           "--max-tokens", "12", "--temperature", "0", "--ignore-eos", "--no-progress", "--output", out, *PROMPTS]
    run = subprocess.run(cmd, timeout=180, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-4000:]
    with open(out) as f:
        lines = sorted((json.loads(line) for line in f), key=lambda r: r["index"])  # (written as they finish)
        got = [r["outputs"][0]["token_ids"] for r in lines]
    assert got == want
