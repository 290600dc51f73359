"""Shared fixtures: tiny random Qwen3-MoE checkpoints written with transformers, and a transformers oracle.

Every checkpoint is written once per session (session-scoped `ckpt` fixture) and every Hugging Face model is
loaded once per path. Weights are re-initialised with a large std so that the greedy top-1/top-2 logit margins are
comfortable (default init with std 0.02 gives near-ties and flaky greedy comparisons); `test_oracle_is_well_conditioned`
in test_hf_equivalence.py checks that margin for every prompt the suite uses.
"""

from __future__ import annotations

import functools
import json
import os
import random
import shutil
import sys
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

VOCAB = 300  # byte tokens 0..255 + specials 256..258 + unused rows (the byte tokenizer ids all fit)
ENDOFTEXT_ID = 256

# Keyword arguments of transformers' Qwen3MoeConfig shared by every variant.
BASE_CONFIG: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
    norm_topk_prob=True, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, mlp_only_layers=[], decoder_sparse_step=1,
)

# Architecture variants the engine must reproduce exactly.
VARIANTS: dict[str, dict[str, Any]] = {
    # GQA (4 query heads, 2 KV heads), renormalised top-k weights, separate lm_head.
    "base": {},
    # MHA (4 KV heads), raw softmax top-k weights, lm_head tied to the embedding (no lm_head.weight on disk).
    "tied_mha_nonorm": dict(norm_topk_prob=False, tie_word_embeddings=True, num_key_value_heads=4,
                            num_hidden_layers=2),
    # Layer 1 is a dense SwiGLU MLP (mlp_only_layers); Qwen's real rope_theta.
    "dense_layer": dict(mlp_only_layers=[1], rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    # decoder_sparse_step=2: layers 1 and 3 are MoE, 0 and 2 dense; 6 experts, top-3; MQA (1 KV head).
    "sparse_step2": dict(decoder_sparse_step=2, num_hidden_layers=4, num_experts=6, num_experts_per_tok=3,
                         num_key_value_heads=1, rms_norm_eps=1e-5),
}

# Token-id prompts used across the suite (deterministic; lengths cross 4- and 16-token block boundaries).
PROMPT_LENS = (1, 5, 17, 33, 40)
_rng = random.Random(15)  # seed chosen so every reference greedy path has top-2 gaps > 1e-2
PROMPTS: list[list[int]] = [[_rng.randrange(VOCAB) for _ in range(n)] for n in PROMPT_LENS]
TEXT_PROMPTS = ["The quick brown fox", "Hello, world! ", "Once upon a time, there was a little girl who lived",
                "x"]
PRINTABLE = range(32, 127)  # ids (= bytes) of printable ASCII characters
# Smallest top-1/top-2 logit gap allowed on a reference greedy path. float32 logits of these models differ from a
# float64 computation by at most ~3e-5, so a gap of 2e-3 leaves a wide safety factor for reordered arithmetic.
MIN_MARGIN = 2e-3


# ---------------------------------------------------------------------------------------------------------------
# Checkpoint writing
# ---------------------------------------------------------------------------------------------------------------

def _reinit_(model: torch.nn.Module, seed: int) -> None:
    """Large-std random weights: clear greedy margins, non-degenerate attention and routing."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # RMSNorm scales (input/post-attn/final norm, q_norm, k_norm)
                p.copy_(torch.empty(p.shape).uniform_(0.8, 1.2, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:  # linear weights, fused expert weights, router gate, lm_head
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (what the ByteLevel pre-tokenizer emits)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    n = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + n)
            n += 1
    return chars


def write_byte_tokenizer(path: str) -> None:
    """tokenizer.json: byte-level BPE with the 256 byte tokens (id = byte value), no merges, specials 256..258."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {c: b for b, c in _bytes_to_unicode().items()}
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    assert tok.token_to_id("<|endoftext|>") == ENDOFTEXT_ID
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "bos_token": None}, f)


