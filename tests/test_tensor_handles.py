"""Tensors by handle (`moebius/link/tensor_handles.py`): the plain description of named tensors (CUDA IPC handles,
CPU tensors in shared memory) round-trips and is checked field by field; `LLM.update_weights_from_handles` with the
rank in process and in a process of its own moves the engine from checkpoint A to B (greedy tokens equal a fresh
engine's on B) and `LLM.update_weights` with a rank process goes the same way; tensors exported on another host are
refused naming why; `POST /update_weights_from_tensor` from a client process that has only torch (it loads the
module by path, every other package blocked) updates a served engine to B, a caller not on loopback is refused
(403), bad bodies are 400s that change nothing, and the API key is asked for. GPU (marked `gpu`): a second process
exports CUDA tensors (views of one flat bucket: one IPC handle) and the engine, rank in process and in a process of
its own, updates from them to B's tokens; then `update_weights` with this process's CUDA tensors goes back to A's.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from conftest import PROMPTS, Checkpoints, free_port, make_llm, shared_llm
from safetensors.torch import load_file

from moebius import SamplingParams
from moebius.link import tensor_handles
from moebius.link.tensor_handles import check_description, check_segment, export_tensors, open_tensors

N = 8
GREEDY = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)
IDS = PROMPTS[1:3]  # 5 and 17 tokens
KEY = "handles-key"


def tokens(llm: Any) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(IDS, GREEDY)]


@pytest.fixture(scope="module")
def paths(ckpt: Checkpoints) -> dict[str, str]:
    return {"A": ckpt("base"), "B": ckpt("base_b")}


@pytest.fixture(scope="module")
def want(paths: dict[str, str]) -> dict[str, list[list[int]]]:
    """Fresh engines' greedy tokens on A and on B."""
    out = {k: tokens(shared_llm(p)) for k, p in paths.items()}
    assert out["A"] != out["B"]
    return out


def weights(path: str) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(path, "model.safetensors"))


# ---- the description ----
def test_cpu_tensors_round_trip_through_shared_memory() -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    given = {"a": base, "b.t": base.t(), "c": torch.randn(5, dtype=torch.float32).to(torch.bfloat16),
             "d": torch.tensor(3.5, dtype=torch.float16)}
    with export_tensors(given.items()) as description:
        assert json.loads(json.dumps(description)) == description  # plain JSON: nothing pickled
        assert all("offset" in t and "cuda" not in t for t in description["tensors"])
        opened, _ = open_tensors(json.loads(json.dumps(description)))
        assert list(opened) == list(given)
        for name, t in given.items():
            assert opened[name].dtype == t.dtype and torch.equal(opened[name], t)
        segment = description["segment"]
        assert os.path.exists(os.path.join(tensor_handles.SHM_DIR, segment))
    assert not os.path.exists(os.path.join(tensor_handles.SHM_DIR, segment))  # close() unlinked it
    with pytest.raises(ValueError, match=f"no shared-memory segment {segment} on"):
        check_segment(description)
    with pytest.raises(ValueError, match="tensor m is on meta: only CPU and CUDA tensors can be exported"):
        export_tensors({"a": base, "m": torch.empty(2, device="meta")})
    with pytest.raises(ValueError, match="tensor a is given twice"):
        export_tensors([("a", base), ("a", base)])


def _described(**changes: Any) -> dict[str, Any]:
    """A description with one tensor in a segment and one by CUDA IPC handle, with `changes`: `t_x` in the first
    tensor, `cuda_x` in the second one's cuda, `st_x` in its storage, else at the top."""
    d = {"format": tensor_handles.FORMAT, "host": "h", "segment": "psm_1",
         "storages": [{"gpu_uuid": "GPU-x", "device": 0, "handle": "AAAA", "storage_size": 24,
                       "storage_offset_bytes": 0, "ref_counter": "AAAA", "ref_counter_offset": 0,
                       "event_handle": "AAAA", "event_sync_required": False}],
         "tensors": [{"name": "v", "dtype": "float32", "shape": [4], "offset": 0},
                     {"name": "w", "dtype": "float32", "shape": [2, 3],
                      "cuda": {"storage": 0, "stride": [3, 1], "storage_offset": 0}}]}
    for key, value in changes.items():
        where, _, field = key.partition("_")
        target = {"t": d["tensors"][0], "cuda": d["tensors"][1]["cuda"], "st": d["storages"][0]}.get(where)
        if target is None:
            d[key] = value
        else:
            target[field] = value
    return d


