"""GPU fast paths. Each op here has its torch reference in `moebius.layers` (CPU and tests use the reference; the
GPU tests compare the two). Triton is imported only when a CUDA tensor reaches a kernel.

How the kernels run (which expert kernel, programmatic dependent launch, the release order) is a `KernelConfig`
handed down the call chain: the engine builds one per runtime, the runner derives each step's from it
(`with_release`), and every kernel wrapper takes it as `kc`. Nothing here is process-wide state."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


# Programmatic dependent launch (kernels/pdl.py): a kernel lets the next one launch before (EARLY) or after (LATE)
# it waits for the one before it. EARLY: every kernel of a chain may launch (and wait) a few kernels ahead. LATE:
# one ahead, so a kernel that loads its weights before it waits (kernels/linear.py) loads them during the kernel
# just before it, not while expert kernels three launches back still need the SMs. Which order a step runs in:
# `release_order_for`.
EARLY, LATE = 1, 2


# A step that is one prompt's first chunk (no cached prefix) of at least this many tokens may take cuDNN's fused
# attention (kernels/attention.py `fresh_chunk`). cuDNN builds a graph for each new chunk length on first use (a few
# hundred ms reported), so a runtime allows it only at the lengths its start-up warm-up runs as whole prompts
# (`KernelConfig.fresh_chunk_lengths`, from worker/warmup.py `token_ladder`).
FRESH_CHUNK_MIN_TOKENS = 2048


@dataclass(frozen=True)
class KernelConfig:
    """How this runtime's kernels run; immutable, so a step's config can be derived and passed without copies.

    moe_backend: the GPU expert kernel for bf16: "triton" (kernels/fused_moe.py) or "grouped_mm" (kernels/moe.py).
    pdl: programmatic dependent launch where the GPU supports it (kernels/pdl.py); off for A/B timing, debugging.
    release: the order kernels release the next launch in (EARLY | LATE), chosen per step by the runner.
    reshard_kernel: a switch's local expert permutes through kernels/copy.py (else torch's strided copies).
    fresh_chunk_lengths: the chunk lengths at which a step of one fresh prompt chunk takes cuDNN's attention (with
    flash_prefill: FlashAttention-4's on K and V gathered contiguous) (empty: never; the engine's: the warm-up's
    whole-prompt lengths from FRESH_CHUNK_MIN_TOKENS).
    decodes_apart: in a step with prompt chunks, its leading decodes attend in a decode launch of their own (decode
    tiles, KV splits) and the chunks in the query-block launch, instead of the decodes riding that launch as
    one-token query blocks (`AttentionMetadata.decodes`).
    flash_prefill: steps with prompt chunks attend through FlashAttention-4 (kernels/flash.py) instead of the
    Triton kernel and cuDNN (decodes apart keep their Triton launch); the engine's: --prefill-attention.
    fp8_activations: GEMMs on FP8 rows (--quantization fp8) quantize each 128-column group of a row's activations to
    float8 with a scale of its own and multiply float8 by float8 (W8A8, vLLM's and SGLang's default for block FP8);
    off (the default): each weight tile dequantized to the activations' dtype (W8A16), whose decode steps measured
    faster (benchmarks/results/h100-p1-qwen3-30b-fp8-w8a16-sweep.json against h100-p1-qwen3-30b-fp8-sweep-3c2f530.json);
    the engine's: --fp8-activations.
    shared_stream: the shared experts (DeepSeek, GLM-4.5, Qwen2-MoE) run on a side stream of the GPU, overlapping the
    routed experts' kernels, and join before the pairs' sum (`layers.moe.beside`): DeepSeek-V2-Lite's decode steps
    measured faster from 64 to 512 on an H100 and an H200 and no slower at 1024
    (benchmarks/results/h200-p1-deepseek-v2-lite-sweep-shared-stream.json against
    h200-p1-deepseek-v2-lite-sweep-shared-inline.json, h100-p1-* likewise); off: --disable-shared-experts-stream."""

    moe_backend: str = "triton"
    pdl: bool = True
    release: int = EARLY
    reshard_kernel: bool = True
    fresh_chunk_lengths: frozenset[int] = frozenset()
    decodes_apart: bool = False
    flash_prefill: bool = False
    fp8_activations: bool = False
    shared_stream: bool = True

    def __post_init__(self) -> None:
        if self.moe_backend not in ("triton", "grouped_mm"):
            raise ValueError(f"moe_backend is 'triton' or 'grouped_mm', not {self.moe_backend!r}")
        if self.release not in (EARLY, LATE):
            raise ValueError(f"release is EARLY ({EARLY}) or LATE ({LATE}), not {self.release!r}")

    def with_release(self, order: int) -> KernelConfig:
        """This config with kernels releasing the next launch in `order` (self when it already does)."""
        return self if order == self.release else _with_release(self, order)


@functools.lru_cache(maxsize=64)
def _with_release(kc: KernelConfig, order: int) -> KernelConfig:
    # a step derives its config on the host's hot path: the few distinct ones are made once
    return dataclasses.replace(kc, release=order)


DEFAULT_KERNELS = KernelConfig()


# Steps of up to this many tokens a rank run their projections through kernels/linear.py in the LATE order; two
# tokens only where the rank's qkv weight has at most PREFETCH_TWO_MAX_ELEMS elements: each program sums twice the
# products, which paid off at a 30B TP shard (2560 x 2048) and not at EP's whole qkv (5120 x 2048)
# (benchmarks/results/h200x2-prefetch-rows.json).
PREFETCH_ROWS = 2
PREFETCH_TWO_MAX_ELEMS = 4096 * 2048


def prefetch_rows(qkv_elems: int) -> int:
    return PREFETCH_ROWS if qkv_elems <= PREFETCH_TWO_MAX_ELEMS else 1


# Steps of MMA_MIN_ROWS to MMA_MAX_ROWS tokens a rank run their projections through kernels/linear.py's tensor-core
# kernel, also in the LATE order: against cuBLAS that kernel gains only in the LATE order (in the EARLY one it is
# about even). Two tokens with a large qkv keep cuBLAS, where the kernel measured slower
# (benchmarks/results/h200-few-row-projections.json).
MMA_MIN_ROWS, MMA_MAX_ROWS = 3, 32


def release_order_for(tokens: int, qkv_elems: int) -> int:
    """The release order of a forward of `tokens` tokens on this rank whose qkv weight has `qkv_elems` elements."""
    return LATE if tokens <= prefetch_rows(qkv_elems) or MMA_MIN_ROWS <= tokens <= MMA_MAX_ROWS else EARLY
