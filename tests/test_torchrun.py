"""The same entry under torchrun (env:// rendezvous, the multi-machine path): `moebius generate` on 2 ranks gives
the tokens of a single-process run, in both layouts."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from moebius import LLM, SamplingParams

PROMPTS = ["hello there", "the quick brown fox", "x"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["tp", "ep"])
def test_torchrun_two_ranks_match_single_process(mode: str, tmp_path: object) -> None:
    with LLM() as llm:
        want = [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12,
                                                                           ignore_eos=True))]
    out = f"{tmp_path}/out.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(_port()), "-m", "moebius.entrypoints.cli", "generate", "--mode", mode,
           "--max-tokens", "12", "--ignore-eos", "--no-progress", "--output", out, *PROMPTS]
    run = subprocess.run(cmd, timeout=180, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-4000:]
    with open(out) as f:
        got = [json.loads(line)["outputs"][0]["token_ids"] for line in f]
    assert got == want