@pytest.mark.parametrize(("changes", "message"), [
    ({"format": "sglang"}, "format must be 'moebius.tensors.v1'"),
    ({"segment": "../../etc/passwd"}, "segment must be a shared-memory name"),
    ({"segment": None}, "tensor v lies in the segment, but the description names none"),
    ({"tensors": []}, "tensors must be a non-empty list"),
    ({"t_dtype": "Tensor"}, "tensor v: dtype must be a torch dtype name"),
    ({"t_dtype": "no_such"}, "tensor v: dtype must be a torch dtype name"),
    ({"t_shape": [4, -1]}, "tensor v: shape must be a list of non-negative integers"),
    ({"t_offset": 6}, "tensor v: offset must be a non-negative multiple of its element size"),
    ({"t_name": "w"}, "tensor w is given twice"),
    ({"t_cuda": {}}, "tensor v needs exactly one of 'offset'"),
    ({"st_handle": "not base64!"}, "storages[0].handle is not base64"),
    ({"st_device": "0"}, "storages[0].device must be int"),
    ({"st_event_sync_required": 1}, "storages[0].event_sync_required must be bool"),
    ({"storages": {}}, "storages must be a list"),
    ({"cuda_storage": 1}, "tensor w: cuda.storage must index storages (of 1)"),
    ({"cuda_stride": [3]}, "tensor w: cuda.stride must be a list of integers, one a dimension"),
    ({"cuda_storage_offset": 1}, "reach past its storage of 24 bytes"),
])
def test_bad_descriptions_are_refused_naming_the_field(changes: dict[str, Any], message: str) -> None:
    check_description(_described())
    with pytest.raises(ValueError) as refused:
        check_description(_described(**changes))
    assert message in str(refused.value)


# ---- the engine ----
@pytest.mark.parametrize("rank_process", ["off", "on"])
def test_update_from_handles_gives_b(paths: dict[str, str], want: dict[str, list[list[int]]],
                                     rank_process: str) -> None:
    llm = make_llm(paths["A"], rank_process=rank_process)
    try:
        with export_tensors(weights(paths["B"])) as description:
            outcome = llm.update_weights_from_handles(description, "B")
        assert outcome.views > 0 and tokens(llm) == want["B"]
        # a bad name, and a description from another machine: refused naming why, the weights stay B's
        with export_tensors({"model.nope.weight": torch.zeros(3)}) as description:
            with pytest.raises(ValueError, match="model.nope.weight"):
                llm.update_weights_from_handles(description)
        a = weights(paths["A"])
        with export_tensors({"model.norm.weight": a["model.norm.weight"]}) as description:
            elsewhere = {**description, "host": "another-machine"}
            with pytest.raises(RuntimeError, match="exported on host 'another-machine'.*one machine only"):
                llm.update_weights_from_handles(elsewhere)
        assert tokens(llm) == want["B"] and llm.weight_version == "B"
        if rank_process == "on":  # update_weights itself: its tensors go to the rank process by description
            llm.update_weights(a.items(), "A")
            assert tokens(llm) == want["A"]
    finally:
        llm.close()


# ---- POST /update_weights_from_tensor ----
CLIENT = textwrap.dedent("""
    import importlib.abc, importlib.util, json, sys, urllib.request
    BLOCKED = {"moebius", "transformers", "safetensors", "fastapi", "starlette", "pydantic", "httpx", "uvicorn",
               "requests"}

    class Block(importlib.abc.MetaPathFinder):  # this client has torch and the standard library only
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ImportError(f"{name} is not installed for this client")
            return None

    sys.meta_path.insert(0, Block())
    import torch
    module_path, tensors_path, url, key = sys.argv[1:]
    spec = importlib.util.spec_from_file_location("tensor_handles", module_path)
    th = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(th)
    tensors = torch.load(tensors_path, weights_only=True)
    with th.export_tensors(tensors) as description:
        body = json.dumps({"named_tensors": description, "weight_version": "B"}).encode()
        req = urllib.request.Request(url + "/update_weights_from_tensor", body, method="POST", headers={
            "Content-Type": "application/json", "Authorization": "Bearer " + key})
        with urllib.request.urlopen(req, timeout=120) as r:
            print(json.dumps({"status": r.status, "body": json.loads(r.read()),
                              "segment": description["segment"]}))
""")


