"""Static TP and EP layouts across P ranks: one model served by P rank processes (CPU, gloo) computes what
transformers computes, in both layouts and for P in {1, 2, 4}.

- TP shards attention heads (KV heads replicated when there are fewer than P) and every expert's intermediate dim;
  EP gives each rank a disjoint set of requests and E/P whole experts (all-to-all dispatch / combine).
- Greedy tokens equal the transformers reference and each other across (P, mode); prompt logits agree within 1e-4.
- Requests that arrive and finish at different steps (EP ranks idle while others decode), aborts, and a KV pool
  that is fully free again on every rank afterwards.
- Start-up errors: impossible shapes (ConfigError naming the numbers, before any process is spawned) and a missing
  tensor (an error from the rank processes naming the tensor; no process left behind, no hang).

Every LLM instance is shared by the tests of its (checkpoint, P, mode) through a module-scoped parametrized
fixture (pytest groups the tests by it, so only one engine is alive at a time); the transformers reference runs once
per checkpoint and prompt.
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing
import os
import random
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from conftest import hf_model

from moebius import LLM
from moebius.config import ConfigError
from moebius.sampling_params import SamplingParams
from moebius.worker.launch import RankError

VOCAB = 300
BLOCK = 4  # tokens per KV page: the prompts below cross page boundaries in every way
N_OUT = 20  # greedy tokens per request (>= 16)
LOGITS_RTOL = 1e-4
MIN_MARGIN = 1e-3  # smallest top-1 / top-2 logit gap allowed on a reference greedy path
START_TIMEOUT = 120  # seconds: an engine that neither starts nor fails by then is hung

BASE: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
    norm_topk_prob=True, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
    mlp_only_layers=[], decoder_sparse_step=1,
)
# Checkpoints served in every layout. Both have 4 query heads so P = 4 puts one head on each rank.
MODELS: dict[str, dict[str, Any]] = {
    # GQA with 2 KV heads (P = 4 replicates each KV head on 2 ranks), 8 experts (E/P = 8, 4, 2).
    "gqa8": {},
    # MQA (1 KV head, replicated on every rank), 4 experts (one per rank at P = 4), layer 1 a dense MLP (sharded in
    # TP, replicated in EP), raw softmax top-k weights, lm_head tied to the embedding.
    "mqa4_dense": dict(num_key_value_heads=1, num_experts=4, mlp_only_layers=[1], norm_topk_prob=False,
                       tie_word_embeddings=True, seed=1),
}
LAYOUTS = [(p, mode) for p in (1, 2, 4) for mode in ("tp", "ep")]
ENGINES = [(name, p, mode) for name in MODELS for p, mode in LAYOUTS]

_rng = random.Random(3)
PROMPT_LENS = (1, 3, 4, 5, 8, 13, 16, 23, 37)  # inside, on and across 4-token block boundaries
PROMPTS: list[list[int]] = [[_rng.randrange(VOCAB) for _ in range(n)] for n in PROMPT_LENS]

ENGINE_KW: dict[str, Any] = dict(dtype="float32", device="cpu", block_size=BLOCK, max_total_tokens=1024,
                                 max_num_batched_tokens=32, seed=0)


# ---------------------------------------------------------------------------------------------------------------
# Checkpoints and the transformers reference
# ---------------------------------------------------------------------------------------------------------------

def write_checkpoint(path: str, seed: int = 0, **overrides: Any) -> str:
    """A random Qwen3MoeForCausalLM saved with save_pretrained, with large-std weights (clear greedy margins)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(**{**BASE, **overrides})
    cfg.architectures = ["Qwen3MoeForCausalLM"]
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(cfg).float().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.empty(p.shape).uniform_(0.8, 1.2, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.4)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def ckpt_root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("layout_ckpts"))


@functools.cache
def _checkpoint(root: str, name: str) -> str:
    overrides = dict(MODELS[name])
    return write_checkpoint(os.path.join(root, name), **overrides)


