"""Weight updates into a running engine (LLM.update_weights, update_weights_from_disk), one rank in process, two and
four spawned ranks (the tensors through shared memory; at P = 4 each of base's 2 KV heads is on 2 TP ranks and an EP
rank holds 2 of the 8 experts), in TP and in EP: after an update the engine serves the new checkpoint's greedy
tokens (transformers' and a fresh engine's), a switch moves the new weights, a partial update changes only what it
names, a bad update changes nothing, the prefix cache is flushed and every output names the weight version.

A is the "base" checkpoint, B "base_b" (other random weights of the same shapes), M is A with some of B's tensors:
all of layer 1, experts 0-2 of layer 0 and the gate of its expert 3, and layer 2's q_proj and k_proj (so a spec's
cut reads some given tensors and some not: the qkv stack, whose KV heads P = 4 replicates, a layer's experts).
"""

from __future__ import annotations

import os
import shutil
import socket
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from conftest import PROMPTS, Checkpoints, hf_greedy, hf_model, make_llm
from safetensors.torch import load_file, save_file

from moebius import SamplingParams
from moebius.config import ConfigError
from moebius.link.messages import WeightUpdate
from moebius.link.tensor_handles import FORMAT

N = 8  # greedy tokens a prompt
GREEDY = SamplingParams(max_tokens=N, temperature=0.0)
TEST_PROMPTS = PROMPTS[1:4]  # 5, 17 and 33 tokens: the last fills two 16-token pages of the prefix cache


def _in_m(name: str) -> bool:
    """The tensors M takes from B."""
    return (name.startswith("model.layers.1.")
            or name in ("model.layers.2.self_attn.q_proj.weight", "model.layers.2.self_attn.k_proj.weight")
            or name == "model.layers.0.mlp.experts.3.gate_proj.weight"
            or any(name.startswith(f"model.layers.0.mlp.experts.{e}.") for e in range(3)))


@pytest.fixture(scope="module")
def paths(ckpt: Checkpoints, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    a, b = ckpt("base"), ckpt("base_b")
    m = str(tmp_path_factory.mktemp("update") / "mixed")
    shutil.copytree(a, m)
    mixed = {**load_file(os.path.join(a, "model.safetensors")), **_b_part(b)}
    save_file(mixed, os.path.join(m, "model.safetensors"), metadata={"format": "pt"})
    return {"A": a, "B": b, "M": m}


def _b_part(b: str) -> dict[str, torch.Tensor]:
    return {n: t for n, t in load_file(os.path.join(b, "model.safetensors")).items() if _in_m(n)}


@pytest.fixture(scope="module")
def want(paths: dict[str, str]) -> dict[str, list[list[int]]]:
    """transformers' greedy tokens of each checkpoint."""
    return {k: [hf_greedy(p, ids, N) for ids in TEST_PROMPTS] for k, p in paths.items()}


@pytest.fixture(scope="module", params=[1, 2, 4], ids=["P1", "P2", "P4"])
def llm(request: pytest.FixtureRequest, paths: dict[str, str]) -> Iterator[Any]:
    """An engine on A (P > 1: spawned ranks), shared by the module's tests; each test starts it on A in TP."""
    engine = make_llm(paths["A"], num_ranks=request.param, mode="tp")
    yield engine
    engine.close()


@pytest.fixture
def on_a(llm: Any, paths: dict[str, str]) -> Any:
    if llm.mode != "tp":
        llm.switch_mode("tp")
    llm.update_weights_from_disk(paths["A"], "A")
    return llm


def tokens(llm: Any, prompts: list[list[int]] = TEST_PROMPTS) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, GREEDY)]


def addresses(llm: Any) -> list[list[int]]:
    """Every rank's buffer address and view addresses (weights, KV, static buffers): what the graphs captured."""
    return [a["ptrs"] for a in llm.engine.query("fingerprint")]


def test_update_from_a_trainers_tensors_serves_b_in_both_layouts(on_a: Any, paths: dict[str, str],
                                                                   want: dict[str, list[list[int]]]) -> None:
    """A trainer's named_parameters() (transformers 5: the experts fused) in TP: B's tokens, as transformers and a
    fresh engine on B give them, at the same addresses; a switch then moves B's experts into EP."""
    llm = on_a
    assert tokens(llm) == want["A"]
    before = addresses(llm)
    outcome = llm.update_weights(hf_model(paths["B"]).named_parameters(), weight_version="B")
    assert outcome.done and outcome.views > 0
    assert tokens(llm) == want["B"]
    fresh = make_llm(paths["B"])
    try:
        assert tokens(fresh) == want["B"]
    finally:
        fresh.close()
    assert addresses(llm) == before
    assert llm.switch_mode("ep").done
    assert tokens(llm) == want["B"]


