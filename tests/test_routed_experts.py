"""Routed experts (SamplingParams.return_routed_experts / return_prompt_routed_experts): the expert ids each MoE
layer's router chose equal transformers' router choices (the top-k of `output_router_logits`) on the same sequence,
for the prompt tokens and the generated ones, in TP and EP (P = 2 and 4 spawned CPU ranks, EP's ids global: at P = 4
a rank holds 2 of the 8 experts) and across live switches between steps; requests that do not ask get nothing."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from conftest import VOCAB, hf_model, make_llm, shared_llm

from moebius import LLM, SamplingParams

Routing = list[list[list[int]]]  # [positions][MoE layers][k]
ON: dict[str, Any] = dict(enable_return_routed_experts=True)  # the engines that record them


def hf_routing(path: str, ids: list[int], top_k: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """transformers' router: per MoE layer, the top-k expert ids [T, k] and the router probabilities [T, E]."""
    with torch.no_grad():
        out = hf_model(path)(input_ids=torch.tensor([ids]), use_cache=False, output_router_logits=True)
    probs = [torch.softmax(r.float().reshape(len(ids), -1), dim=-1) for r in out.router_logits]
    return [torch.topk(p, top_k, dim=-1).indices for p in probs], probs


def assert_routing_matches(path: str, ids: list[int], got: Routing, top_k: int) -> None:
    """got[i] is the routing of position i of `ids`; a choice may differ from transformers' only at a tie of the
    router's probabilities (float32 sums in another order)."""
    want, probs = hf_routing(path, ids, top_k)
    assert len(got) == len(ids), (len(got), len(ids))
    assert all(len(g) == len(want) for g in got), "one entry per MoE layer"
    for pos, per_layer in enumerate(got):
        for layer, ids_k in enumerate(per_layer):
            w = want[layer][pos].tolist()
            if ids_k != w:
                p = probs[layer][pos]
                gap = float((p[ids_k].sort().values - p[w].sort().values).abs().max())
                assert gap < 1e-5, f"position {pos} layer {layer}: engine {ids_k}, transformers {w}"


def _prompts(seed: int, lens: tuple[int, ...]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(n)] for n in lens]


def _check_outputs(path: str, prompts: list[list[int]], outs: list[Any], top_k: int, prompt_too: bool) -> None:
    for prompt, o in zip(prompts, outs, strict=True):
        c = o.outputs[0]
        assert c.routed_experts is not None and len(c.routed_experts) == len(c.token_ids)
        seq = prompt + c.token_ids[:-1]
        if prompt_too:
            assert c.prompt_routed_experts is not None and len(c.prompt_routed_experts) == len(prompt) - 1
            head = c.prompt_routed_experts
        else:  # output only: the routing of positions len(prompt) - 1 ..; the prompt's head taken from the oracle
            want, _ = hf_routing(path, seq, top_k)
            head = [[want[j][pos].tolist() for j in range(len(want))] for pos in range(len(prompt) - 1)]
        assert_routing_matches(path, seq, head + c.routed_experts, top_k)


def test_routed_experts_equal_transformers_router_p1(ckpt: Any) -> None:
    """P = 1 (a dense layer among the MoE ones: it routes nothing, so 2 entries a position): prompts longer than a
    step's token budget (chunked prefill), mixed with a request that does not ask and one that asks for its output
    only; sampled and greedy."""
    path = ckpt("dense_layer")
    llm = shared_llm(path, max_num_batched_tokens=16, disable_prefix_caching=True, **ON)
    prompts = _prompts(7, (5, 23, 40))
    params = [SamplingParams(temperature=0, max_tokens=9, return_routed_experts=True,
                             return_prompt_routed_experts=True),
              SamplingParams(temperature=0.8, seed=3, max_tokens=7, return_routed_experts=True),
              SamplingParams(temperature=0, max_tokens=6)]
    outs = llm.generate([list(p) for p in prompts], params, use_tqdm=False)
    _check_outputs(path, prompts[:1], outs[:1], 2, prompt_too=True)
    _check_outputs(path, prompts[1:2], outs[1:2], 2, prompt_too=False)
    assert outs[1].outputs[0].prompt_routed_experts is None
    assert outs[2].outputs[0].routed_experts is None and outs[2].outputs[0].prompt_routed_experts is None
    assert all(len(layers) == 2 and all(len(k) == 2 for k in layers) for layers in outs[0].outputs[0].routed_experts)