@functools.cache
def _hf_reference(path: str, prompt: tuple[int, ...]) -> tuple[tuple[int, ...], torch.Tensor, float]:
    """(N_OUT greedy tokens, prompt logits [len, V], smallest top-2 gap on the greedy path): a full forward pass
    per token in float32, no KV cache."""
    model, seq, margin = hf_model(path), list(prompt), float("inf")
    prompt_logits = None
    with torch.no_grad():
        for _ in range(N_OUT):
            logits = model(input_ids=torch.tensor([seq]), use_cache=False).logits[0].float()
            if prompt_logits is None:
                prompt_logits = logits.clone()
            top2 = logits[-1].topk(2).values
            margin = min(margin, float(top2[0] - top2[1]))
            seq.append(int(logits[-1].argmax()))
    assert prompt_logits is not None
    return tuple(seq[len(prompt):]), prompt_logits, margin


def reference(path: str, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    tokens, logits, margin = _hf_reference(path, tuple(prompt))
    assert margin > MIN_MARGIN, (f"test-suite bug: the reference greedy path of a {len(prompt)}-token prompt has a "
                                 f"top-2 logit gap of {margin:.1e}; pick another seed")
    assert len(set(tokens)) > 4, "test-suite bug: degenerate model (the greedy output repeats a few tokens)"
    return list(tokens), logits


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


# ---------------------------------------------------------------------------------------------------------------
# Engines
# ---------------------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def deadline(seconds: int, what: str) -> Iterator[None]:
    """Fail (instead of hanging the suite) when the body takes longer than `seconds`."""

    def on_alarm(signum: int, frame: object) -> None:
        raise TimeoutError(f"{what} took more than {seconds} s (hung rank processes?)")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@contextlib.contextmanager
def no_leftover_processes() -> Iterator[None]:
    """Every process started in the body is gone at its end: those still alive are killed, and reported unless the
    body raised (its error is the one to see)."""
    before = set(multiprocessing.active_children())

    def kill_new(wait: float = 10) -> list[int]:
        left = [p for p in multiprocessing.active_children() if p not in before]
        for p in left:
            p.join(timeout=wait)
        alive = [p for p in left if p.is_alive()]
        for p in alive:
            p.kill()
            p.join(timeout=10)
        return [p.pid for p in alive if p.pid is not None]

    try:
        yield
    except BaseException:
        kill_new(wait=0)
        raise
    alive = kill_new()
    assert not alive, f"rank processes left running: {alive}"


class Engine:
    """One LLM of a (checkpoint, P, mode), shared by the tests of that combination."""

    def __init__(self, name: str, path: str, num_ranks: int, mode: str, llm: LLM) -> None:
        self.name, self.path, self.num_ranks, self.mode, self.llm = name, path, num_ranks, mode, llm

    def __repr__(self) -> str:
        return f"{self.name}-P{self.num_ranks}-{self.mode}"


@pytest.fixture(scope="module", params=ENGINES, ids=[f"{n}-P{p}-{m}" for n, p, m in ENGINES])
def engine(request: pytest.FixtureRequest, ckpt_root: str) -> Iterator[Engine]:
    name, num_ranks, mode = request.param
    path = _checkpoint(ckpt_root, name)
    with no_leftover_processes():
        with deadline(START_TIMEOUT, f"starting {num_ranks} ranks"):
            llm = LLM(model=path, num_ranks=num_ranks, mode=mode, **ENGINE_KW)
        try:
            yield Engine(name, path, num_ranks, mode, llm)
        finally:
            with deadline(60, "closing the engine"):
                llm.close()


def greedy(max_tokens: int = N_OUT, prompt_logits: bool = False) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, prompt_logits=prompt_logits)


def drain(llm: LLM, rids: list[str]) -> None:
    """Leave the shared engine idle whatever a test did (abort what is left, step until nothing is unfinished)."""
    for rid in rids:
        llm.abort(rid)
    for _ in range(1000):
        if not llm.has_unfinished():
            return
        llm.step()


def busy_ranks(llm: LLM) -> list[int]:
    """Ranks whose KV pool holds pages (as of the last step)."""
    per_rank = llm.kv_stats()["per_rank"]
    return [r for r, s in enumerate(per_rank) if s["free_tokens"] < s["total_tokens"]]


def assert_all_kv_free(e: Engine) -> None:
    stats = e.llm.kv_stats()
    per_rank = stats["per_rank"]
    assert len(per_rank) == e.num_ranks
    for r, s in enumerate(per_rank):
        assert s["total_tokens"] > 0
        assert s["free_tokens"] == s["total_tokens"], f"{e}: rank {r} KV pool not fully free: {stats}"
    # engine-wide: EP's requests on one rank each (the sum), TP's on every rank (one rank's pool)
    whole = sum(s["total_tokens"] for s in per_rank) if e.llm.mode == "ep" else per_rank[0]["total_tokens"]
    assert stats["free_tokens"] == stats["total_tokens"] == whole == stats["capacity"][e.llm.mode]


