"""Checks shared by the model-family tests (tests/test_<family>_family.py, tests/test_<family>_presets.py): each
family's checkpoints served on the CPU in float32 against transformers' own greedy tokens, in both layouts across a
switch and under live switches with arrivals, aborts and n > 1, with no KV page leaked; the presets' refusals and the
command line's help. Each family's file holds what is its own: its checkpoints, engines, prompts and lengths."""

from __future__ import annotations

import functools
import json
import os
import random
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import pytest
import torch
from conftest import MIN_MARGIN, VOCAB, _reinit_

from moebius import LLM, SamplingParams
from moebius.config import PRESETS, ConfigError
from moebius.models.registry import model_config
from moebius.parallel.layout import check_shapes

BLOCK = 4
# Every family's CPU engine: 4-token pages and a 16-token step budget, so prompt chunks and decodes share steps.
ENGINE_KW: dict[str, Any] = dict(dtype="float32", device="cpu", block_size=BLOCK, max_total_tokens=512,
                                 max_num_batched_tokens=16, max_running_requests=8, seed=0)


def random_prompts(seed: int, lengths: Sequence[int]) -> list[list[int]]:
    """Prompts of random token ids of these lengths (a family's seed keeps its greedy margins comfortable)."""
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(n)] for n in lengths]


def write_hf_checkpoint(path: str, arch: str, config: dict[str, Any], seed: int, *, router_bias: bool = False
                        ) -> str:
    """Save a random model of transformers' class `arch` and this config with save_pretrained (no EOS: greedy runs
    go their full length), seeded, its weights re-initialised as conftest's `_reinit_` does; with router_bias, the
    routers' e_score_correction_bias random too (std 0.1: it changes some choices). Returns path."""
    import transformers

    model_class = getattr(transformers, arch)
    cfg = model_class.config_class(**{**config, "eos_token_id": None})
    cfg.architectures = [arch]
    torch.manual_seed(seed)
    model = model_class(cfg).float().eval()
    _reinit_(model, seed)
    if router_bias:
        g = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for name, b in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    model.save_pretrained(path)
    return path


def hf_config(path: str) -> dict[str, Any]:
    """A checkpoint's config.json."""
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def saved_tensors(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint's model.safetensors, by name."""
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))


# ---------------------------------------------------------------------------------------------------------------
# transformers' oracle
# ---------------------------------------------------------------------------------------------------------------

@functools.cache
def hf_model(path: str) -> torch.nn.Module:
    """transformers' model of a checkpoint (its architecture's own class), float32, eager attention and experts;
    loaded once a path."""
    from transformers import AutoModelForCausalLM

    return as_configured(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager",
                                                              experts_implementation="eager").eval())


def as_configured(model: torch.nn.Module) -> torch.nn.Module:
    """transformers' model computing what its config says: older releases (5.17, the GPU machine's) hard-code GPT-OSS's
    clamped SwiGLU (alpha 1.702, limit 7.0) where newer ones (5.25) read the config's swiglu_alpha / swiglu_limit, so
    5.17 gave other tokens than the engine for a checkpoint of limit 2, on either device."""
    for name in ("alpha", "limit"):
        value = getattr(model.config, f"swiglu_{name}", None)
        for m in model.modules():
            if value is not None and type(m).__name__ == "GptOssExperts":
                setattr(m, name, value)
    return model


@functools.cache
def _hf_greedy(path: str, prompt: tuple[int, ...], n: int) -> tuple[int, ...]:
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = hf_model(path)(input_ids=torch.tensor([seq]), use_cache=False).logits[0, -1]
            top2 = logits.topk(2).values
            assert float(top2[0] - top2[1]) > MIN_MARGIN, f"test-suite bug: ill-conditioned greedy path {prompt}"
            seq.append(int(logits.argmax()))
    return tuple(seq[len(prompt):])


def hf_greedy(path: str, prompt: Sequence[int], n: int) -> list[int]:
    """transformers' n greedy tokens after the prompt (a full forward a step, no cache), every step's top-1 / top-2
    logit margin asserted above MIN_MARGIN (a closer one is a test-suite bug: the engine's float32 may differ)."""
    return list(_hf_greedy(path, tuple(prompt), n))


# ---------------------------------------------------------------------------------------------------------------
# The engine's outputs
# ---------------------------------------------------------------------------------------------------------------

