"""Attention of steps with prompt chunks through FlashAttention-4 (the `flash-attn-4` package, `flash_attn.cute`;
the optional extra `moebius[flash]`), where it is installed and the GPU is Hopper or newer.

On H200 at the 30B shapes (32 query heads, 4 KV heads, d 128) it measured faster than both kernels it stands in
for: against cuDNN on a fresh chunk (K and V gathered contiguous first, as for cuDNN), against the paged Triton
kernel on chunks after a prefix and on many short prompts (`benchmarks/results/h200-flash-attention.json`). Decodes
keep the Triton kernel (and its CUDA graphs).

CuTe DSL compiles a kernel per variant (dtype, head shape, paged or not, ...; sequence lengths are runtime values)
on first use, seconds each (`first_call_s` in benchmarks/results/h200-flash-attention.json); the on-disk cache is
switched on here, so the start-up warm-up compiles them once per machine and later starts load them. Importing the
package adds seconds to every start-up (benchmarks/results/h200-p1-throughput-warm-nowarmup-flash.json).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

from moebius.config import ConfigError

HALF = (torch.bfloat16, torch.float16)


@functools.cache
def unavailable_reason(device_index: int) -> str | None:
    """Why FlashAttention-4 cannot serve this GPU (None: it can). Imports the package (seconds) on first call."""
    if torch.cuda.get_device_capability(device_index) < (9, 0):
        return (f"FlashAttention-4 needs a Hopper or newer GPU (compute capability 9.0), not "
                f"{torch.cuda.get_device_name(device_index)}")
    # CuTe DSL's cache of compiled kernels, read at the package's import: on (its default is off) and beside the
    # user's other caches, unless the user set either variable
    os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")
    os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", str(Path.home() / ".cache" / "moebius" / "flash_attn"))
    try:
        import flash_attn.cute.interface  # noqa: F401
    except ImportError as e:
        return f"the flash-attn-4 package does not import ({e}); pip install 'moebius[flash]'"
    return None


def use_flash(choice: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether steps with prompt chunks attend through FlashAttention-4: `choice` is the engine's
    --prefill-attention (auto: where it can; flash: required, an error naming why not; triton: never)."""
    if choice == "triton":
        return False
    reason = ("not a CUDA device" if device.type != "cuda" else
              f"FlashAttention-4 takes bfloat16 or float16, not {dtype}" if dtype not in HALF else
              f"FlashAttention-4 takes a head_dim of 8 to 256 in steps of 8, not {head_dim}"
              if not (8 <= head_dim <= 256 and head_dim % 8 == 0) else
              unavailable_reason(device.index or 0))
    if reason is not None and choice == "flash":
        raise ConfigError(f"--prefill-attention flash on {device}: {reason}")
    return reason is None


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, scale: float, **lens) -> None:
    # the package's varlen entry point returns a new tensor; its forward takes the output buffer (a step in pieces
    # writes attention into a static one)
    from flash_attn.cute.interface import _flash_attn_fwd

    _flash_attn_fwd(q, k, v, softmax_scale=scale, causal=True, out=out, **lens)


def chunk_attention(q_THd: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, query_start: torch.Tensor,
                    seq_lens: torch.Tensor, max_query_len: int, scale: float, out: torch.Tensor) -> torch.Tensor:
    """Causal attention of a step's sequences over their paged KV (new keys already written): q [T, H, d];
    cache [pages, 2, page, kvh, d]; query_start [B + 1] and seq_lens [B] int32 (FlashAttention's varlen arguments);
    the last queries of each sequence see its whole KV. Writes out [T, H, d]."""
    _forward(q_THd, cache[:, 0], cache[:, 1], out, scale, cu_seqlens_q=query_start, seqused_k=seq_lens,
             max_seqlen_q=max_query_len, page_table=block_tables)
    return out


def fresh_chunk_attention(q_THd: torch.Tensor, k_THd: torch.Tensor, v_THd: torch.Tensor, scale: float,
                          out: torch.Tensor) -> torch.Tensor:
    """Causal attention of one sequence's first chunk, K and V contiguous [T, kvh, d] (faster than through the
    pages: benchmarks/results/h200-flash-attention.json). Writes out [T, H, d]."""
    # the batch form [1, T, ...]: no length tensors to build
    _forward(q_THd.unsqueeze(0), k_THd.unsqueeze(0), v_THd.unsqueeze(0), out.unsqueeze(0), scale)
    return out