@pytest.fixture(scope="module")
def served(paths: dict[str, str]) -> Iterator[tuple[str, Any, Any]]:
    """An engine on A behind the app, served from this process with an API key, its rank in a process of its own
    as under `moebius serve` (the rank maps the client's segment itself): the URL, the app, the LLM."""
    from test_serve import uvicorn_thread

    from moebius.entrypoints.openai.app import ServeSettings, create_app
    from moebius.entrypoints.openai.engine_loop import EngineLoop
    from moebius.entrypoints.openai.server import uvicorn_config

    llm = make_llm(paths["A"], rank_process="on")
    loop = EngineLoop(llm.engine)
    loop.start()
    app = create_app(loop, ServeSettings("moebius-demo", api_key=KEY))
    port = free_port()
    try:
        with uvicorn_thread(uvicorn_config(app, "127.0.0.1", port, access_log=False)):
            yield f"http://127.0.0.1:{port}", app, llm
    finally:
        loop.stop()


def served_tokens(url: str) -> list[list[int]]:
    import httpx

    out = []
    for ids in IDS:
        r = httpx.post(url + "/generate", json={"input_ids": ids, "sampling_params": {
            "max_new_tokens": N, "temperature": 0, "ignore_eos": True}}, headers={"Authorization": f"Bearer {KEY}"},
                       timeout=60)
        assert r.status_code == 200, r.text
        out.append(r.json()["output_ids"])
    return out


def served_generation(url: str) -> Any:
    """A long /generate in flight (its future), once the engine has it."""
    import concurrent.futures

    import httpx

    body = {"input_ids": IDS[0], "sampling_params": {"max_new_tokens": 300, "temperature": 0, "ignore_eos": True}}
    pool = concurrent.futures.ThreadPoolExecutor(1)
    future = pool.submit(lambda: httpx.post(url + "/generate", json=body, timeout=120,
                                            headers={"Authorization": f"Bearer {KEY}"}).json())
    pool.shutdown(wait=False)
    deadline = time.monotonic() + 30
    while not served_running(url) and time.monotonic() < deadline:
        time.sleep(0.01)
    return future