# Results of the batch test per (checkpoint, P, mode): every layout is compared with every one run before it.
_BATCH_RESULTS: dict[str, dict[str, tuple[list[list[int]], list[torch.Tensor]]]] = {}


# ---------------------------------------------------------------------------------------------------------------
# Tests over every (checkpoint, P, mode)
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_batch_matches_reference_and_other_layouts(engine: Engine) -> None:
    """A batch of mixed prompt lengths (chunked prefill, page boundaries): greedy tokens equal transformers' and
    every other layout's; prompt logits within 1e-4."""
    e, llm = engine, engine.llm
    assert e.llm.engine.world_size == e.num_ranks
    outs = llm.generate(PROMPTS, greedy(prompt_logits=True))
    tokens, logits = [], []
    for i, (out, prompt) in enumerate(zip(outs, PROMPTS, strict=True)):
        ref_tokens, ref_logits = reference(e.path, prompt)
        assert out.finished and out.finish_reason == "length"
        assert out.prompt_token_ids == prompt
        assert out.token_ids == ref_tokens, f"{e}: prompt {i} ({len(prompt)} tokens): greedy tokens differ from HF"
        got = out.prompt_logits
        assert isinstance(got, torch.Tensor) and got.dtype == torch.float32
        assert tuple(got.shape) == (len(prompt), VOCAB)
        err = rel_err(got, ref_logits)
        assert err <= LOGITS_RTOL, f"{e}: prompt {i} ({len(prompt)} tokens): prompt logits rel. error {err:.2e}"
        tokens.append(out.token_ids)
        logits.append(got)
    seen = _BATCH_RESULTS.setdefault(e.name, {})
    for other, (other_tokens, other_logits) in seen.items():
        assert tokens == other_tokens, f"{e} and {other}: greedy tokens differ"
        for i, (a, b) in enumerate(zip(logits, other_logits, strict=True)):
            err = rel_err(a, b)
            assert err <= LOGITS_RTOL, f"{e} and {other}: prompt {i}: prompt logits rel. error {err:.2e}"
    seen[repr(e)] = (tokens, logits)
    assert_all_kv_free(e)


@pytest.mark.slow
def test_staggered_arrivals_and_idle_ranks(engine: Engine) -> None:
    """Requests arrive and finish at different steps. In EP a request lives on one rank only, so for a while one
    rank decodes while the others (rank 0 included) only join the all-to-all; outputs still match transformers."""
    e, llm = engine, engine.llm
    # step -> requests added before that step: (prompt index, max_tokens)
    arrivals = {0: [(8, 3), (6, N_OUT)], 6: [(0, 12)], 9: [(3, 5), (7, 9)], 10: [(1, 1)]}
    rids: dict[str, tuple[int, int]] = {}
    last: dict[str, Any] = {}
    lone_steps = 0  # steps after which exactly one request held KV pages
    try:
        for step in range(200):
            for idx, max_tokens in arrivals.get(step, []):
                rids[llm.add_request(PROMPTS[idx], greedy(max_tokens))] = (idx, max_tokens)
            if step > max(arrivals) and not llm.has_unfinished():
                break
            for out in llm.step():
                assert out.request_id in rids
                assert out.request_id not in last or not last[out.request_id].finished, "output after finishing"
                last[out.request_id] = out
            live = [r for r in rids if r not in last or not last[r].finished]
            if len(live) == 1:
                lone_steps += 1
                busy = busy_ranks(llm)
                # EP: the one live request's pages are on its rank only; TP: every rank holds a shard of its KV.
                expected = 1 if e.mode == "ep" else e.num_ranks
                assert len(busy) == expected, f"{e}: one live request, KV pages on ranks {busy}"
        else:
            raise AssertionError(f"{e}: requests did not finish")
        assert lone_steps >= 3, "the schedule should leave one request decoding alone for a while"
        assert len(last) == len(rids)
        for rid, (idx, max_tokens) in rids.items():
            out = last[rid]
            assert out.finished and out.finish_reason == "length"
            ref_tokens, _ = reference(e.path, PROMPTS[idx])
            assert out.token_ids == ref_tokens[:max_tokens], f"{e}: request {rid} (prompt {idx}) differs from HF"
        assert_all_kv_free(e)
    finally:
        drain(llm, list(rids))