def test_routed_experts_stream_as_deltas(ckpt: Any) -> None:
    """RequestOutputKind.DELTA: each output carries the routing of its own new tokens; joined, they are the whole."""
    from moebius.sampling_params import RequestOutputKind

    path = ckpt("sparse_step2")  # MoE layers 1 and 3 of 4, top-3
    llm = shared_llm(path, disable_prefix_caching=True, **ON)
    prompt = _prompts(11, (12,))[0]
    rid = llm.add_request(prompt, SamplingParams(temperature=0, max_tokens=8, return_routed_experts=True,
                                                 return_prompt_routed_experts=True,
                                                 output_kind=RequestOutputKind.DELTA))
    tokens: list[int] = []
    routed: Routing = []
    prompt_routed: Routing | None = None
    while llm.has_unfinished():
        for o in llm.step():
            if o.request_id == rid:
                c = o.outputs[0]
                tokens += c.token_ids
                routed += c.routed_experts or []
                prompt_routed = prompt_routed or c.prompt_routed_experts
    assert len(routed) == len(tokens) == 8 and prompt_routed is not None
    assert_routing_matches(path, prompt + tokens[:-1], prompt_routed + routed, 3)


@pytest.fixture(scope="module", params=[2, 4], ids=["P2", "P4"])
def spawned(request: pytest.FixtureRequest, ckpt: Any) -> Iterator[LLM]:
    """One engine of P spawned ranks for the module (started in EP); a test switches it to the layout it needs."""
    llm = make_llm(ckpt("tied_mha_nonorm"), num_ranks=request.param, mode="ep", block_size=4, max_total_tokens=1024,
                   max_running_requests=8, max_num_batched_tokens=16, disable_prefix_caching=True, **ON)
    yield llm
    llm.close()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["tp", "ep"])
def test_routed_experts_equal_transformers_router_spawned(ckpt: Any, spawned: LLM, mode: str) -> None:
    """P spawned ranks: TP (every rank routes every token, rank 0 reports) and EP (each rank routes its own
    requests, ids global, not slot ids)."""
    path = ckpt("tied_mha_nonorm")
    llm = spawned
    if llm.engine.mode != mode:
        assert llm.switch_mode(mode).done
    prompts = _prompts(21, (3, 19, 30, 8))
    params = SamplingParams(temperature=0, max_tokens=8, return_routed_experts=True,
                            return_prompt_routed_experts=True)
    outs = llm.generate([list(p) for p in prompts], params, use_tqdm=False)
    _check_outputs(path, prompts, outs, 2, prompt_too=True)