def write_checkpoint(path: str, overrides: dict[str, Any] | None = None, *, seed: int = 0,
                     max_shard_size: str | None = None, tokenizer: bool = False, ascii_bias: bool = False,
                     eos_token_id: int | None = None) -> str:
    """Save a random Qwen3MoeForCausalLM with save_pretrained; return the directory.

    ascii_bias scales down the lm_head rows of non-printable ids so greedy text is (almost) all printable ASCII:
    the byte tokenizer then decodes one character per token, which makes stop-string tests exact.
    """
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(**{**BASE_CONFIG, **(overrides or {}), "eos_token_id": eos_token_id})
    cfg.architectures = ["Qwen3MoeForCausalLM"]
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(cfg).float().eval()
    _reinit_(model, seed)
    if ascii_bias:
        assert not cfg.tie_word_embeddings
        keep = torch.zeros(VOCAB, dtype=torch.bool)
        keep[list(PRINTABLE)] = True
        with torch.no_grad():
            model.lm_head.weight[~keep] *= 0.1
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    if tokenizer:
        write_byte_tokenizer(path)
    return path


# Keyword arguments of transformers' DeepseekV3Config / DeepseekV2Config (tiny: 4 heads, 8 experts, P up to 4).
DEEPSEEK_V3_CONFIG: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2,
    n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=48,
    qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, first_k_dense_replace=1, max_position_embeddings=512,
    rms_norm_eps=1e-6, tie_word_embeddings=False,
    rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "beta_fast": 32,
                  "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
)
# V2: softmax group-limited greedy routing, q projected directly (no q-LoRA), two shared experts, every layer MoE.
DEEPSEEK_V2_CONFIG: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=4, n_shared_experts=2, n_routed_experts=8, num_experts_per_tok=2,
    n_group=4, topk_group=2, topk_method="group_limited_greedy", norm_topk_prob=False, routed_scaling_factor=1.0,
    kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16,
    first_k_dense_replace=0, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
)


def write_deepseek_checkpoint(path: str, version: int = 3, overrides: dict[str, Any] | None = None, *,
                              seed: int = 0) -> str:
    """Save a random DeepseekV3ForCausalLM (version 3) or DeepseekV2ForCausalLM (2) with save_pretrained, its
    weights re-initialised as `_reinit_` does and V3's e_score_correction_bias random (std 0.1: it changes some
    choices); return the directory."""
    from family_cases import write_hf_checkpoint  # (it imports this module: imported when called)

    base = DEEPSEEK_V3_CONFIG if version == 3 else DEEPSEEK_V2_CONFIG
    return write_hf_checkpoint(path, f"DeepseekV{version}ForCausalLM", {**base, **(overrides or {})}, seed,
                               router_bias=True)


def set_eos(path: str, eos_token_id: int | list[int] | None) -> None:
    """Rewrite eos_token_id in config.json and generation_config.json (where present)."""
    for name in ("config.json", "generation_config.json"):
        f = os.path.join(path, name)
        if os.path.isfile(f):
            with open(f) as fh:
                d = json.load(fh)
            d["eos_token_id"] = eos_token_id
            with open(f, "w") as fh:
                json.dump(d, fh, indent=2)


