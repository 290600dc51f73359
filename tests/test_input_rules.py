"""One rule for bad input on the API, the engine flags and the admin port: a clear error naming what is wrong (never
a comparison or iteration error from deep inside), and nothing left running or printing tracebacks."""

from __future__ import annotations

import http.client
import socket
import subprocess
import sys
from typing import Any

import pytest
import torch

from moebius import LLM, SamplingParams
from moebius.config import ConfigError, EngineConfig

BAD_SAMPLING = [
    ({"temperature": float("nan")}, "temperature"), ({"temperature": "1"}, "temperature"),
    ({"temperature": -0.5}, "temperature"), ({"top_p": "0.5"}, "top_p"), ({"top_p": 0.0}, "top_p"),
    ({"top_p": float("inf")}, "top_p"), ({"top_k": 1.5}, "top_k"), ({"top_k": -2}, "top_k"), ({"n": True}, "n"),
    ({"n": 0}, "n"), ({"max_tokens": True}, "max_tokens"), ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 2.0}, "max_tokens"), ({"min_tokens": "3"}, "min_tokens"), ({"seed": True}, "seed"),
    ({"seed": 1.0}, "seed"), ({"stop": 123}, "stop"), ({"stop": [""]}, "stop"), ({"stop": ["a", 5]}, "stop"),
    ({"stop_token_ids": 5}, "stop_token_ids"), ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"ignore_eos": 1}, "ignore_eos"), ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
]


@pytest.mark.parametrize("kwargs,field", BAD_SAMPLING, ids=[f"{k}" for k, _ in BAD_SAMPLING])
def test_bad_sampling_params_name_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


BAD_FLAGS = [({"num_ranks": "2"}, "num_ranks"), ({"block_size": "16"}, "block_size"), ({"cpu_threads": 0}, "cpu"),
             ({"mem_fraction": float("nan")}, "mem_fraction"), ({"admin_port": 70000}, "admin_port"),
             ({"disable_pdl": 1}, "disable_pdl"), ({"model": 5}, "model"), ({"switch_window": 0}, "switch_window"),
             ({"switch_high": 2, "switch_low": 3}, "switch_low"), ({"mode": "dp"}, "mode"),
             ({"watchdog_timeout": -1}, "watchdog_timeout"), ({"warmup": "some"}, "warmup"),
             ({"cuda_graph_max_bs": 0}, "cuda_graph_max_bs"), ({"cuda_graph_max_tokens": -1}, "cuda_graph_max_tokens"),
             ({"plans_ahead": 3}, "plans_ahead"), ({"plans_ahead": 0}, "plans_ahead")]


@pytest.mark.parametrize("kwargs,field", BAD_FLAGS, ids=[f"{k}" for k, _ in BAD_FLAGS])
def test_bad_engine_flags_name_the_flag(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        EngineConfig.from_kwargs(**kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="there is a GPU here")
def test_cuda_without_a_gpu_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="cuda"):
        LLM(device="cuda")


def test_bad_prompts_name_their_index() -> None:
    with LLM(device="cpu") as llm:
        with pytest.raises(TypeError, match="prompts must be"):
            llm.generate(42)
        with pytest.raises(ValueError, match=r"prompt 1: .*not valid text: character 1"):
            llm.generate(["ok", "a\udcffb"])
        with pytest.raises(TypeError, match="prompt 0: .*float"):
            llm.generate([1.5])
        with pytest.raises(ValueError, match="stop_token_ids 100000 is outside the vocabulary"):
            llm.generate([[1, 2, 3]], SamplingParams(min_tokens=2, stop_token_ids=[100000]))  # crashed a rank
        assert llm.generate("still fine", SamplingParams(max_tokens=2))[0].finished


def test_admin_port_errors_and_requests_that_would_hang() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        with pytest.raises(ConfigError, match="cannot listen"):
            LLM(device="cpu", admin_port=busy.getsockname()[1])
    with LLM(device="cpu", admin_port=0) as llm:
        assert llm.admin is not None
        port = llm.admin.port
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.putrequest("POST", "/admin/switch")
        conn.putheader("Content-Length", "100")  # announces more than it sends
        conn.endheaders(b'{"mode": "ep"}')
        r = conn.getresponse()
        assert r.status == 400 and b"Content-Length" in r.read()
        llm.step()  # a step boundary: nothing was queued
        assert llm.mode == "tp"
        for method in ("PUT", "DELETE"):
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            conn.request(method, "/admin/switch", body=b"{}")
            r = conn.getresponse()
            assert r.status == 405 and r.getheader("Content-Type") == "application/json", method


def test_an_engine_dropped_without_close_ends_its_ranks_quietly(tmp_path: Any) -> None:
    script = f"{tmp_path}/drop.py"
    with open(script, "w") as f:
        f.write("import gc, time\nfrom moebius import LLM, SamplingParams\nif __name__ == '__main__':\n"
                "    llm = LLM(num_ranks=2, mode='tp', device='cpu')\n"
                "    print(llm.generate('hi', SamplingParams(max_tokens=2))[0].finished)\n"
                "    del llm\n    gc.collect()\n    time.sleep(2)\n    print('after')\n")
    run = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=240)
    assert run.returncode == 0 and run.stdout.split() == ["True", "after"], run.stderr[-3000:]
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
