"""Memory release and resume for colocated training (LLM.release_memory_occupation / resume_memory_occupation,
vLLM's sleep / wake_up): the unified buffer's weights and KV cache give their memory back while every address stays,
and after resume the engine serves the same tokens as before, in TP and EP, one rank in process and two spawned,
across a switch, with requests held over a weights-only release; dropped weights are filled by the next update;
what would touch released memory (a step, a switch, an update, a fingerprint) is refused or waits; bad tags are
refused. On the GPU (marked `gpu`) the buffer is CUDA virtual memory: the free memory the device reports grows by
the buffer's bytes and the captured graphs replay unchanged after resume.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from conftest import PROMPTS, Checkpoints, hf_greedy, make_llm

from moebius import SamplingParams
from moebius.memory.umm import MemoryPlan, UnifiedMemory

N = 8
GREEDY = SamplingParams(max_tokens=N, temperature=0.0)
TEST_PROMPTS = PROMPTS[1:4]


def _tokens(llm: Any, prompts: list[list[int]] = TEST_PROMPTS) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.fixture(scope="module")
def want(ckpt: Checkpoints) -> dict[str, list[list[int]]]:
    return {k: [hf_greedy(ckpt(k), ids, N) for ids in TEST_PROMPTS] for k in ("base", "base_b")}


@pytest.fixture(scope="module", params=[1, 2, 4], ids=["P1", "P2", "P4"])
def llm(request: pytest.FixtureRequest, ckpt: Checkpoints) -> Iterator[Any]:
    engine = make_llm(ckpt("base"), num_ranks=request.param, mode="tp")
    yield engine
    engine.close()


@pytest.fixture
def fresh(llm: Any) -> Any:
    """The shared engine with nothing released and nothing in flight, in TP."""
    if llm.is_sleeping():
        llm.wake_up()
    llm.resume_generation()
    llm.abort_all()
    llm.step()
    if llm.mode != "tp":
        llm.switch_mode("tp")
    return llm


def test_the_plan_tags_whole_granules() -> None:
    """Granules wholly of one tag are released with it; one holding untagged bytes or both tags stays mapped."""
    plan = MemoryPlan()
    plan.add("w", (1100,), torch.float32, tag="weights")  # 4400 bytes (4608 aligned), then an untagged region
    plan.add("rope", (10,), torch.float32)
    plan.add_slots([[("weights", 8192), ("kv_cache", 5000)]] * 2)
    segs = plan.segments(1024)
    assert sum(nb for _, nb, _ in segs) == -(-plan.total_bytes // 1024) * 1024  # the whole buffer, once
    assert all(a % 1024 == 0 and nb % 1024 == 0 for a, nb, _ in segs)
    for a, nb, tag in segs:  # every tagged granule lies wholly in a range of its tag
        if tag is not None:
            assert any(ra <= a and a + nb <= ra + rn and t == tag for ra, rn, t in plan.tagged), (a, nb, tag)
    assert segs[:2] == [(0, 4096, "weights"), (4096, 1024, None)]  # [4096, 5120) holds the untagged region too
    assert {t for _, _, t in segs} == {"weights", "kv_cache", None}


def test_every_releasable_backing_has_the_whole_interface() -> None:
    """(The GPU's backing runs only on a GPU: its methods are checked here at least.)"""
    from moebius.memory import umm

    for backing in (umm._HostBacking, umm._DeviceBacking):
        assert backing.can_release
        for name in ("synchronize", "host_buffer", "unmap", "map"):
            assert callable(getattr(backing, name, None)), (backing.__name__, name)


def test_a_host_buffer_releases_its_pages_and_keeps_its_addresses() -> None:
    plan = MemoryPlan()
    plan.add("w", (1 << 20,), torch.float32, tag="weights")
    plan.add_slots([[("weights", 1 << 22), ("kv_cache", 1 << 22)]] * 2)
    umm = UnifiedMemory(plan, torch.device("cpu"))
    w = umm.view("w", (1 << 20,), torch.float32)
    kv = umm.slot_view(1, 1 << 22, (1 << 20,), torch.float32)
    umm.buffer.fill_(1)  # every page resident
    w.normal_()
    kv.fill_(3.0)
    before, ptr, rss = w.clone(), umm.buffer.data_ptr(), _rss()
    stats = umm.release(["weights", "kv_cache"], keep_weights=True)
    assert stats.nbytes == umm.releasable_bytes() >= 0.95 * plan.total_bytes
    assert _rss() < rss + stats.host_bytes - 0.9 * stats.nbytes  # the pages went (the host copy came)
    assert umm.released == {"weights", "kv_cache"}
    umm.resume(["kv_cache"])
    assert umm.released == {"weights"} and kv.abs().sum() == 0  # the KV cache comes back empty
    umm.resume(["weights"])
    assert torch.equal(w, before) and umm.buffer.data_ptr() == ptr and not umm.released
    held = umm.host_copy_bytes
    assert held == stats.host_bytes  # kept for the next release (pinning it again is what a release waits on)
    w.add_(1)
    umm.release(["weights"])
    umm.resume(["weights"])
    assert umm.host_copy_bytes == held and torch.equal(w, before + 1)  # the same host memory, the new values
    umm.release(["weights"], keep_weights=False)
    assert umm.host_copy_bytes == 0  # dropped weights need no host copy
    umm.resume(["weights"])
    assert w.abs().sum() == 0  # dropped: zeros until an update writes them


def test_release_then_resume_serves_the_same_tokens_at_the_same_addresses(fresh: Any, want: dict[str, Any]
                                                                          ) -> None:
    llm = fresh
    assert _tokens(llm) == want["base"]
    fp = llm.engine.query("fingerprint")
    report = llm.engine.query("memory")
    out = llm.release_memory_occupation()
    assert out.done and out.nbytes == report[0]["releasable_bytes"] > 0 and out.host_bytes > 0
    assert llm.is_sleeping() and [r["released"] for r in llm.engine.query("memory")] == [["kv_cache", "weights"]] * (
        llm.engine.world_size)
    assert llm.resume_memory_occupation().done and not llm.is_sleeping()
    after = llm.engine.query("fingerprint")
    assert [f["ptrs"] for f in after] == [f["ptrs"] for f in fp]
    assert [f["experts"] for f in after] == [f["experts"] for f in fp]  # the kept weights came back byte for byte
    assert _tokens(llm) == want["base"]


@pytest.mark.parametrize("mode", ["tp", "ep"])
def test_a_switch_after_a_resume_keeps_the_tokens(fresh: Any, want: dict[str, Any], mode: str) -> None:
    llm = fresh
    if mode == "ep":
        llm.switch_mode("ep")
    llm.release_memory_occupation(["kv_cache"])
    llm.release_memory_occupation(["weights"])  # (one tag after the other, then both back at once)
    llm.resume_memory_occupation()
    llm.switch_mode("tp" if mode == "ep" else "ep")
    assert _tokens(llm) == want["base"]


@pytest.mark.same_at_p4("dropping is each rank's own unmap, as at P = 2")
def test_dropped_weights_are_filled_by_the_next_update(fresh: Any, want: dict[str, Any], ckpt: Checkpoints) -> None:
    llm = fresh
    out = llm.sleep(level=2)
    assert out.host_bytes == 0  # nothing kept
    with pytest.raises(RuntimeError, match=r"weight update: the engine.s memory is released \(weights\)"):
        llm.update_weights_from_disk(ckpt("base_b"))
    llm.wake_up(["weights"])
    assert llm.is_sleeping()  # the KV cache is still released: no step runs
    llm.wake_up(["kv_cache"])
    assert _tokens(llm) != want["base"]  # zeros where the weights were
    llm.update_weights_from_disk(ckpt("base_b"))
    assert _tokens(llm) == want["base_b"]
    llm.update_weights_from_disk(ckpt("base"))
    assert _tokens(llm) == want["base"]


@pytest.mark.same_at_p4("holding requests is the front end's")
def test_requests_wait_over_a_weights_release(fresh: Any, want: dict[str, Any]) -> None:
    """Requests in flight keep their KV over a release of the weights alone, wait while it lasts, and end with
    the tokens they would have had."""
    llm = fresh
    ids = [llm.add_request(p, GREEDY) for p in TEST_PROMPTS]
    llm.step()
    llm.step()
    llm.pause_generation("keep")
    with pytest.raises(RuntimeError, match=r"releasing the KV cache with 3 request\(s\) in flight"):
        llm.release_memory_occupation()
    llm.release_memory_occupation(["weights"])
    llm.resume_generation()  # still held: the weights are gone
    llm.step()  # (the outputs of the steps in flight at the pause)
    for _ in range(3):
        assert llm.step() == []
    with pytest.raises(RuntimeError, match=r"switch to ep: the engine's memory is released \(weights\)"):
        llm.switch_mode("ep")
    with pytest.raises(RuntimeError, match="generate\\(\\) would wait forever; call resume_memory_occupation"):
        llm.generate(TEST_PROMPTS[:1], GREEDY)
    llm.resume_memory_occupation(["weights"])
    done: dict[str, list[int]] = {}
    while llm.has_unfinished():
        for o in llm.step():
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
    assert [done[i] for i in ids] == want["base"]


def test_the_peer_switch_transport_works_after_a_resume(ckpt: Checkpoints, want: dict[str, Any]) -> None:
    """The peer transport's staging (shared files on the CPU, symmetric memory on GPUs) lives outside the unified
    buffer and is never released: switches after a resume still go through it, both ways, with the same tokens."""
    llm = make_llm(ckpt("base"), num_ranks=2, mode="tp", switch_transport="peer")
    try:
        llm.release_memory_occupation()
        llm.resume_memory_occupation()
        for target in ("ep", "tp"):
            out = llm.switch_mode(target)
            assert out.done and out.transport == "peer" and out.peer_exchanges > 0, out
            assert _tokens(llm) == want["base"]
    finally:
        llm.close()


@pytest.mark.same_at_p4("the front end refuses them")
@pytest.mark.parametrize(("tags", "error", "match"), [
    (["weights", "gpu"], ValueError, r"memory tag 'gpu' is not one of weights, kv_cache"),
    ("weights", TypeError, r"tags must be a list of strings out of weights, kv_cache"),
    ([1], TypeError, r"tags must be a list of strings"),
])
def test_bad_tags_are_refused(fresh: Any, tags: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        fresh.release_memory_occupation(tags)
    with pytest.raises(error, match=match):
        fresh.resume_memory_occupation(tags)
    assert not fresh.is_sleeping()


@pytest.mark.same_at_p4("the front end refuses them")
def test_bad_levels_and_flags_are_refused(fresh: Any) -> None:
    with pytest.raises(ValueError, match="sleep level must be 1 or 2, got 3"):
        fresh.sleep(level=3)
    with pytest.raises(TypeError, match="keep_weights must be a bool, got 'no'"):
        fresh.release_memory_occupation(["weights"], keep_weights="no")
    assert not fresh.is_sleeping()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_release_frees_the_buffer_and_graphs_replay_after_resume(ckpt: Checkpoints) -> None:
    """CUDA virtual memory: release frees what it unmaps (the device's free memory; granules of 2 MiB, so a KV cache
    of a few MiB a layer: the >= 95% of a real model's buffer is benchmarks/rl/memory_release.py's), resume maps it at
    the same addresses, and the decode graphs captured at start give the same tokens as before."""
    pytest.importorskip("cuda.bindings")
    llm = make_llm(ckpt("base"), device="cuda", dtype="float32", max_total_tokens=1 << 17)
    try:
        before = _tokens(llm)
        fp = llm.engine.query("fingerprint")
        total = llm.engine.query("memory")[0]["umm_bytes"]
        torch.cuda.synchronize()
        free0 = torch.cuda.mem_get_info()[0]
        out = llm.release_memory_occupation()
        freed = torch.cuda.mem_get_info()[0] - free0
        assert out.nbytes >= 0.5 * total and freed >= 0.95 * out.nbytes, (out, freed, total)
        llm.resume_memory_occupation()
        assert [f["ptrs"] for f in llm.engine.query("fingerprint")] == [f["ptrs"] for f in fp]
        assert _tokens(llm) == before
    finally:
        llm.close()
