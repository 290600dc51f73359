"""The communication a layout needs, behind one interface, so the model math never branches on layout.

- `reduce_add_norm(x, residual, weight)`: the end of a sublayer: sum the ranks' partial outputs (TP: after a
  row-parallel matmul; an all-reduce, fused with what follows on GPUs), add them to the residual stream and RMSNorm
  the result for the next sublayer. Elsewhere outputs are whole: add and norm only.
- `dispatch(x, w, ids)` / `combine_add_norm(y, handle, residual, weight)`: move routed tokens to the ranks owning
  their experts, and bring the weighted expert outputs back, ending the sublayer as `reduce_add_norm` does. TP:
  every rank holds a shard of every expert, so dispatch is the identity and the combine is `reduce_add_norm`. EP:
  all-gather of tokens and reduce-scatter of outputs (fused with the add and norm on GPUs). A handle of None (a
  dense MLP layer) is no combine. The fused GPU experts hand their outputs per (token, k) pair (`PairRows`); the
  symmetric-memory kernels sum each token's pairs as they read them, every other path sums them first.
- `reduce_heads(x)`: a small float32 per-token tensor summed over the ranks that split attention's heads (TP's
  all-reduce: OLMoE's q/k norms span every head, so each rank's sums of squares over its heads are summed); elsewhere
  every head is local and x comes back as it is.
- The methods that may launch kernels take the step's `KernelConfig` (`kc`) and hand it to them.
- `vocab_argmax(scores)` / `gather_vocab(logits)` / `vocab_first`: TP holds a vocabulary slice of lm_head per rank
  (half the bytes each step reads at P = 2), so a greedy or temperature-sampled token is the best of the ranks' local
  best (an all-gather of one int64 key per token: score and id, `argmax_keys`) and whole logits (top-k / top-p, stop
  masks, prompt logits) are an all-gather; elsewhere logits are whole already.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.distributed as dist

from moebius.kernels import DEFAULT_KERNELS, KernelConfig
from moebius.kernels.pairs import PairRows
from moebius.layers.moe import summed, summed_add_rms_norm
from moebius.layers.norm import add_rms_norm
from moebius.layers.sampler import argmax_keys, key_ids
from moebius.parallel.groups import all_gather_single, reduce_scatter_single


class Communicator(Protocol):
    def reduce_add_norm(self, x_TD: torch.Tensor, residual_TD: torch.Tensor, weight: torch.Tensor, eps: float, *,
                        kc: KernelConfig = DEFAULT_KERNELS) -> tuple[torch.Tensor, torch.Tensor]: ...

    def reduce_heads(self, x_TN: torch.Tensor) -> torch.Tensor: ...

    def dispatch(self, x_TD: torch.Tensor, w_TK: torch.Tensor, ids_TK: torch.Tensor, *,
                 kc: KernelConfig = DEFAULT_KERNELS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any]: ...

    def combine_add_norm(self, y: torch.Tensor | PairRows, handle: Any, residual_TD: torch.Tensor,
                         weight: torch.Tensor, eps: float, *, kc: KernelConfig = DEFAULT_KERNELS
                         ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def vocab_argmax(self, logits_TV: torch.Tensor, *, kc: KernelConfig = DEFAULT_KERNELS) -> torch.Tensor: ...

    def gather_vocab(self, logits_TV: torch.Tensor) -> torch.Tensor: ...

    def vocab_first(self, local_vocab: int) -> int: ...

    def begin_step(self, max_tokens: int) -> None:
        """The step's size every rank agreed on (the largest rank's token count, or a graph's batch bucket)."""
        ...

    def enable_symmetric(self, max_tokens: int, hidden: int, top_k: int, dtype: torch.dtype, device: torch.device
                         ) -> None:
        """Exchange through symmetric memory from now on (a collective: every rank of the group, in the same order;
        ranks of one machine). max_tokens: the most tokens a rank's step holds."""
        ...

    def describe(self) -> dict[str, Any]:
        """How this communicator runs its collectives (diagnostics)."""
        ...