def test_update_from_disk_in_ep_then_switch_to_tp(on_a: Any, paths: dict[str, str],
                                                  want: dict[str, list[list[int]]]) -> None:
    llm = on_a
    assert llm.switch_mode("ep").done
    assert tokens(llm) == want["A"]
    llm.update_weights_from_disk(paths["B"], "B")
    assert tokens(llm) == want["B"]
    assert llm.switch_mode("tp").done
    assert tokens(llm) == want["B"]


@pytest.mark.parametrize("mode", ["tp", "ep"])
def test_partial_update_changes_only_what_it_names(on_a: Any, paths: dict[str, str],
                                                   want: dict[str, list[list[int]]], mode: str) -> None:
    """Some of B's tensors, as float64 (any floating dtype; exact in float32), give M's tokens in the layout updated
    and after a switch."""
    llm = on_a
    if mode == "ep":
        llm.switch_mode("ep")
    assert want["M"] != want["A"] and want["M"] != want["B"]
    llm.update_weights((n, t.double()) for n, t in _b_part(paths["B"]).items())
    assert tokens(llm) == want["M"]
    assert llm.switch_mode("tp" if mode == "ep" else "ep").done
    assert tokens(llm) == want["M"]


def test_a_dense_mlp_layer_updates_in_both_layouts_at_p4(ckpt: Checkpoints) -> None:
    """dense_layer at P = 4 (layer 1 a dense SwiGLU MLP: a quarter of its rows on each TP rank, whole on each EP
    rank): a trainer's update in EP gives B's tokens, and so does a switch to TP after it (the update rewrote TP's
    dense regions too); from disk back to A in TP, and A's tokens after a switch to EP."""
    a, b = ckpt("dense_layer"), ckpt("dense_layer_b")
    want = {k: [hf_greedy(p, ids, N) for ids in TEST_PROMPTS] for k, p in (("A", a), ("B", b))}
    assert want["A"] != want["B"]
    with make_llm(a, num_ranks=4, mode="ep") as llm:
        llm.update_weights(hf_model(b).named_parameters())
        assert tokens(llm) == want["B"]
        assert llm.switch_mode("tp").done and tokens(llm) == want["B"]
        llm.update_weights_from_disk(a)
        assert tokens(llm) == want["A"]
        assert llm.switch_mode("ep").done and tokens(llm) == want["A"]


def _bad_updates(cfg_path: str) -> list[tuple[list[tuple[Any, Any]], type[Exception], str]]:
    b = load_file(os.path.join(cfg_path, "model.safetensors"))
    q = "model.layers.0.self_attn.q_proj.weight"
    fused = hf_model(cfg_path).state_dict()["model.layers.0.mlp.experts.gate_up_proj"]
    good = [(n, t) for n, t in b.items() if n.startswith("model.layers.1.")]
    return [
        (good + [("model.layers.0.self_attn.q.weight", b[q])], ValueError,
         "unknown tensor name 'model.layers.0.self_attn.q.weight'.*did you mean " + q.replace(".", r"\.")),
        ([("model.layers.3.input_layernorm.weight", torch.ones(64))], ValueError, "layer 3.*runs 3 layers"),
        (good + [(q, b[q][:32])], ValueError, rf"{q} has shape \(32, 64\); the model's is \(64, 64\)"),
        ([(q, b[q].to(torch.int32))], ValueError, f"{q} is torch.int32, not floating point"),
        ([(q, b[q].to(torch.float8_e4m3fn))], ValueError, f"{q} is torch.float8_e4m3fn, float8"),
        ([(q, b[q]), (q, b[q])], ValueError, f"{q} is given twice"),
        ([("model.layers.0.mlp.experts.gate_up_proj", fused),
          ("model.layers.0.mlp.experts.1.up_proj.weight", fused[1, 32:])], ValueError,
         "experts.1.up_proj.weight is given twice .in model.layers.0.mlp.experts.gate_up_proj and"),
        ([(q, b[q].tolist())], TypeError, f"{q} must be a torch.Tensor, got list"),
        ([(0, b[q])], TypeError, "a tensor name must be a string"),
        ([q], TypeError, r"iterable of \(name, tensor\) pairs"),
    ]