class Checkpoints:
    """Lazily written, session-cached checkpoint directories, by name."""

    def __init__(self, root: str) -> None:
        self.root = root
        self._paths: dict[str, str] = {}
        self._makers: dict[str, Callable[[str], str]] = {
            **{name: functools.partial(write_checkpoint, overrides=ov) for name, ov in VARIANTS.items()},
            # Same weights as "base" (same seed), written in many shards with model.safetensors.index.json.
            "base_sharded": functools.partial(write_checkpoint, max_shard_size="60KB"),
            # Other random weights of base's shapes (a weight update's target).
            "base_b": functools.partial(write_checkpoint, seed=3),
            # Other random weights of dense_layer's shapes (an update of a dense MLP layer).
            "dense_layer_b": functools.partial(write_checkpoint, overrides=VARIANTS["dense_layer"], seed=3),
            # Byte tokenizer + EOS = <|endoftext|>; greedy text is printable ASCII.
            "text": functools.partial(write_checkpoint, seed=1, tokenizer=True, ascii_bias=True,
                                      eos_token_id=ENDOFTEXT_ID),
            # DeepSeek-V3 (q-LoRA, sigmoid group-limited routing with its bias, a shared expert, a dense first
            # layer, YaRN) and DeepSeek-V2 (softmax group-limited greedy, no q-LoRA, two shared experts)
            "deepseek_v3": functools.partial(write_deepseek_checkpoint, version=3),
            "deepseek_v2": functools.partial(write_deepseek_checkpoint, version=2),
            # V3 with attention_bias (q_a / kv_a / o_proj biases: o_proj's on one TP shard only); V2 with q-LoRA and
            # plain greedy routing
            "deepseek_v3_bias": functools.partial(write_deepseek_checkpoint, version=3,
                                                  overrides=dict(attention_bias=True)),
            "deepseek_v2_lora": functools.partial(write_deepseek_checkpoint, version=2,
                                                  overrides=dict(q_lora_rank=48, topk_method="greedy")),
            # other random weights of deepseek_v3's shapes (a weight update's target)
            "deepseek_v3_b": functools.partial(write_deepseek_checkpoint, version=3, seed=3),
        }

    def __call__(self, name: str) -> str:
        if name not in self._paths:
            path = os.path.join(self.root, name)
            self._paths[name] = self._makers[name](path)
        return self._paths[name]

    def copy(self, name: str, new_name: str) -> str:
        """A fresh copy of a checkpoint directory, to corrupt or reconfigure."""
        dst = os.path.join(self.root, new_name)
        if os.path.exists(dst):
            shutil.rmtree(dst)
        shutil.copytree(self(name), dst)
        return dst


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "same_at_p4(why, **params): skipped in its P = 4 instances (an id part P4), "
                            "where `params` (if any) equal the test's: it checks nothing that differs with P")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """same_at_p4: the RL modules' P = 4 engines run only the cuts, switches and updates (CI's time). Skipped at
    collection, so a skipped test sets up no function fixture (a trainer process)."""
    for item in items:
        mark = item.get_closest_marker("same_at_p4")
        spec = getattr(item, "callspec", None)
        if mark is None or spec is None or "P4" not in spec.id.split("-"):
            continue
        if all(spec.params.get(k) == v for k, v in mark.kwargs.items()):
            item.add_marker(pytest.mark.skip(reason=f"P = 4 adds nothing here: {mark.args[0]}"))


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Checkpoints:
    return Checkpoints(str(tmp_path_factory.mktemp("ckpts")))


# ---------------------------------------------------------------------------------------------------------------
# Hugging Face oracle
# ---------------------------------------------------------------------------------------------------------------

@functools.cache
def hf_model(path: str) -> torch.nn.Module:
    from transformers import Qwen3MoeForCausalLM

    model = Qwen3MoeForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager",
                                                experts_implementation="eager")
    return model.eval()


@functools.cache
def _hf_logits(path: str, ids: tuple[int, ...]) -> torch.Tensor:
    with torch.no_grad():
        out = hf_model(path)(input_ids=torch.tensor([ids]), use_cache=False)
    return out.logits[0].float()


def hf_logits(path: str, prompt_ids: Sequence[int]) -> torch.Tensor:
    """[len(prompt_ids), vocab] float32 logits of a full forward pass."""
    return _hf_logits(path, tuple(prompt_ids)).clone()


@functools.cache
def _hf_greedy(path: str, ids: tuple[int, ...], n: int, banned: tuple[int, ...],
               banned_until: int) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """Greedy tokens and the top-1/top-2 margin at every step; full-sequence forward each step (no KV cache)."""
    seq, margins = list(ids), []
    for j in range(n):
        logits = _hf_logits(path, tuple(seq))[-1].clone()
        if j < banned_until and banned:
            logits[list(banned)] = float("-inf")
        top2 = logits.topk(2).values
        margins.append(float(top2[0] - top2[1]))
        seq.append(int(logits.argmax()))
    return tuple(seq[len(ids):]), tuple(margins)


def hf_greedy(path: str, prompt_ids: Sequence[int], n_tokens: int, *, banned: Sequence[int] = (),
              banned_until: int = 0) -> list[int]:
    """n_tokens greedy tokens of transformers' model, EOS disabled.

    `banned` ids are masked out for the first `banned_until` outputs (vLLM's min_tokens: EOS and stop tokens
    cannot be generated before min_tokens outputs).
    """
    tokens, margins = _hf_greedy(path, tuple(prompt_ids), n_tokens, tuple(banned), banned_until)
    j = min(range(n_tokens), key=margins.__getitem__)
    assert margins[j] > MIN_MARGIN, (
        f"test-suite bug: reference greedy path is ill-conditioned (top-2 logit gap {margins[j]:.1e} at output {j}); "
        "pick another prompt or seed")
    return list(tokens)