class WholeVocab:
    """Logits hold the whole vocabulary on every rank (one rank, or EP's replicated lm_head)."""

    def vocab_argmax(self, logits_TV: torch.Tensor, *, kc: KernelConfig = DEFAULT_KERNELS) -> torch.Tensor:
        return key_ids(argmax_keys(logits_TV, kc=kc))

    def gather_vocab(self, logits_TV: torch.Tensor) -> torch.Tensor:
        return logits_TV

    def vocab_first(self, local_vocab: int) -> int:
        return 0


class WholeOutputs:
    """Sublayer outputs are whole on the rank that holds their tokens (one rank, or EP after its combine)."""

    def reduce_heads(self, x_TN: torch.Tensor) -> torch.Tensor:
        return x_TN  # every head of its tokens is on this rank

    def reduce_add_norm(self, x_TD: torch.Tensor, residual_TD: torch.Tensor, weight: torch.Tensor, eps: float, *,
                        kc: KernelConfig = DEFAULT_KERNELS) -> tuple[torch.Tensor, torch.Tensor]:
        return add_rms_norm(x_TD, residual_TD, weight, eps, kc=kc)

    def combine_add_norm(self, y: torch.Tensor | PairRows, handle: Any, residual_TD: torch.Tensor,
                         weight: torch.Tensor, eps: float, *, kc: KernelConfig = DEFAULT_KERNELS
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        return summed_add_rms_norm(y, residual_TD, weight, eps, kc=kc)


class LocalComm(WholeVocab, WholeOutputs):
    """A single rank (P = 1): nothing to exchange."""

    def dispatch(self, x_TD: torch.Tensor, w_TK: torch.Tensor, ids_TK: torch.Tensor, *,
                 kc: KernelConfig = DEFAULT_KERNELS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any]:
        return x_TD, w_TK, ids_TK, None

    def begin_step(self, max_tokens: int) -> None:
        pass

    def enable_symmetric(self, max_tokens: int, hidden: int, top_k: int, dtype: torch.dtype, device: torch.device
                         ) -> None:
        pass

    def describe(self) -> dict[str, Any]:
        return {"comm": type(self).__name__, "symmetric": False, "symmetric_calls": 0}


class SymmetricAllReduce:
    """Sum across ranks through symmetric memory that every GPU of the group maps (torch's `_symmetric_memory`; no
    multicast needed; capture-safe). Up to FUSED_MAX_BYTES the sum at the end of a sublayer is one Triton launch
    with the residual add and the next norm (`fused`, `kernels.symmetric`); above it, up to the buffer, torch's
    two-shot kernel (reduce-scatter + all-gather). Both measured faster than NCCL's all-reduce + add_rmsnorm at
    their sizes (`python benchmarks/comm/comm_bench.py`; benchmarks/results/h200x2-comm.json)."""

    FUSED_MAX_BYTES = 8 << 20

    def __init__(self, group: dist.ProcessGroup, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        from moebius.kernels.symmetric import FusedAllReduceNorm

        self.name = group.group_name
        self.buf = symm_mem.empty(numel, dtype=dtype, device=device)
        symm_mem.rendezvous(self.buf, self.name)  # collective: every rank of the group calls it
        elt = torch.empty((), dtype=dtype).element_size()
        self.fused = FusedAllReduceNorm(group, min(numel, self.FUSED_MAX_BYTES // elt), dtype, device)

    def fits(self, x: torch.Tensor) -> bool:
        return x.dtype == self.buf.dtype and x.numel() <= self.buf.numel() and x.is_contiguous()

    def calls(self) -> int:
        return self.fused.calls()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The sum: a view of the shared buffer, valid until the next call (the model consumes each reduce's result
        before the next one)."""
        buf = self.buf[: x.numel()]
        buf.copy_(x.view(-1))
        torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", self.name)
        return buf.view_as(x)


def symmetric_memory_available() -> bool:
    try:
        import torch.distributed._symmetric_memory  # noqa: F401
    except ImportError:
        return False
    return hasattr(torch.ops, "symm_mem") and hasattr(torch.ops.symm_mem, "two_shot_all_reduce_")


class TPComm:
    """TP: partial sums of row-parallel matmuls and of expert shards are all-reduced; tokens stay put; each rank's
    logits are its vocabulary slice (rank r holds ids [r * V/P, (r + 1) * V/P))."""

    def __init__(self, group: dist.ProcessGroup, vocab_first: int | None = 0) -> None:
        """vocab_first: the first vocabulary id of this rank's lm_head slice (`Layout.vocab_rows`); None: a
        vocabulary the ranks do not divide, lm_head stays whole."""
        self.group = group
        self.P, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.split_vocab = vocab_first is not None
        self._vocab_first = vocab_first or 0
        self.symmetric: SymmetricAllReduce | None = None  # enable_symmetric, at start on GPUs

    def begin_step(self, max_tokens: int) -> None:
        pass  # tokens stay put: nothing to size

    def enable_symmetric(self, max_tokens: int, hidden: int, top_k: int, dtype: torch.dtype, device: torch.device
                         ) -> None:
        self.symmetric = SymmetricAllReduce(self.group, max_tokens * hidden, dtype, device)

    def describe(self) -> dict[str, Any]:
        return {"comm": type(self).__name__, "symmetric": self.symmetric is not None,
                "symmetric_calls": self.symmetric.calls() if self.symmetric is not None else 0}

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.symmetric is not None and self.symmetric.fits(x):
            return self.symmetric(x)
        dist.all_reduce(x, group=self.group)
        return x

    def reduce_heads(self, x_TN: torch.Tensor) -> torch.Tensor:
        """In place (NCCL or gloo: the symmetric buffer holds the model's dtype, these sums are float32)."""
        dist.all_reduce(x_TN, group=self.group)
        return x_TN

    def reduce_add_norm(self, x_TD: torch.Tensor, residual_TD: torch.Tensor, weight: torch.Tensor, eps: float, *,
                        kc: KernelConfig = DEFAULT_KERNELS) -> tuple[torch.Tensor, torch.Tensor]:
        if self.symmetric is not None and self.symmetric.fused.fits(x_TD):
            return self.symmetric.fused(x_TD, residual_TD, weight, eps, kc=kc), residual_TD
        return add_rms_norm(self.reduce(x_TD), residual_TD, weight, eps, kc=kc)

    def dispatch(self, x_TD: torch.Tensor, w_TK: torch.Tensor, ids_TK: torch.Tensor, *,
                 kc: KernelConfig = DEFAULT_KERNELS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any]:
        return x_TD, w_TK, ids_TK, None

    def combine_add_norm(self, y: torch.Tensor | PairRows, handle: Any, residual_TD: torch.Tensor,
                         weight: torch.Tensor, eps: float, *, kc: KernelConfig = DEFAULT_KERNELS
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """y: a partial sum over the expert shards (per pair: summed inside the fused all-reduce)."""
        if isinstance(y, PairRows) and self.symmetric is not None and self.symmetric.fused.fits_pairs(y):
            return self.symmetric.fused.sum_pairs(y, residual_TD, weight, eps, kc=kc), residual_TD
        return self.reduce_add_norm(summed(y, kc=kc), residual_TD, weight, eps, kc=kc)

    def vocab_argmax(self, logits_TV: torch.Tensor, *, kc: KernelConfig = DEFAULT_KERNELS) -> torch.Tensor:
        """The first id of the largest logit over the whole vocabulary (as argmax over whole logits gives)."""
        if not self.split_vocab:
            return key_ids(argmax_keys(logits_TV, kc=kc))
        T = logits_TV.shape[0]
        every = logits_TV.new_empty((self.P * T,), dtype=torch.int64)  # gloo wants the parts stacked on dim 0
        all_gather_single(every, argmax_keys(logits_TV, self._vocab_first, kc=kc), self.group)
        return key_ids(every.view(self.P, T).max(dim=0).values)

    def vocab_first(self, local_vocab: int) -> int:
        """The first vocabulary id of this rank's logits columns."""
        return self._vocab_first

    def gather_vocab(self, logits_TV: torch.Tensor) -> torch.Tensor:
        if not self.split_vocab:
            return logits_TV
        T, Vl = logits_TV.shape
        every = logits_TV.new_empty((self.P * T, Vl))
        all_gather_single(every, logits_TV.contiguous(), self.group)
        return every.view(self.P, T, Vl).permute(1, 0, 2).reshape(T, self.P * Vl)


class EPComm(WholeVocab, WholeOutputs):
    """EP: tokens go to the ranks that own their experts, weighted expert outputs come back and are summed per
    token. Attention is data-parallel, so `reduce_add_norm` only adds and norms.

    Dispatch is dense and fixed-size: every rank sends its `capacity` token rows (padded) once to every rank (an
    all-gather) and the outputs return by reduce-scatter. Fixed sizes need no host-side split sizes, so the step can
    be captured in a CUDA graph; a token is sent once per rank, never once per (token, expert) pair, and a rank
    computes only the pairs of its own experts. All ranks must agree on `capacity` (the runner sets it each step to
    the largest local token count, or the graph's bucket). With P = 2 and top-8 of 128 experts nearly every token
    needs both ranks anyway; for larger P an exact per-destination exchange would send fewer bytes. On GPUs, up to
    `symmetric.max_capacity` the exchange is `kernels.symmetric.EPExchange` (rows pushed into the peers' buffers,
    one launch each way, the combine fused with the add and norm); NCCL beyond it or with
    `--disable-custom-all-reduce`.
    """

    # EP steps of up to this many tokens a rank exchange through symmetric memory (decode batches and small prefill
    # chunks); larger steps through NCCL
    SYMMETRIC_MAX_TOKENS = 2048

    def __init__(self, group: dist.ProcessGroup, world_size: int, experts_per_rank: int) -> None:
        self.group, self.P, self.E_local = group, world_size, experts_per_rank
        self.capacity = 0
        self.symmetric: Any = None  # a kernels.symmetric.EPExchange: enable_symmetric, at start on GPUs

    def begin_step(self, max_tokens: int) -> None:
        self.capacity = max_tokens

    def enable_symmetric(self, max_tokens: int, hidden: int, top_k: int, dtype: torch.dtype, device: torch.device
                         ) -> None:
        from moebius.kernels.symmetric import EPExchange

        self.symmetric = EPExchange(self.group, min(max_tokens, self.SYMMETRIC_MAX_TOKENS), hidden, top_k, dtype,
                                    device)

    def describe(self) -> dict[str, Any]:
        return {"comm": type(self).__name__, "symmetric": self.symmetric is not None,
                "symmetric_calls": self.symmetric.calls() if self.symmetric is not None else 0}

    def _gather(self, t: torch.Tensor, fill: float) -> torch.Tensor:
        C = self.capacity
        padded = t.new_full((C, *t.shape[1:]), fill)
        padded[: t.shape[0]] = t
        out = t.new_empty((self.P * C, *t.shape[1:]))
        all_gather_single(out, padded, self.group)
        return out

    def dispatch(self, x_TD: torch.Tensor, w_TK: torch.Tensor, ids_TK: torch.Tensor, *,
                 kc: KernelConfig = DEFAULT_KERNELS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any]:
        T, C = x_TD.shape[0], self.capacity
        if T > C:
            raise RuntimeError(f"EP dispatch of {T} tokens exceeds the agreed capacity {C}")
        if self.symmetric is not None and self.symmetric.fits(C):
            return (*self.symmetric.dispatch(x_TD, w_TK, ids_TK, C, kc=kc), (T, C, True))
        # padding rows get expert id -1: no rank owns it, so they cost no expert compute
        return self._gather(x_TD, 0.0), self._gather(w_TK, 0.0), self._gather(ids_TK, -1), (T, C, False)

    def combine_add_norm(self, y: torch.Tensor | PairRows, handle: Any, residual_TD: torch.Tensor,
                         weight: torch.Tensor, eps: float, *, kc: KernelConfig = DEFAULT_KERNELS
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        if handle is None:  # a dense layer: its output is whole already
            return self.reduce_add_norm(summed(y, kc=kc), residual_TD, weight, eps, kc=kc)
        T, C, fused = handle
        if fused:  # takes expert outputs per pair too
            return self.symmetric.combine_add_norm(y, T, C, residual_TD, weight, eps, kc=kc), residual_TD
        y = summed(y, kc=kc)
        out = y.new_empty((C, y.shape[1]))
        reduce_scatter_single(out, y, self.group)
        return self.reduce_add_norm(out[:T], residual_TD, weight, eps, kc=kc)