def test_a_bad_update_changes_nothing(on_a: Any, paths: dict[str, str], want: dict[str, list[list[int]]],
                                      ckpt: Checkpoints) -> None:
    """Each bad name, shape or dtype raises naming it, even after good tensors of the same update: the engine
    serves A's tokens after all of them. So do refused directories."""
    llm = on_a
    for named, error, match in _bad_updates(paths["B"]):
        with pytest.raises(error, match=match):
            llm.update_weights(iter(named), "bad")
    with pytest.raises(TypeError, match="weight_version must be a string"):
        llm.update_weights([], 3)
    missing = ckpt.copy("base", "update_missing")
    kept = {n: t for n, t in load_file(os.path.join(missing, "model.safetensors")).items()
            if n != "model.layers.2.mlp.gate.weight"}
    save_file(kept, os.path.join(missing, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="missing tensor model.layers.2.mlp.gate.weight"):
        llm.update_weights_from_disk(missing)
    other = ckpt.copy("base", "update_other_model")
    with open(os.path.join(other, "config.json")) as f:
        text = f.read().replace('"norm_topk_prob": true', '"norm_topk_prob": false')
    with open(os.path.join(other, "config.json"), "w") as f:
        f.write(text)
    with pytest.raises(ConfigError, match="another model.*norm_topk_prob False .the engine's: True"):
        llm.update_weights_from_disk(other)
    with pytest.raises(ConfigError, match="no such directory"):
        llm.update_weights_from_disk(os.path.join(other, "nowhere"))
    # a segment no rank can map (ranks on another machine): every rank says so, and none writes
    lost = WeightUpdate(handles={
        "format": FORMAT, "host": socket.gethostname(), "segment": "moebius-test-no-such-segment", "storages": [],
        "tensors": [{"name": "model.norm.weight", "dtype": "float32", "shape": [64], "offset": 0}]})
    ranks = "; ".join(f"rank {r}: FileNotFoundError: .*moebius-test-no-such-segment'"
                      for r in range(llm.engine.world_size))
    with pytest.raises(RuntimeError, match=f"refused on the ranks: no rank wrote a byte: {ranks}"):
        llm.engine._update(lost, "lost")
    assert not os.path.exists("/dev/shm/moebius-test-no-such-segment")
    assert llm.weight_version == "A"
    assert tokens(llm) == want["A"]


@pytest.mark.same_at_p4("each rank flushes its own cache as at P = 2")
def test_update_flushes_the_prefix_cache(on_a: Any, paths: dict[str, str], want: dict[str, list[list[int]]]) -> None:
    """A prompt whose pages were cached under A gives B's tokens after the update, computed in full."""
    llm = on_a
    prompt = TEST_PROMPTS[2]  # 33 tokens: two full pages
    llm.generate(prompt, GREEDY)
    assert llm.generate(prompt, GREEDY)[0].num_cached_tokens == 32
    outcome = llm.update_weights_from_disk(paths["B"])
    assert outcome.flushed_pages >= 2
    out = llm.generate(prompt, GREEDY)[0]
    assert out.token_ids == want["B"][2] and out.num_cached_tokens == 0


@pytest.mark.same_at_p4("the version is the front end's")
def test_weight_version_on_every_output(on_a: Any, paths: dict[str, str], want: dict[str, list[list[int]]]) -> None:
    """The version of the last update is on every output (generate's, and step()'s while a request runs across an
    update: it continues on the new weights) and on the LLM; an update without one reports None."""
    llm = on_a
    assert llm.weight_version == "A" and llm.generate(TEST_PROMPTS[0], GREEDY)[0].weight_version == "A"
    llm.add_request(TEST_PROMPTS[1], GREEDY)
    made: list[int] = []  # its tokens under A (an output's list grows with the request: copied)
    while len(made) < 3:
        for o in llm.step():
            assert o.weight_version == "A"
            made = list(o.token_ids)
    llm.update_weights_from_disk(paths["B"], "B-1")
    outs = []
    while llm.has_unfinished():
        outs += llm.step()
    final = outs[-1]
    assert final.finished and len(final.token_ids) == N and final.weight_version == "B-1"
    assert final.token_ids[:len(made)] == made == want["A"][1][:len(made)]
    llm.update_weights(hf_model(paths["B"]).named_parameters())
    assert llm.weight_version is None and llm.generate(TEST_PROMPTS[0], GREEDY)[0].weight_version is None


def test_expert_updates_write_each_byte_once_without_layer_sized_temporaries(
        on_a: Any, paths: dict[str, str], want: dict[str, list[list[int]]], request: pytest.FixtureRequest,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The fast path, counted on the rank in process: a partial per-expert update (M's experts) and a trainer's full
    fused update (B) make no tensor as large as a third of a layer's experts (no per-expert cat / stack into a
    temporary, no zeros or masks), and the fused one writes each layer's gate_up_proj and down_proj into the slot
    in one copy each, straight from the source's views."""
    if request.node.callspec.params["llm"] != 1:
        pytest.skip("counts torch calls in this process: the rank must be in it (P = 1)")
    llm = on_a
    named = [(n, t.detach()) for n, t in hf_model(paths["B"]).named_parameters()]
    fused = [t for n, t in named if n.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))]
    E, I2, D = fused[0].shape
    big = E * I2 // 2 * D  # a third of one layer's expert bytes (in elements)
    made: list[tuple[str, tuple[int, ...]]] = []  # big tensors made while updating
    copied: list[tuple[int, ...]] = []  # big copies' destination shapes

    def counting(fn_name: str) -> None:
        fn = getattr(torch, fn_name)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            out = fn(*args, **kwargs)
            if isinstance(out, torch.Tensor) and out.numel() >= big:
                made.append((fn_name, tuple(out.shape)))
            return out
        monkeypatch.setattr(torch, fn_name, wrapped)

    for fn_name in ("stack", "cat", "zeros", "full", "where", "empty", "zeros_like", "empty_like"):
        counting(fn_name)
    copy = torch.Tensor.copy_

    def counting_copy(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        if self.numel() >= big:
            copied.append(tuple(self.shape))
        return copy(self, src, non_blocking)
    monkeypatch.setattr(torch.Tensor, "copy_", counting_copy)

    llm.update_weights(_b_part(paths["B"]).items())
    assert made == [] and not any(len(s) >= 3 for s in copied)  # the given experts' rows one by one, no layer
    copied.clear()
    llm.update_weights(named, weight_version="B")
    monkeypatch.undo()
    assert made == []
    expert_copies = [s for s in copied if len(s) >= 3]
    assert sorted(expert_copies) == sorted([(E, 2, I2 // 2, D), (E, D, I2 // 2)] * (len(fused) // 2))
    assert tokens(llm) == want["B"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("rank_process", ["off", "on"])
def test_graphs_captured_at_start_replay_the_new_weights(paths: dict[str, str], rank_process: str) -> None:
    """On the GPU, the rank in process (updated from GPU tensors where they are) or in a process of its own (through
    host shared memory): decode steps replay the graphs captured at start, and after the update they give a fresh
    engine's tokens on B, at the same addresses, in TP and after a switch to EP; from disk back to A's."""
    from moebius import LLM
    from moebius.link.messages import DecodeProbe

    kw: dict[str, Any] = dict(device="cuda", dtype="float32", block_size=16, max_total_tokens=4096, mode="tp",
                              rank_process=rank_process, warmup="none", cuda_graph_max_bs=8)
    with LLM(paths["B"], **kw) as fresh:
        b = tokens(fresh)
        fresh.switch_mode("ep")
        assert tokens(fresh) == b
    with LLM(paths["A"], **kw) as llm:
        a = tokens(llm)
        assert a != b
        before = addresses(llm)
        llm.update_weights((n, p.detach().cuda()) for n, p in hf_model(paths["B"]).named_parameters())
        assert all(r["cuda_graph"] for r in llm.engine.probe(DecodeProbe(batch=2, context=8, steps=1, warmup=0)))
        assert tokens(llm) == b
        assert addresses(llm) == before
        assert llm.switch_mode("ep").done and tokens(llm) == b
        llm.update_weights_from_disk(paths["A"])
        assert tokens(llm) == a
        assert llm.switch_mode("tp").done and tokens(llm) == a