@pytest.mark.slow
def test_routed_experts_across_live_switches(ckpt: Any, spawned: LLM) -> None:
    """Switches between steps while requests run (some mid-prefill): every position's routing equals transformers',
    whichever layout ran it."""
    path = ckpt("tied_mha_nonorm")
    llm = spawned
    if llm.engine.mode != "ep":
        assert llm.switch_mode("ep").done
    prompts = _prompts(31, (5, 26, 40, 11))
    params = SamplingParams(temperature=0, max_tokens=10, return_routed_experts=True,
                            return_prompt_routed_experts=True)
    rids = [llm.add_request(p, params) for p in prompts]
    last: dict[str, Any] = {}
    step, switches = 0, 0
    while llm.has_unfinished():
        if step in (1, 3, 6, 9):
            assert llm.switch_mode("tp" if llm.engine.mode == "ep" else "ep").done
            switches += 1
        for o in llm.step():
            last[o.request_id] = o
        step += 1
    assert switches >= 3
    if llm.engine.mode != "ep":
        assert llm.switch_mode("ep").done
    _check_outputs(path, prompts, [last[r] for r in rids], 2, prompt_too=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_routed_experts_from_cuda_graphs(ckpt: Any) -> None:
    """On the GPU, decode steps replay the graphs captured at start, which write the router's ids into the runner's
    static buffer: float32, they equal transformers' router (prompt chunks through the step pieces, decodes through
    the graphs, TP then EP after a switch); bfloat16 (Triton's fused router), the graphs' ids equal an eager
    engine's."""
    from moebius.link.messages import DecodeProbe

    path = ckpt("base")
    kw: dict[str, Any] = dict(device="cuda", block_size=16, max_total_tokens=4096, warmup="none",
                              cuda_graph_max_bs=8, disable_prefix_caching=True, max_num_batched_tokens=32, **ON)
    prompts = _prompts(41, (5, 23, 40))
    params = SamplingParams(temperature=0, max_tokens=10, return_routed_experts=True,
                            return_prompt_routed_experts=True)
    with LLM(path, dtype="float32", **kw) as llm:
        assert all(r["cuda_graph"] for r in llm.engine.probe(DecodeProbe(batch=2, context=8, steps=1, warmup=0)))
        _check_outputs(path, prompts, llm.generate(prompts, params, use_tqdm=False), 2, prompt_too=True)
    runs = []
    for eager in (False, True):
        with LLM(path, dtype="bfloat16", disable_cuda_graph=eager, **kw) as llm:
            outs = llm.generate(prompts, params, use_tqdm=False)
            runs.append([(o.outputs[0].token_ids, o.outputs[0].prompt_routed_experts, o.outputs[0].routed_experts)
                         for o in outs])
    assert runs[0] == runs[1]


def test_prompt_routing_is_whole_with_the_prefix_cache_on(ckpt: Any) -> None:
    """A request that asks for its prompt's routing computes every prompt position: the second run of the same
    prompt (its pages in the prefix cache) still gets the whole routing, equal to the first."""
    path = ckpt("dense_layer")
    llm = shared_llm(path, **ON)  # prefix caching on (the default)
    prompt = _prompts(11, (37,))[0]
    sp = SamplingParams(temperature=0, max_tokens=4, return_routed_experts=True, return_prompt_routed_experts=True)
    first, second = (llm.generate([list(prompt)], sp)[0].outputs[0] for _ in range(2))
    assert second.prompt_routed_experts == first.prompt_routed_experts and len(first.prompt_routed_experts) == 36
    _check_outputs(path, [prompt], [llm.generate([list(prompt)], sp)[0]], 2, prompt_too=True)


def test_generate_endpoint_returns_sglangs_routed_experts(ckpt: Any) -> None:
    """/generate with return_routed_experts: meta_info.routed_experts is base64 int32 shaped (prompt + output - 1,
    decoder layers, top-k), a dense layer's rows -1, equal to transformers' router on prompt + output[:-1]."""
    import base64

    import httpx
    from test_serve import served_here

    path = ckpt("dense_layer")
    prompt = _prompts(13, (21,))[0]
    body = {"input_ids": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 6},
            "return_routed_experts": True}
    with served_here(model=path, rank_process="off", **ON) as (url, _):
        for _ in range(2):  # the second time with the prompt's pages in the prefix cache
            r = httpx.post(url + "/generate", json=body, timeout=60)
            assert r.status_code == 200, r.text
            out = r.json()
            ids = torch.frombuffer(bytearray(base64.b64decode(out["meta_info"]["routed_experts"])), dtype=torch.int32)
            seq = prompt + out["output_ids"][:-1]
            rows = ids.reshape(len(seq), 3, 2)  # the checkpoint's 3 decoder layers, layer 1 dense
            assert (rows[:, 1] == -1).all()
            assert_routing_matches(path, seq, rows[:, [0, 2]].tolist(), 2)
        plain = httpx.post(url + "/generate", json={**body, "return_routed_experts": False}, timeout=60).json()
        assert "routed_experts" not in plain["meta_info"] and plain["output_ids"] == out["output_ids"]


def test_an_engine_without_the_flag_records_nothing_and_refuses_to(ckpt: Any) -> None:
    """Without --enable-return-routed-experts no forward writes expert ids (no buffer on any runner) and a request
    asking for them is refused naming the flag, offline and over /generate."""
    import httpx
    from test_serve import served_here

    path = ckpt("dense_layer")
    llm = shared_llm(path)
    assert all(rt.runner.routed is None for rt in llm.engine.ranks.rank.modes.values())
    for sp in (SamplingParams(return_routed_experts=True), SamplingParams(return_prompt_routed_experts=True)):
        with pytest.raises(ValueError, match="--enable-return-routed-experts"):
            llm.generate([[1, 2, 3]], sp)
    with served_here(model=path, rank_process="off") as (url, _):
        r = httpx.post(url + "/generate", json={"input_ids": [1, 2, 3], "return_routed_experts": True}, timeout=60)
        assert r.status_code == 400 and "--enable-return-routed-experts" in r.text, r.text
