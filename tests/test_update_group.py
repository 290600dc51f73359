"""Weight updates from a trainer's process group (SGLang's init_weights_update_group / update_weights_from_distributed
/ destroy_weights_update_group), on gloo: a trainer process that imports torch only joins the group as SGLang's
trainers do (`dist.rendezvous` on its own TCP store, `_new_process_group_helper` under the group's name: what
SGLang's `init_custom_process_group` runs) and broadcasts checkpoint B's tensors; the engine (A) then serves B's
greedy tokens, one rank in process, two and four spawned ranks, in TP and EP. Bad metadata is refused before the trainer
is told to broadcast, and the engine keeps A; a group destroyed can be joined again.
"""

from __future__ import annotations

import os
import queue
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch
from conftest import PROMPTS, Checkpoints, free_port, hf_greedy, make_llm

from moebius import SamplingParams

N = 8
GREEDY = SamplingParams(max_tokens=N, temperature=0.0)
TEST_PROMPTS = PROMPTS[1:4]
GROUP = "trainer_group"


def _trainer(commands: Any, replies: Any) -> None:
    """The trainer: torch (and safetensors to read B) only. Commands: ("init", port, world_size), ("broadcast",
    path), ("destroy",), ("stop",); each answered "ok" or the error."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file
    from torch.distributed import distributed_c10d as c10d

    pg, dev = None, "cpu"
    while True:
        cmd = commands.get()
        try:
            if cmd[0] == "stop":
                return
            if cmd[0] == "init":  # SGLang's init_custom_process_group, as slime and verl call it on their side
                backend = cmd[3] if len(cmd) > 3 else "gloo"
                if backend == "nccl":  # the trainer's GPU: the last one (the engine's rank is on GPU 0)
                    dev = f"cuda:{torch.cuda.device_count() - 1}"
                    torch.cuda.set_device(dev)
                store, rank, world = next(dist.rendezvous(f"tcp://127.0.0.1:{cmd[1]}", 0, cmd[2],
                                                          timeout=timedelta(seconds=60)))
                made = c10d._new_process_group_helper(world, rank, [], backend, store, group_name=GROUP,
                                                      timeout=timedelta(seconds=60))
                pg = made[0] if isinstance(made, tuple) else made
                c10d._world.pg_group_ranks[pg] = {i: i for i in range(world)}
            elif cmd[0] == "broadcast":
                tensors = load_file(os.path.join(cmd[1], "model.safetensors"))
                for name in sorted(tensors):
                    dist.broadcast(tensors[name].to(dev).contiguous(), src=0, group=pg)
            elif cmd[0] == "bucket":  # SGLang's flattened bucket: every tensor's bytes back to back, one broadcast
                tensors = load_file(os.path.join(cmd[1], "model.safetensors"))
                parts = [(tensors[n].double() if i % 3 == 0 else tensors[n]).flatten().view(torch.uint8)
                         for i, n in enumerate(sorted(tensors))]
                dist.broadcast(torch.cat(parts), src=0, group=pg)
            elif cmd[0] == "destroy":
                dist.destroy_process_group(pg)
                pg = None
            replies.put("ok")
        except BaseException as e:  # noqa: BLE001 - reported to the test
            replies.put(f"{type(e).__name__}: {e}")


class Trainer:
    def __init__(self) -> None:
        ctx = torch.multiprocessing.get_context("spawn")
        self.commands, self.replies = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=_trainer, args=(self.commands, self.replies), daemon=True)
        self.proc.start()

    def send(self, *cmd: Any) -> None:
        self.commands.put(cmd)

    def done(self, timeout: float = 60) -> None:
        try:
            assert self.replies.get(timeout=timeout) == "ok"
        except queue.Empty:
            raise AssertionError("the trainer did not answer") from None

    def close(self) -> None:
        self.send("stop")
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


def metadata(path: str) -> tuple[list[str], list[str], list[list[int]]]:
    """What the trainer broadcasts, in its order; dtypes written both ways trainers write them."""
    from safetensors import safe_open

    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        names = sorted(f.keys())
        shapes = [list(f.get_slice(n).get_shape()) for n in names]
    return names, [("torch.float32" if i % 2 else "float32") for i in range(len(names))], shapes


@pytest.fixture(scope="module")
def paths(ckpt: Checkpoints) -> dict[str, str]:
    return {"A": ckpt("base"), "B": ckpt("base_b")}


@pytest.fixture(scope="module")
def want(paths: dict[str, str]) -> dict[str, list[list[int]]]:
    """A fresh engine's greedy tokens on A and on B (transformers' too)."""
    out = {}
    for k, p in paths.items():
        fresh = make_llm(p)
        try:
            out[k] = [o.token_ids for o in fresh.generate(TEST_PROMPTS, GREEDY)]
        finally:
            fresh.close()
        assert out[k] == [hf_greedy(p, ids, N) for ids in TEST_PROMPTS]
    assert out["A"] != out["B"]
    return out


@pytest.fixture(scope="module", params=[1, 2, 4], ids=["P1", "P2", "P4"])
def llm(request: pytest.FixtureRequest, paths: dict[str, str]) -> Iterator[Any]:
    engine = make_llm(paths["A"], num_ranks=request.param, mode="tp")
    yield engine
    engine.close()


@pytest.fixture
def trainer() -> Iterator[Trainer]:
    t = Trainer()
    yield t
    t.close()


def tokens(llm: Any) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(TEST_PROMPTS, GREEDY)]


def join(llm: Any, trainer: Trainer) -> None:
    """Trainer and engine join at the same time (each call blocks until all members are in)."""
    port, world = free_port(), 1 + llm.engine.world_size
    trainer.send("init", port, world)
    llm.init_weights_update_group("127.0.0.1", port, 1, world, GROUP, "gloo")
    trainer.done()


def push_b(llm: Any, trainer: Trainer, path: str, version: str) -> None:
    trainer.send("broadcast", path)
    outcome = llm.update_weights_from_distributed(*metadata(path), group_name=GROUP, weight_version=version)
    trainer.done()
    assert outcome.done and outcome.views > 0


@pytest.mark.parametrize("mode", ["tp", "ep"])
@pytest.mark.same_at_p4("P4-tp receives in TP and serves in EP after a switch; an EP rank writes what it "
                        "received as it writes tensors (test_weight_update's P4)", mode="ep")
def test_broadcast_update_serves_b(llm: Any, trainer: Trainer, paths: dict[str, str],
                                   want: dict[str, list[list[int]]], mode: str) -> None:
    """B's tensors broadcast by the trainer, received in `mode`: B's tokens, also after a switch to the other
    layout; the weight version is on the outputs."""
    llm.update_weights_from_disk(paths["A"], "A")
    if llm.engine.world_size > 1 and llm.mode != mode:
        assert llm.switch_mode(mode).done
    assert tokens(llm) == want["A"]
    join(llm, trainer)
    try:
        push_b(llm, trainer, paths["B"], "B")
        outs = llm.generate(TEST_PROMPTS, GREEDY)
        assert [o.token_ids for o in outs] == want["B"] and {o.weight_version for o in outs} == {"B"}
        if llm.engine.world_size > 1:
            assert llm.switch_mode("ep" if mode == "tp" else "tp").done
            assert tokens(llm) == want["B"]
    finally:
        llm.destroy_weights_update_group(GROUP)
        trainer.send("destroy")
        trainer.done()


@pytest.mark.same_at_p4("every rank unpacks the same bucket")
def test_flattened_bucket(llm: Any, trainer: Trainer, paths: dict[str, str],
                          want: dict[str, list[list[int]]]) -> None:
    """SGLang's load_format "flattened_bucket": B's tensors (float64 and float32 mixed) in one uint8 broadcast: B's
    tokens; an unknown load_format is refused."""
    llm.update_weights_from_disk(paths["A"], "A")
    join(llm, trainer)
    try:
        names, _, shapes = metadata(paths["B"])
        dtypes = ["float64" if i % 3 == 0 else "float32" for i in range(len(names))]
        trainer.send("bucket", paths["B"])
        outcome = llm.update_weights_from_distributed(names, dtypes, shapes, GROUP, "B", "flattened_bucket")
        trainer.done()
        assert outcome.done and tokens(llm) == want["B"]
        with pytest.raises(ValueError, match="load_format"):
            llm.update_weights_from_distributed(names, dtypes, shapes, GROUP, "B", "bucketed")
    finally:
        llm.destroy_weights_update_group(GROUP)
        trainer.send("destroy")
        trainer.done()


@pytest.mark.same_at_p4("the front end refuses before any rank waits; test_broadcast_update_serves_b joins at P = 4")
def test_bad_metadata_refused_before_broadcast_then_reinit(llm: Any, trainer: Trainer, paths: dict[str, str],
                                                          want: dict[str, list[list[int]]]) -> None:
    """A bad name, shape or dtype raises naming it before any rank waits for a byte (the trainer, never told to
    broadcast, sends nothing) and A's tokens stay; the group is still usable, and after destroy a re-init of the same
    name works."""
    llm.update_weights_from_disk(paths["A"], "A")
    join(llm, trainer)
    names, dtypes, shapes = metadata(paths["B"])
    bad_name = (["model.layers.9.mlp.gate.weight", *names[1:]], dtypes, shapes)
    bad_shape = (names, dtypes, [[s[0] + 1, *s[1:]], *shapes[1:]] if (s := shapes[0]) else shapes)
    bad_dtype = (names, ["torch.int32", *dtypes[1:]], shapes)
    bad_kind = (names, ["bfloat17", *dtypes[1:]], shapes)
    for meta, said in [(bad_name, "model.layers.9"), (bad_shape, names[0]), (bad_dtype, "int32"),
                       (bad_kind, "bfloat17"), ((names, dtypes[:-1], shapes), "one entry per tensor")]:
        with pytest.raises(ValueError, match=said.replace(".", r"\.")):
            llm.update_weights_from_distributed(*meta, group_name=GROUP, weight_version="bad")
    with pytest.raises(ValueError, match="no process group 'other'"):
        llm.update_weights_from_distributed(names, dtypes, shapes, group_name="other")
    assert llm.weight_version == "A" and tokens(llm) == want["A"]
    with pytest.raises(ValueError, match="joined already"):
        llm.init_weights_update_group("127.0.0.1", free_port(), 1, 1 + llm.engine.world_size, GROUP)
    push_b(llm, trainer, paths["B"], "B")  # the refusals left the group in step with the trainer
    assert tokens(llm) == want["B"]
    llm.destroy_weights_update_group(GROUP)
    trainer.send("destroy")
    trainer.done()
    with pytest.raises(ValueError, match="no process group"):
        llm.destroy_weights_update_group(GROUP)
    join(llm, trainer)  # the same name again, a new store
    try:
        push_b(llm, trainer, paths["A"], "A2")
        assert llm.weight_version == "A2" and tokens(llm) == want["A"]
    finally:
        llm.destroy_weights_update_group(GROUP)
        trainer.send("destroy")
        trainer.done()


def test_group_arguments_checked(llm: Any) -> None:
    for kwargs, said in [({"backend": "mpi"}, "backend"), ({"rank_offset": 0}, "rank_offset"),
                         ({"world_size": 1}, "world_size"), ({"master_port": 0}, "master_port"),
                         ({"backend": "nccl"}, "nccl")]:
        args = {"master_address": "127.0.0.1", "master_port": 29999, "rank_offset": 1,
                "world_size": 1 + llm.engine.world_size, "group_name": GROUP, **kwargs}
        with pytest.raises(ValueError, match=said):
            llm.init_weights_update_group(**args)


def test_http_routes(paths: dict[str, str], want: dict[str, list[list[int]]], trainer: Trainer) -> None:
    """SGLang's three routes with its payloads (master_port as a string, dtypes as "torch.float32"), replies
    {"success", "message"}; a bad name is a 400 naming it before the trainer broadcasts; /generate then gives B's
    tokens and the version."""
    from test_serve import served_here

    with served_here(model=paths["A"], dtype="float32", block_size=16, max_total_tokens=4096, seed=0,
                     rank_process="off") as (url, _):
        def post(route: str, body: dict[str, Any], status: int = 200) -> dict[str, Any]:
            r = httpx.post(url + route, json=body, timeout=120)
            assert r.status_code == status, r.text
            return r.json()

        port = free_port()
        trainer.send("init", port, 2)
        out = post("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": str(port),
                                                  "rank_offset": 1, "world_size": 2, "group_name": GROUP,
                                                  "backend": "gloo"})
        trainer.done()
        assert out["success"] is True and GROUP in out["message"]
        names, _, shapes = metadata(paths["B"])
        body = {"names": names, "dtypes": ["torch.float32"] * len(names), "shapes": shapes, "group_name": GROUP,
                "weight_version": "B"}
        bad = post("/update_weights_from_distributed", {**body, "names": ["lm_head.bias", *names[1:]]}, 400)
        assert bad["success"] is False and "lm_head.bias" in bad["message"]
        trainer.send("broadcast", paths["B"])
        out = post("/update_weights_from_distributed", body)
        trainer.done()
        assert out["success"] is True
        for ids, w in zip(TEST_PROMPTS, want["B"], strict=True):
            gen = post("/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": N, "temperature": 0}})
            assert gen["output_ids"] == w and gen["meta_info"]["weight_version"] == "B"
        assert post("/destroy_weights_update_group", {"group_name": GROUP})["success"] is True
        trainer.send("destroy")
        trainer.done()
        again = post("/destroy_weights_update_group", {"group_name": GROUP}, 400)
        assert again["success"] is False and GROUP in again["message"]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (trainer and engine)")
def test_nccl_between_two_gpus(paths: dict[str, str], trainer: Trainer) -> None:
    """The trainer on the last GPU broadcasts B over NCCL to an engine rank on GPU 0: a fresh GPU engine's B tokens."""
    fresh = make_llm(paths["B"], device="cuda", dtype="float32")
    try:
        want_b = tokens(fresh)
    finally:
        fresh.close()
    llm = make_llm(paths["A"], device="cuda", dtype="float32")
    try:
        port = free_port()
        trainer.send("init", port, 2, "nccl")
        llm.init_weights_update_group("127.0.0.1", port, 1, 2, GROUP, "nccl")
        trainer.done()
        push_b(llm, trainer, paths["B"], "B")
        assert tokens(llm) == want_b
        llm.destroy_weights_update_group(GROUP)
        trainer.send("destroy")
        trainer.done()
    finally:
        llm.close()
