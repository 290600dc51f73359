"""TP's cross-rank sum fused with the residual add and the next RMSNorm (Triton, one launch).

Each rank's GPU maps every peer's symmetric-memory buffer (torch `_symmetric_memory`), so a program can write its
rows of the partial sum into each peer's buffer over NVLink, tell each peer through a flag in the peer's memory,
wait for the peers' flags, and read what they wrote locally. Summed in rank order in float32 and rounded once, every
rank gets the same bits. Small batches go one-shot (every rank sums every row), large ones two-shot (each rank sums
its share of the rows and sends the results back), as torch's and NCCL's all-reduces do. The reference is
`add_rms_norm(all_reduce(x), residual, weight)` (moebius.layers.norm).

Flags carry call numbers: program p of every rank has made the same calls (TP ranks run the same steps with the
same token counts, so the grids agree), so in its call n program p sets its flag in each peer to n + 1 and waits
until each peer's flag for p has reached n + 1. Rows land in one of two slots, chosen by n: a rank writes a peer's
slot again only two calls later, after waiting for the peer's flag of the call in between, which the peer raises
only once its previous call (the reads of this slot) has ended. No host-side state, so the kernel replays inside
CUDA graphs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FLAG_STRIDE = 32  # int32s between flags: one 128-byte line each, so spinning programs do not share a line


@triton.jit
def _flag_and_wait(Flags, calls, pid, PHASE: tl.constexpr, RANK: tl.constexpr, P: tl.constexpr,
                   MAX_PROGRAMS: tl.constexpr, STRIDE: tl.constexpr):
    """Tell every peer this program's writes of this phase of call number `calls` are done (the flag holds the
    number of the call + 1); wait until every peer has told us."""
    tl.debug_barrier()  # every thread's writes precede the flag
    for r in tl.static_range(P):
        if r != RANK:
            peer = tl.load(Flags + r).to(tl.pointer_type(tl.int32))
            tl.atomic_xchg(peer + ((PHASE * P + RANK) * MAX_PROGRAMS + pid) * STRIDE, calls + 1, sem="release",
                           scope="sys")
    mine = tl.load(Flags + RANK).to(tl.pointer_type(tl.int32))
    for r in tl.static_range(P):
        if r != RANK:
            flag = mine + ((PHASE * P + r) * MAX_PROGRAMS + pid) * STRIDE
            while tl.load(flag, volatile=True) <= calls:  # cheap polling; the atomic below orders what follows
                pass
            tl.atomic_add(flag, 0, sem="acquire", scope="sys")
    tl.debug_barrier()


@triton.jit
def _store_norm(x, R, W, Out, off, cols, m, N, eps):
    """x: new residual rows [ROWS, BLOCK] (storage dtype): store them and their RMSNorm."""
    tl.store(R + off, x, mask=m)
    xf = x.to(tl.float32)
    y = (xf * tl.rsqrt(tl.sum(xf * xf, 1) / N + eps)[:, None]).to(x.dtype)
    w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)
    tl.store(Out + off, (w[None, :] * y.to(tl.float32)).to(Out.dtype.element_ty), mask=m)


@triton.jit
def _allreduce_add_rmsnorm(X, R, W, Out, Bufs, Flags, Count, T, N, sec_numel, eps, RANK: tl.constexpr,
                           P: tl.constexpr, MAX_PROGRAMS: tl.constexpr, STRIDE: tl.constexpr, ROWS: tl.constexpr,
                           BLOCK: tl.constexpr, TWO_SHOT: tl.constexpr):
    # Each rank's buffer: [2 slots][2 phases][P source ranks][rows, N], rows at their index in the batch. Rows
    # travel as posted NVLink stores into the peer's buffer (pushed: 1.5-2x faster than reading the peer's, which
    # waits a round trip per load), and are read locally. A program's rows are pid, pid + G, ...; it moves ROWS of
    # them per iteration, so more loads and stores are in flight.
    # One-shot: every rank receives every row and sums them all.
    # Two-shot: a program's j-th row belongs to rank j % P; each rank receives the partials of its rows, sums,
    # adds and norms them, and pushes the new residual rows to the peers (phase 1), which norm them too.
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    k = tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    dt = X.dtype.element_ty
    calls = tl.load(Count + pid)
    slot = (calls % 2).to(tl.int64)
    mine = tl.load(Bufs + RANK).to(tl.pointer_type(dt))
    iters = tl.cdiv(tl.cdiv(T - pid, G), ROWS)
    for it in range(0, iters):
        j = it * ROWS + k
        row = pid + j * G
        off = row[:, None] * N + cols[None, :]  # int32: the buffer holds far fewer than 2^31 elements
        m = (row < T)[:, None] & (cols < N)[None, :]
        owner = (j % P)[:, None]
        if TWO_SHOT:
            m = m & (owner != RANK)
        x = tl.load(X + off, mask=m)
        for r in tl.static_range(P):
            if r != RANK:
                dst = tl.load(Bufs + r).to(tl.pointer_type(dt)) + ((slot * 2) * P + RANK) * sec_numel
                if TWO_SHOT:
                    tl.store(dst + off, x, mask=m & (owner == r))
                else:
                    tl.store(dst + off, x, mask=m)
    _flag_and_wait(Flags, calls, pid, 0, RANK, P, MAX_PROGRAMS, STRIDE)
    for it in range(0, iters):
        j = it * ROWS + k
        row = pid + j * G
        off = row[:, None] * N + cols[None, :]
        m = (row < T)[:, None] & (cols < N)[None, :]
        owner = (j % P)[:, None]
        if TWO_SHOT:
            m = m & (owner == RANK)
        acc = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
        for r in tl.static_range(P):  # in rank order, so every rank rounds the same sum
            if r == RANK:
                acc += tl.load(X + off, mask=m, other=0.0).to(tl.float32)
            else:  # .cg: past L1, which is not coherent with what a peer wrote during this kernel
                src = mine + ((slot * 2) * P + r) * sec_numel + off
                acc += tl.load(src, mask=m, other=0.0, cache_modifier=".cg").to(tl.float32)
        # rounded as the unfused path rounds: the sum, then residual + sum, then the norm
        x = (acc.to(dt).to(tl.float32) + tl.load(R + off, mask=m, other=0.0).to(tl.float32)).to(dt)
        _store_norm(x, R, W, Out, off, cols, m, N, eps)
        if TWO_SHOT:
            for r in tl.static_range(P):
                if r != RANK:
                    dst = tl.load(Bufs + r).to(tl.pointer_type(dt)) + ((slot * 2 + 1) * P + RANK) * sec_numel
                    tl.store(dst + off, x, mask=m)
    if TWO_SHOT:
        _flag_and_wait(Flags, calls, pid, 1, RANK, P, MAX_PROGRAMS, STRIDE)
        for it in range(0, iters):
            j = it * ROWS + k
            row = pid + j * G
            off = row[:, None] * N + cols[None, :]
            owner = (j % P)[:, None]
            m = (row < T)[:, None] & (cols < N)[None, :] & (owner != RANK)
            src = mine + ((slot * 2 + 1) * P + owner) * sec_numel + off
            x = tl.load(src, mask=m, other=0.0, cache_modifier=".cg")
            _store_norm(x, R, W, Out, off, cols, m, N, eps)
    tl.store(Count + pid, calls + 1)


class FusedAllReduceNorm:
    """The symmetric buffers and flags of `_allreduce_add_rmsnorm` for one process group. Set up collectively (every
    rank of the group constructs it at the same point)."""

    MAX_PROGRAMS = 256  # flags per peer and phase; rows beyond the grid loop within a program
    TWO_SHOT_MIN_BYTES = 8 << 20  # from here each rank sums only its share (H200 x2: benchmarks/allreduce_bench.py)

    def __init__(self, group, max_numel: int, dtype: torch.dtype, device: torch.device) -> None:
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem

        self.P, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.max_numel, self.dtype = max_numel, dtype
        # grid cap, rows per iteration at most, warps per program (benchmarks/allreduce_bench.py varies them)
        self.programs, self.max_rows, self.num_warps = 256, 4, 8
        self.buf = symm_mem.empty(2 * 2 * self.P * max_numel, dtype=dtype, device=device)
        self.flags = symm_mem.empty(2 * self.P * self.MAX_PROGRAMS * FLAG_STRIDE, dtype=torch.int32, device=device)
        self.flags.zero_()
        torch.cuda.synchronize(device)
        bufs = symm_mem.rendezvous(self.buf, group.group_name)
        flags = symm_mem.rendezvous(self.flags, group.group_name)
        # a tensor may start inside its rendezvous block: the same offset holds on every rank
        self.buf_ptrs = torch.tensor([p + self.buf.data_ptr() - bufs.buffer_ptrs[self.rank] for p in bufs.buffer_ptrs],
                                     dtype=torch.int64, device=device)
        self.flag_ptrs = torch.tensor([p + self.flags.data_ptr() - flags.buffer_ptrs[self.rank]
                                       for p in flags.buffer_ptrs], dtype=torch.int64, device=device)
        self.count = torch.zeros(self.MAX_PROGRAMS, dtype=torch.int32, device=device)
        dist.barrier(group)  # no peer signals before every rank's flags are zero

    def fits(self, x: torch.Tensor) -> bool:
        return x.dtype == self.dtype and x.dim() == 2 and x.is_contiguous() and x.numel() <= self.max_numel

    def __call__(self, x_TD: torch.Tensor, residual_TD: torch.Tensor, weight: torch.Tensor, eps: float,
                 two_shot: bool | None = None) -> torch.Tensor:
        """rms_norm(residual + sum over ranks of x) * weight; residual updated in place."""
        if not self.fits(x_TD):
            raise ValueError(f"fused all-reduce takes contiguous [T, D] {self.dtype} of at most {self.max_numel} "
                             f"elements, not {x_TD.dtype} {tuple(x_TD.shape)}")
        T, N = x_TD.shape
        out = torch.empty_like(x_TD)
        if two_shot is None:
            two_shot = x_TD.numel() * x_TD.element_size() >= self.TWO_SHOT_MIN_BYTES
        if T:
            # two-shot: at least P rows per program, so that each program's rows alternate between owners
            grid = min(-(-T // self.P) if two_shot else T, self.programs)
            rows = min(self.max_rows, triton.next_power_of_2(-(-T // grid)))
            _allreduce_add_rmsnorm[(grid,)](
                x_TD, residual_TD, weight, out, self.buf_ptrs, self.flag_ptrs, self.count, T, N, self.max_numel,
                eps, RANK=self.rank, P=self.P, MAX_PROGRAMS=self.MAX_PROGRAMS, STRIDE=FLAG_STRIDE, ROWS=rows,
                BLOCK=triton.next_power_of_2(N), TWO_SHOT=two_shot, num_warps=self.num_warps)
        return out