def lazy_checkpoints(root: Any, makers: dict[str, Callable[[str, Callable[[str], str]], str]]
                     ) -> Callable[[str], str]:
    """A module's checkpoints by name, each written under `root` when first asked (`makers[name](path, get)`: a
    maker may ask for the checkpoints it derives from)."""
    paths: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in paths:
            paths[name] = makers[name](str(root / name), get)
        return paths[name]

    return get


def serve(path: str, P: int, mode: str, engine_kw: dict[str, Any]) -> Iterator[tuple[str, int, LLM]]:
    """(path, P, the engine) of P ranks on the checkpoint, starting in mode; closed when resumed (an engine
    fixture's body: `yield from serve(...)`)."""
    with LLM(model=path, num_ranks=P, mode=mode, **engine_kw) as llm:
        yield path, P, llm


def greedy_outputs(llm: LLM, prompts: Sequence[Sequence[int]], n: int) -> list[list[int]]:
    """The engine's n greedy tokens for each prompt, served as one batch."""
    outs = llm.generate([list(p) for p in prompts], SamplingParams(temperature=0.0, max_tokens=n))
    return [list(o.outputs[0].token_ids) for o in outs]


def assert_kv_free(llm: LLM) -> None:
    """Every rank's KV pages are free (nothing leaked by a finished, aborted or moved request)."""
    for r, s in enumerate(llm.kv_stats()["per_rank"]):
        assert s["free_tokens"] == s["total_tokens"] > 0, f"rank {r} leaks KV in {llm.mode}: {s}"


def assert_routed(routed_experts: Any, shape: tuple[int, int, int], num_experts: int) -> None:
    """An output's routed experts: shape (tokens, MoE layers, top-k), every id one of the num_experts experts."""
    routed = torch.tensor(routed_experts)
    assert routed.shape == shape and 0 <= routed.min() and routed.max() < num_experts


def other(mode: str) -> str:
    """The layout a switch from mode goes to."""
    return "ep" if mode == "tp" else "tp"


# ---------------------------------------------------------------------------------------------------------------
# Parity with transformers across switches
# ---------------------------------------------------------------------------------------------------------------

def parity_across_switch(llm: LLM, path: str, prompts: Sequence[Sequence[int]], n: int, *, back: bool = True
                         ) -> None:
    """A batch of the prompts in the engine's start layout, then in the other after a switch (then, with back, in
    the start layout again after a second switch): each time transformers' n greedy tokens, every switch done and
    every KV page free after each batch."""
    want = [hf_greedy(path, p, n) for p in prompts]
    start = llm.mode
    for mode in (start, other(start), start)[: 3 if back else 2]:
        if llm.mode != mode:
            assert llm.switch_mode(mode).done
        assert greedy_outputs(llm, prompts, n) == want, f"{os.path.basename(path)} {mode}"
        assert_kv_free(llm)


class Job(NamedTuple):
    """A request of the switch stress: added at step `arrive`, aborted at step `abort_at` (None: runs to its end)."""

    arrive: int
    prompt: Sequence[int]
    params: SamplingParams
    abort_at: int | None = None


def stress_jobs(prompts: Sequence[Sequence[int]], aborted_tokens: int) -> list[Job]:
    """The switch stress's five requests over five prompts: three greedy ones arriving at steps 0, 2 and 5, a sampled
    one with n = 2, and a greedy one of aborted_tokens tokens aborted at step 4."""
    return [Job(0, prompts[4], SamplingParams(temperature=0.0, max_tokens=8)),
            Job(0, prompts[1], SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=6, n=2)),
            Job(0, prompts[3], SamplingParams(temperature=0.0, max_tokens=aborted_tokens), 4),
            Job(2, prompts[2], SamplingParams(temperature=0.0, max_tokens=6)),
            Job(5, prompts[0], SamplingParams(temperature=0.0, max_tokens=5))]


SWITCH_STEPS = frozenset({1, 2, 3, 5, 6, 8, 11})