@pytest.mark.slow
def test_ep_places_requests_on_disjoint_ranks(engine: Engine) -> None:
    """EP: P requests added together go one to each rank (least-loaded placement); TP: every rank holds all."""
    e, llm = engine, engine.llm
    rids = [llm.add_request(PROMPTS[i], greedy(4)) for i in range(e.num_ranks)]
    try:
        llm.step()
        assert len(busy_ranks(llm)) == e.num_ranks
        used = [s["total_tokens"] - s["free_tokens"] for s in llm.kv_stats()["per_rank"]]
        if e.mode == "ep":
            # Prompts 0..P-1 have 1, 3, 4, 5 tokens: one or two pages each, on their own rank.
            pages = sorted(-(-len(PROMPTS[i]) // BLOCK) * BLOCK for i in range(e.num_ranks))
            assert sorted(used) == pages, f"{e}: KV tokens in use per rank {used}"
        else:
            assert len(set(used)) == 1, f"{e}: TP ranks disagree on KV use {used}"
        last = {}
        while llm.has_unfinished():
            for out in llm.step():
                last[out.request_id] = out
        for rid, i in zip(rids, range(e.num_ranks), strict=True):
            assert last[rid].token_ids == reference(e.path, PROMPTS[i])[0][:4]
        assert_all_kv_free(e)
    finally:
        drain(llm, rids)


@pytest.mark.slow
def test_aborts_leave_every_rank_kv_free(engine: Engine) -> None:
    """Some requests are aborted (before their first step, mid-prefill, mid-decode, after finishing); the rest
    still match transformers, and afterwards every rank's KV pool is fully free."""
    e, llm = engine, engine.llm
    order = [8, 2, 5, 7, 0, 4, 6]
    rids = {llm.add_request(PROMPTS[i], greedy(16)): i for i in order}
    by_prompt = {i: rid for rid, i in rids.items()}
    last: dict[str, Any] = {}

    def step() -> None:
        for out in llm.step():
            last[out.request_id] = out

    try:
        late = llm.add_request(PROMPTS[3], greedy(16))
        rids[late] = 3
        llm.abort(late)  # aborted in the same step plan that admits it
        step()  # the 37-token prompt is still being prefilled (32-token budget)
        llm.abort(by_prompt[8])  # mid-prefill
        step()
        step()
        step()
        llm.abort(by_prompt[5])  # mid-decode
        llm.abort(by_prompt[0])
        step()
        aborted = {late, by_prompt[8], by_prompt[5], by_prompt[0]}
        while llm.has_unfinished():
            step()
        llm.abort(by_prompt[2])  # already finished: nothing happens
        step()
        assert set(last) == set(rids)
        for rid, i in rids.items():
            out = last[rid]
            ref_tokens, _ = reference(e.path, PROMPTS[i])
            assert out.finished
            if rid in aborted:
                assert out.finish_reason == "abort", f"{e}: request {rid}"
                assert len(out.token_ids) < 16
                assert out.token_ids == ref_tokens[: len(out.token_ids)]
            else:
                assert out.finish_reason == "length"
                assert out.token_ids == ref_tokens[:16], f"{e}: request {rid} (prompt {i}) differs from HF"
        assert last[late].token_ids == []
        assert_all_kv_free(e)
    finally:
        drain(llm, list(rids))


# ---------------------------------------------------------------------------------------------------------------
# Start-up errors
# ---------------------------------------------------------------------------------------------------------------

SHAPE_ERRORS = [
    # (name, checkpoint overrides, P, words the message must contain)
    ("experts_6_on_4", dict(num_experts=6), 4, ["num_experts 6", "4 ranks"]),
    ("experts_8_on_3", {}, 3, ["3 ranks"]),  # 4 heads are not divisible by 3 either
    ("heads_6_on_4", dict(num_attention_heads=6, num_key_value_heads=2), 4, ["num_attention_heads 6", "4 ranks"]),
    ("kv_heads_6_on_4", dict(num_attention_heads=12, num_key_value_heads=6, head_dim=8), 4,
     ["num_key_value_heads 6", "4 ranks"]),
    ("kv_heads_3_on_2", dict(num_attention_heads=6, num_key_value_heads=3, head_dim=8), 2,
     ["num_key_value_heads 3", "2 ranks"]),
    ("moe_inter_30_on_4", dict(moe_intermediate_size=30), 4, ["moe_intermediate_size 30", "4 ranks"]),
    ("dense_inter_90_on_4", dict(intermediate_size=90, mlp_only_layers=[0]), 4, ["intermediate_size 90", "4 ranks"]),
]


@pytest.mark.parametrize("mode", ["tp", "ep"])
@pytest.mark.parametrize("name,overrides,num_ranks,words", SHAPE_ERRORS, ids=[c[0] for c in SHAPE_ERRORS])
def test_impossible_shapes_fail_at_construction(ckpt_root: str, name: str, overrides: dict[str, Any],
                                                num_ranks: int, words: list[str], mode: str) -> None:
    """Shapes for which a layout cannot exist raise ConfigError naming the numbers, before spawning any rank."""
    path = os.path.join(ckpt_root, f"bad_{name}")
    if not os.path.isdir(path):
        write_checkpoint(path, **overrides)
    before = multiprocessing.active_children()
    with deadline(60, "a failing start-up"), pytest.raises(ConfigError) as info:
        LLM(model=path, num_ranks=num_ranks, mode=mode, **ENGINE_KW)
    for w in words:
        assert w in str(info.value), f"error message {str(info.value)!r} should contain {w!r}"
    assert set(multiprocessing.active_children()) == set(before), "no rank process may be started for impossible shapes"


def _drop_tensors(src: str, dst: str, names: list[str]) -> None:
    """Copy a single-file checkpoint without the given tensors."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    file = os.path.join(dst, "model.safetensors")
    tensors = load_file(file)
    for n in names:
        del tensors[n]
    save_file(tensors, file, metadata={"format": "pt"})


MISSING = [
    # (mode, tensor): in EP only rank 1 holds expert 7, so only rank 1 fails; in TP every rank needs k_proj.
    ("ep", "model.layers.1.mlp.experts.7.down_proj.weight"),
    ("tp", "model.layers.0.self_attn.k_proj.weight"),
]


@pytest.mark.slow
@pytest.mark.parametrize("mode,tensor", MISSING, ids=[m for m, _ in MISSING])
def test_missing_tensor_fails_cleanly_on_two_ranks(ckpt_root: str, mode: str, tensor: str) -> None:
    """A tensor missing from the checkpoint: the front end reads the files' headers and raises an error naming it
    before the ranks build anything (no hang), and no rank process is left running."""
    path = os.path.join(ckpt_root, f"missing_{mode}")
    if not os.path.isdir(path):
        _drop_tensors(_checkpoint(ckpt_root, "gqa8"), path, [tensor])
    with no_leftover_processes():
        with deadline(START_TIMEOUT, "a failing start-up"), pytest.raises((RankError, ConfigError)) as info:
            LLM(model=path, num_ranks=2, mode=mode, **ENGINE_KW)
    msg = str(info.value)
    assert tensor in msg, f"error message {msg!r} should name the missing tensor"
    assert info.type is ConfigError and "rank" not in msg, f"the front end's own check, once: {msg!r}"


# ---------------------------------------------------------------------------------------------------------------
# A rank process that dies
# ---------------------------------------------------------------------------------------------------------------

def _rank_processes(llm: LLM) -> list[multiprocessing.Process]:
    procs = llm.engine.ranks._procs  # white-box: the spawned rank processes of this engine
    assert len(procs) == 2
    return procs


@pytest.mark.slow
@pytest.mark.parametrize("victim", [1, 0])
def test_rank_killed_mid_run_raises_rank_error(ckpt_root: str, victim: int) -> None:
    """A rank process killed between steps: the next step raises RankError (no hang), close() leaves nothing."""
    path = _checkpoint(ckpt_root, "gqa8")
    with no_leftover_processes():
        with deadline(START_TIMEOUT, "starting 2 ranks"):
            llm = LLM(model=path, num_ranks=2, mode="ep", **ENGINE_KW)
        try:
            assert llm.generate([PROMPTS[2]], greedy(2))[0].token_ids == reference(path, PROMPTS[2])[0][:2]
            proc = _rank_processes(llm)[victim]
            proc.kill()
            proc.join(timeout=10)
            with deadline(60, "a step after a rank died"), pytest.raises(RankError):
                llm.generate([PROMPTS[3]], greedy(2))
        finally:
            with deadline(60, "closing after a rank died"):
                llm.close()


@pytest.mark.slow
@pytest.mark.parametrize("victim", [1, 0])
def test_stuck_rank_trips_the_watchdog(ckpt_root: str, victim: int) -> None:
    """A rank process that stops answering but stays alive (SIGSTOP: as a rank stuck in a collective whose peer
    left): the next step raises RankError after --watchdog-timeout instead of hanging, and the ranks are stopped."""
    path = _checkpoint(ckpt_root, "gqa8")
    with no_leftover_processes():
        with deadline(START_TIMEOUT, "starting 2 ranks"):
            llm = LLM(model=path, num_ranks=2, mode="tp", watchdog_timeout=3, **ENGINE_KW)
        try:
            assert llm.generate([PROMPTS[2]], greedy(2))[0].token_ids == reference(path, PROMPTS[2])[0][:2]
            procs = _rank_processes(llm)
            os.kill(procs[victim].pid, signal.SIGSTOP)
            t = time.monotonic()
            with deadline(60, "a step with a stuck rank"), pytest.raises(RankError, match="no answer in 3 s"):
                llm.generate([PROMPTS[3]], greedy(2))
            assert time.monotonic() - t < 30
            assert not any(p.is_alive() for p in procs)  # the watchdog stopped them (a stopped process too)
        finally:
            with deadline(60, "closing after the watchdog"):
                llm.close()


@pytest.mark.slow
def test_rank_dying_during_start_up_raises(ckpt_root: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 killed while the ranks start: the constructor raises RankError instead of hanging."""
    from moebius.worker import launch as ranks

    recv = ranks.SpawnedRanks._recv

    def kill_rank0_then_recv(self: Any) -> tuple[str, Any]:
        self._procs[0].kill()  # before it can report: it is still importing torch
        self._procs[0].join(timeout=10)
        return recv(self)

    monkeypatch.setattr(ranks.SpawnedRanks, "_recv", kill_rank0_then_recv)
    path = _checkpoint(ckpt_root, "gqa8")
    with no_leftover_processes():
        with deadline(10, "a start-up whose rank 0 died"), pytest.raises(RankError):
            LLM(model=path, num_ranks=2, mode="tp", **ENGINE_KW)


@pytest.mark.slow
def test_two_plans_ahead_give_the_same_tokens_through_aborts_and_switches(ckpt_root: str) -> None:
    """--plans-ahead 2 on two rank processes: requests added, one aborted mid-run, served across a switch each way,
    get transformers' tokens; nothing is left in flight once the ranks are idle, and every rank's KV is free."""
    path = _checkpoint(ckpt_root, "gqa8")
    with no_leftover_processes():
        with deadline(START_TIMEOUT, "starting 2 ranks"):
            llm = LLM(model=path, num_ranks=2, mode="ep", plans_ahead=2, **ENGINE_KW)
        try:
            rids = {llm.add_request(PROMPTS[i], greedy(16)): i for i in (0, 2, 4, 6)}
            last: dict[str, Any] = {}

            def step() -> None:
                for out in llm.step():
                    last[out.request_id] = out

            step()
            step()
            assert llm.engine.steps_in_flight == 2
            aborted = next(iter(rids))
            llm.abort(aborted)
            step()
            llm.engine.request_switch("tp")
            step()
            assert llm.mode == "tp" and llm.engine.steps_in_flight == 0  # nothing ahead of a switch's step
            late = llm.add_request(PROMPTS[5], greedy(16))
            rids[late] = 5
            step()
            step()
            llm.engine.request_switch("ep")
            step()
            assert llm.mode == "ep"
            while llm.has_unfinished():
                step()
            assert llm.engine.steps_in_flight == 0
            for rid, i in rids.items():
                ref_tokens, _ = reference(path, PROMPTS[i])
                out = last[rid]
                assert out.finished, rid
                if rid == aborted:
                    assert out.finish_reason == "abort" and out.token_ids == ref_tokens[: len(out.token_ids)]
                else:
                    assert out.token_ids == ref_tokens[:16], (rid, i)
            assert all(s["free_tokens"] == s["total_tokens"] for s in llm.kv_stats()["per_rank"])
        finally:
            with deadline(60, "closing the engine"):
                llm.close()