def hf_greedy_min_margin(path: str, prompt_ids: Sequence[int], n_tokens: int, *, banned: Sequence[int] = (),
                         banned_until: int = 0) -> float:
    return min(_hf_greedy(path, tuple(prompt_ids), n_tokens, tuple(banned), banned_until)[1])


def decode_bytes(ids: Sequence[int]) -> str:
    """What the byte tokenizer decodes ids to (specials and unknown ids dropped)."""
    return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


# ---------------------------------------------------------------------------------------------------------------
# Engine helpers
# ---------------------------------------------------------------------------------------------------------------

ENGINE_DEFAULTS: dict[str, Any] = dict(dtype="float32", device="cpu", block_size=16, max_total_tokens=4096, seed=0)


def make_llm(path: str, **kwargs: Any) -> Any:
    """A fresh LLM on CPU/float32 with a small KV pool."""
    from moebius import LLM

    return LLM(model=path, **{**ENGINE_DEFAULTS, **kwargs})


_shared: dict[tuple[str, tuple[tuple[str, Any], ...]], Any] = {}


def shared_llm(path: str, **kwargs: Any) -> Any:
    """An LLM cached for the session (per path and kwargs); re-created if a test left requests running."""
    key = (path, tuple(sorted(kwargs.items())))
    llm = _shared.get(key)
    if llm is None or llm.has_unfinished():
        llm = _shared[key] = make_llm(path, **kwargs)
    return llm


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def run_to_completion(llm: Any, max_steps: int = 10_000) -> dict[str, Any]:
    """Step until nothing is unfinished; the last RequestOutput seen for every request id."""
    last: dict[str, Any] = {}
    for _ in range(max_steps):
        if not llm.has_unfinished():
            return last
        for out in llm.step():
            last[out.request_id] = out
    raise AssertionError(f"engine did not finish within {max_steps} steps")


def assert_kv_all_free(llm: Any) -> None:
    stats = llm.kv_stats()
    assert stats["free_tokens"] == stats["total_tokens"], f"KV cache not fully freed: {stats}"


# ---------------------------------------------------------------------------------------------------------------
# Process-group helpers
# ---------------------------------------------------------------------------------------------------------------


def free_port() -> int:
    """A free TCP port on the loopback, for a spawned group's rendezvous."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gloo_rank(target: Callable[..., None], rank: int, world: int, port: int, args: tuple[Any, ...],
               errors: Any) -> None:
    import torch.distributed as dist

    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        target(rank, world, *args)
        dist.barrier()  # nobody tears the group down while a peer still finishes its last collective
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - reported to the test
        errors.put(f"rank {rank}: {type(e).__name__}: {e}")
        raise
    # Done and torn down: leave without the interpreter's shutdown, where rank 0 (the rendezvous store's host) aborted
    # now and then ("terminate called without an active exception", exit code -6) while its peers still closed
    # their connections to the store: nothing of the test runs there.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_gloo_ranks(target: Callable[..., None], world: int, *args: Any, timeout: float = 120.0) -> None:
    """target(rank, world, *args) in `world` spawned processes joined as one gloo group (the default group); fails
    with whatever any of them raised. `target` must be a module-level function (spawn pickles it by name)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_gloo_rank, args=(target, r, world, port, args, errors)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    msgs = []
    while not errors.empty():
        msgs.append(errors.get())
    assert not msgs, msgs
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]


# ---------------------------------------------------------------------------------------------------------------
# The benchmark tools (benchmarks/<sub>/<name>.py: scripts, not a package)
# ---------------------------------------------------------------------------------------------------------------

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


def import_tool(path: str) -> Any:
    """The tool at benchmarks/`path` (e.g. "steps/decode_ab.py") imported as its script finds its imports: moebius
    by its package name, a sibling of its folder (steps/tp_rank_model.py) by its file name. The folder is on
    sys.path only for the import; the module keeps its file name (its `__main__` block does not run)."""
    import importlib

    folder = os.path.dirname(os.path.join(BENCHMARKS, path))
    sys.path.insert(0, folder)
    try:
        return importlib.import_module(os.path.splitext(os.path.basename(path))[0])
    finally:
        sys.path.remove(folder)