def _run_jobs(llm: LLM, jobs: Sequence[Job], switch_at: Collection[int]) -> dict[int, list[list[int]]]:
    """Step the engine through the jobs' arrivals and aborts, switching layout before each step in switch_at, until
    every job has arrived and nothing is unfinished: each job's samples' tokens ([[]] if it had no output)."""
    ids: dict[int, str] = {}
    last: dict[str, Any] = {}
    settled = max(job.arrive for job in jobs) + 1  # no stop before every job has arrived
    for step in range(200):
        for j, job in enumerate(jobs):
            if job.arrive == step:
                ids[j] = llm.add_request(list(job.prompt), job.params)
            if job.abort_at == step:
                llm.abort(ids[j])
        if step in switch_at:
            assert llm.switch_mode(other(llm.mode)).done
        if step > settled and not llm.has_unfinished():
            break
        for out in llm.step():
            last[out.request_id] = out
    return {j: [list(c.token_ids) for c in last[r].outputs] if r in last else [[]] for j, r in ids.items()}


def switch_stress(llm: LLM, path: str, jobs: Sequence[Job], switch_at: Collection[int] = SWITCH_STEPS) -> None:
    """The jobs run without switches, then again with a switch before each step in switch_at (back to the start
    layout after): each job's outputs are those of the run without switches, a greedy one's transformers' tokens,
    an aborted one's every sample a prefix of transformers' greedy tokens; every KV page is free afterwards."""
    start = llm.mode
    ref = _run_jobs(llm, jobs, ())
    got = _run_jobs(llm, jobs, switch_at)
    if llm.mode != start:
        assert llm.switch_mode(start).done
    for j, job in enumerate(jobs):
        if job.abort_at is not None:
            full = hf_greedy(path, job.prompt, job.params.max_tokens)
            assert all(t == full[: len(t)] for t in got[j]), f"job {j}: aborted output is not a greedy prefix"
            continue
        assert got[j] == ref[j], f"job {j} differs from the run without switches"
        if job.params.temperature == 0:
            assert got[j][0] == hf_greedy(path, job.prompt, job.params.max_tokens), f"job {j} differs from transformers"
    assert_kv_free(llm)


def unpacked_dtypes(packing: type, path: str, prompt: Sequence[int], monkeypatch: pytest.MonkeyPatch
                    ) -> list[torch.dtype]:
    """The dtype of every tensor `packing` (a quantized format's class) unpacks while a bfloat16 engine on one rank
    (in this process) loads the checkpoint at `path` and serves a prompt 3 tokens."""
    seen: list[torch.dtype] = []
    unpack = packing.unpack

    def spy(self: Any, pieces: Any, dtype: torch.dtype) -> torch.Tensor:
        out = unpack(self, pieces, dtype)
        seen.append(out.dtype)
        return out

    monkeypatch.setattr(packing, "unpack", spy)
    with LLM(model=path, **{**ENGINE_KW, "dtype": "bfloat16"}) as llm:
        assert len(greedy_outputs(llm, [prompt], 3)[0]) == 3
    return seen


def well_conditioned(path: str, prompts: Sequence[Sequence[int]], n: int
                     ) -> tuple[list[Sequence[int]], list[list[int]]]:
    """The prompts whose n-token greedy path in transformers is well conditioned (`hf_greedy`'s margin), with those
    paths: the GPU's machine has its own transformers, whose random checkpoints differ from CI's, so a prompt may meet
    a near tie there (which the engine's float32 could rightly flip). All but one must be kept."""
    kept: list[tuple[Sequence[int], list[int]]] = []
    for p in prompts:
        try:
            kept.append((p, hf_greedy(path, p, n)))
        except AssertionError:
            continue
    assert len(kept) >= max(1, len(prompts) - 1), f"{len(prompts) - len(kept)} ill-conditioned greedy paths"
    return [p for p, _ in kept], [w for _, w in kept]


def first_difference(got: Sequence[Sequence[int]], want: Sequence[Sequence[int]]) -> str:
    """Where two runs' greedy tokens first part (what a failed parity run reports, so that it can be read off a log)."""
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if list(g) != list(w):
            j = next((k for k, (a, b) in enumerate(zip(g, w, strict=False)) if a != b), min(len(g), len(w)))
            return f"prompt {i}, token {j}: {list(g)} against {list(w)}"
    return "the same tokens"