def served_running(url: str) -> bool:
    import httpx

    r = httpx.get(url + "/admin/status", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    return r.json().get("running", 0) > 0


def asgi_post(app: Any, body: Any, client: tuple[str, int] = ("127.0.0.1", 5000), key: str | None = KEY) -> Any:
    import httpx

    async def post() -> Any:
        transport = httpx.ASGITransport(app=app, client=client)
        async with httpx.AsyncClient(transport=transport, base_url="http://moebius") as c:
            return await c.post("/update_weights_from_tensor", json=body,
                                headers={"Authorization": f"Bearer {key}"} if key else {})
    return asyncio.run(post())


def test_route_refuses_other_callers_and_bad_bodies(served: tuple[str, Any, Any], paths: dict[str, str],
                                                    want: dict[str, list[list[int]]]) -> None:
    url, app, _ = served
    before = served_tokens(url)
    norm = {"model.norm.weight": weights(paths["B"])["model.norm.weight"]}
    with export_tensors(norm) as good:
        r = asgi_post(app, {"named_tensors": good}, client=("10.0.0.1", 123))
        assert r.status_code == 403 and "came from 10.0.0.1" in r.json()["error"]["message"]
        r = asgi_post(app, {"named_tensors": {"format": 1}}, client=("10.0.0.1", 123))  # refused before the body
        assert r.status_code == 403
        assert asgi_post(app, {"named_tensors": good}, key=None).status_code == 401
        bad = [({"serialized_named_tensors": ["gASV"]}, "pickled tensors are never read: send named_tensors"),
               ({}, "named_tensors is required"),
               ({"named_tensors": good, "load_format": "flattened_bucket"}, "direct or null"),
               ({"named_tensors": {**good, "format": "x"}}, "format must be"),
               ({"named_tensors": {**good, "segment": "../x"}}, "segment must be a shared-memory name"),
               ({"named_tensors": {**good, "tensors": [{**good["tensors"][0], "name": "model.nope"}]}},
                "model.nope"),
               ({"named_tensors": {**good, "tensors": [{**good["tensors"][0], "shape": [3]}]}},
                "has shape (3,)"),
               ({"named_tensors": {**good, "segment": "moebius-no-such-segment"}},
                "no shared-memory segment moebius-no-such-segment")]
        for body, message in bad:
            r = asgi_post(app, body)
            assert r.status_code == 400 and message in r.text, (body, r.text)
        # abort_all_requests with a bad name: refused before any request is aborted
        wrong = {**good, "tensors": [{**good["tensors"][0], "name": "model.nope"}]}
        generating = served_generation(url)
        r = asgi_post(app, {"named_tensors": wrong, "abort_all_requests": True})
        assert r.status_code == 400 and "model.nope" in r.text, r.text
        assert generating.result(timeout=120)["meta_info"]["finish_reason"]["type"] == "length"
    assert served_tokens(url) == before == want["A"]  # nothing changed


def test_route_updates_from_a_client_with_only_torch(served: tuple[str, Any, Any], paths: dict[str, str],
                                                     want: dict[str, list[list[int]]], tmp_path: Any) -> None:
    url, _, llm = served
    tensors = str(tmp_path / "b.pt")
    torch.save(weights(paths["B"]), tensors)
    run = subprocess.run([sys.executable, "-c", CLIENT, tensor_handles.__file__, tensors, url, KEY],
                         capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr
    reply = json.loads(run.stdout.strip().splitlines()[-1])
    assert reply["status"] == 200 and reply["body"]["success"] and reply["body"]["weight_version"] == "B"
    assert not os.path.exists(os.path.join(tensor_handles.SHM_DIR, reply["segment"]))  # the client unlinked it
    assert served_tokens(url) == want["B"] and llm.engine.weight_version == "B"


# ---- GPU: CUDA IPC from another process ----
EXPORTER = textwrap.dedent("""
    import importlib.util, json, sys, torch
    spec = importlib.util.spec_from_file_location("tensor_handles", sys.argv[2])
    th = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(th)
    tensors = {n: t.to("cuda") for n, t in torch.load(sys.argv[1], weights_only=True).items()}
    # one flat bucket as trainers send: every tensor a view of one storage (one IPC handle for all)
    flat = torch.cat([t.reshape(-1) for t in tensors.values()])
    views, at = {}, 0
    for n, t in tensors.items():
        views[n] = flat[at: at + t.numel()].view(t.shape)
        at += t.numel()
    with th.export_tensors(views) as description:
        print(json.dumps(description), flush=True)
        sys.stdin.readline()  # kept alive until the engine is done
""")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("rank_process", ["off", "on"])
def test_cuda_ipc_update_from_another_process(paths: dict[str, str], tmp_path: Any, rank_process: str) -> None:
    cuda = {"device": "cuda", "max_total_tokens": 4096, "rank_process": rank_process, "warmup": "none",
            "cuda_graph_max_bs": 8}
    fresh = make_llm(paths["B"], **cuda)
    try:
        want_b = tokens(fresh)
    finally:
        fresh.close()
    tensors = str(tmp_path / "b.pt")
    torch.save(weights(paths["B"]), tensors)
    exporter = subprocess.Popen([sys.executable, "-c", EXPORTER, tensors, tensor_handles.__file__],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    llm = make_llm(paths["A"], **cuda)
    try:
        want_a = tokens(llm)
        description = json.loads(exporter.stdout.readline())
        assert all("cuda" in t for t in description["tensors"]) and description["segment"] is None
        assert len(description["storages"]) == 1
        outcome = llm.update_weights_from_handles(description, "B")
        assert outcome.views > 0 and tokens(llm) == want_b
        # this process's own CUDA tensors: by IPC handle to a rank process, as they are to the rank in process
        llm.update_weights({n: t.to("cuda") for n, t in weights(paths["A"]).items()}, "A")
        assert tokens(llm) == want_a
    finally:
        llm.close()
        exporter.communicate("done\n", timeout=60)
    assert exporter.returncode == 0