def gpu_parity(path: str, prompts: Sequence[Sequence[int]], n: int, engine_kw: dict[str, Any]) -> None:
    """On the GPU in float32: an engine's decode graphs and step pieces exist (a probe of each), and it gives
    transformers' n greedy tokens in TP, in EP after a switch and in TP again, every KV page free after each; so do
    eager steps (no graphs), graphs with every step resolved first (no overlap) and graphs with the shared experts
    after the routed ones on the main stream (--disable-shared-experts-stream; the same kernels elsewhere). Every
    run is made before the verdict, which names each one that parted from transformers and where (a GPU run is
    scarce: one tells whether the graphs, a layout or the kernels part)."""
    from moebius.link.messages import DecodeProbe, PrefillProbe

    prompts, want = well_conditioned(path, prompts, n)
    kw = dict(engine_kw, device="cuda", cuda_graph_max_bs=8, warmup="none")
    parted: list[str] = []

    def check(run: str, got: list[list[int]]) -> None:
        if got != want:
            parted.append(f"{run}: {first_difference(got, want)}")

    with LLM(model=path, **kw) as llm:
        assert all(r["cuda_graph"] for r in llm.engine.probe(DecodeProbe(batch=2, context=8, steps=1, warmup=0,
                                                                         graphs=True)))
        assert all(r["pieces"] for r in llm.engine.probe(PrefillProbe(tokens=16, context=8, steps=1, warmup=0)))
        for mode in ("tp", "ep", "tp"):
            if llm.mode != mode:
                assert llm.switch_mode(mode).done
            check(mode, greedy_outputs(llm, prompts, n))
            assert_kv_free(llm)
    for flag in ("disable_cuda_graph", "disable_overlap_schedule", "disable_shared_experts_stream"):
        with LLM(model=path, **{flag: True}, **kw) as llm:
            check(flag, greedy_outputs(llm, prompts, n))
    assert not parted, "; ".join(parted)


def gpu_quantized_agreement(path: str, dequantized: str, quantization: str, prompts: Sequence[Sequence[int]],
                            n: int, **engine: Any) -> None:
    """On a GPU in bf16: the engine on a checkpoint with `quantization` (and `engine`'s settings; the fused MoE on its
    rows), in TP and in EP after a switch, against the engine on the dequantized checkpoint, position by position on
    the latter's own greedy sequences (teacher-forced, so that one flip does not carry on into the tokens after it):
    a request a prefix of each sequence, two tokens, the first from its prompt step, the second from a decode step
    (through the decode graphs; counted where the first agreed). The weights are the same values up to the
    dequantized checkpoint's bf16 rounding, which the quantized kernels do not make, and the kernels' K steps
    differ, so nearly every position, not all: 90 %."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    kw = dict(ENGINE_KW, device="cuda", dtype="bfloat16")
    with LLM(model=dequantized, **kw) as llm:
        want = greedy_outputs(llm, prompts, n)
    prefixes = [(s, i) for s in range(len(prompts)) for i in range(n - 1)]

    def agreement(llm: LLM) -> tuple[int, int]:
        outs = greedy_outputs(llm, [list(prompts[s]) + want[s][:i] for s, i in prefixes], 2)
        same = total = 0
        for (s, i), (first, second) in zip(prefixes, outs, strict=True):
            total, same = total + 1, same + (first == want[s][i])
            if first == want[s][i]:
                total, same = total + 1, same + (second == want[s][i + 1])
        return same, total

    with LLM(model=path, quantization=quantization, **kw, **engine) as llm:
        got = [agreement(llm)]
        assert llm.switch_mode("ep").done
        got.append(agreement(llm))
    for same, total in got:
        assert same >= 0.9 * total, (got, want)


# ---------------------------------------------------------------------------------------------------------------
# Presets
# ---------------------------------------------------------------------------------------------------------------

def generate_help(sep: str = " ") -> str:
    """`moebius generate --help` (it exits 0), each run of whitespace replaced by sep: argparse wraps the preset
    names over lines (at their hyphens too: sep "" joins those)."""
    import contextlib
    import io

    from moebius.entrypoints.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["generate", "--help"]) == 0
    return sep.join(out.getvalue().split())


def assert_presets_named(presets: Iterable[str], sep: str = " ") -> None:
    """Every preset is in `moebius generate --help` (see generate_help for sep)."""
    text = generate_help(sep)
    for preset in presets:
        assert preset in text


def assert_rank_count_refused(preset: str, P: int, what: str) -> None:
    """P ranks of the preset are refused naming what does not divide: by check_shapes and by the engine before any
    rank starts (the front end checks the shapes)."""
    with pytest.raises(ConfigError, match=what):
        check_shapes(model_config(PRESETS[preset]), P)
    with pytest.raises(ConfigError, match=what):
        LLM(model=preset, load_format="dummy", num_layers=1, device="cpu", num_ranks=P)
