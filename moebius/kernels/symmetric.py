"""Cross-GPU exchanges through torch symmetric memory, fused with the math around them (Triton, one launch each).

Every GPU of the group maps every peer's symmetric-memory buffers (torch `_symmetric_memory`), so a program writes
rows into a peer's buffer over NVLink (posted stores: 1.5-2x faster than reading the peer's, which waits a round
trip per load), tells the peer through a flag in the peer's memory, waits for the peers' flags, and reads what they
wrote locally. Flags carry call numbers: program p of every rank makes the same calls (the ranks run the same steps
with the same sizes, so the grids agree), so in its call n program p sets its flag in each peer to n + 1 and waits
until each peer's flag for p has reached n + 1. No host-side state, so the kernels replay inside CUDA graphs.

- TP, `FusedAllReduceNorm`: the sum of the ranks' partial outputs + the residual add + the next RMSNorm. Summed in
  rank order in float32 and rounded once, every rank gets the same bits. Small batches go one-shot (every rank
  sums every row), large ones two-shot (each rank sums its share and sends the results back), as torch's and
  NCCL's all-reduces do. Rows land in one of two slots, chosen by the call number: a rank writes a peer's slot
  again only two calls later, after waiting for the peer's flag of the call in between, which the peer raises only
  once its previous call (the reads of this slot) has ended. Reference: `add_rms_norm(all_reduce(x), ...)`.
- EP, `EPExchange`: dispatch (every rank's token rows, routing weights and expert ids, padded to the agreed
  capacity, land in every rank's buffer: the all-gather) and combine (each rank's expert outputs for another
  rank's tokens go to that rank, which sums them in rank order, adds the residual and norms: the reduce-scatter +
  add + norm). One buffer each, no slots: a dispatch writes a peer's buffer only after the combine before it waited
  for the peer's combine, which the peer starts only after its experts finished reading its dispatch buffer; and
  the other way round. Reference: `EPComm`'s NCCL all-gather / reduce-scatter path.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
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
def _sum_add_norm(own, peers, peer_stride, R, W, Out, off, cols, m, N, eps, RANK: tl.constexpr, P: tl.constexpr,
                  ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """Rows summed over ranks in rank order (so every rank rounds the same sum): this rank's partial at `own`, rank
    r's as received at `peers + r * peer_stride`; then residual + sum and its RMSNorm stored. Returns the new
    residual rows (rounded as the unfused path rounds: the sum, then residual + sum, then the norm)."""
    acc = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
    for r in tl.static_range(P):
        if r == RANK:
            acc += tl.load(own, mask=m, other=0.0).to(tl.float32)
        else:  # .cg: past L1, which is not coherent with what a peer wrote during this kernel
            acc += tl.load(peers + r * peer_stride, mask=m, other=0.0, cache_modifier=".cg").to(tl.float32)
    dt = R.dtype.element_ty
    x = (acc.to(dt).to(tl.float32) + tl.load(R + off, mask=m, other=0.0).to(tl.float32)).to(dt)
    _store_norm(x, R, W, Out, off, cols, m, N, eps)
    return x


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
        x = _sum_add_norm(X + off, mine + (slot * 2) * P * sec_numel + off, sec_numel, R, W, Out, off, cols, m, N,
                          eps, RANK, P, ROWS, BLOCK)
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


@triton.jit
def _ep_dispatch(X, W, Ids, T, C, D, XW, IdBufs, Flags, Count, w_offset, RANK: tl.constexpr, P: tl.constexpr,
                 K: tl.constexpr, MAX_PROGRAMS: tl.constexpr, STRIDE: tl.constexpr, ROWS: tl.constexpr,
                 BLOCK: tl.constexpr, KB: tl.constexpr):
    # every rank's buffers hold [P * C, D] token rows (then [P * C, K] weights) and [P * C, K] ids, rank r's rows at
    # r * C; rows from T to C are padding: zero rows, zero weights, expert id -1 (no rank owns it)
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    k = tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    kc = tl.arange(0, KB)
    dt = X.dtype.element_ty
    calls = tl.load(Count + pid)
    for it in range(0, tl.cdiv(tl.cdiv(C - pid, G), ROWS)):
        t = pid + (it * ROWS + k) * G
        valid = (t < T)[:, None]
        inside = (t < C)[:, None]
        mx = cols[None, :] < D
        mk = kc[None, :] < K
        x = tl.load(X + t[:, None] * D + cols[None, :], mask=valid & mx, other=0.0)
        w = tl.load(W + t[:, None] * K + kc[None, :], mask=valid & mk, other=0.0)
        ids = tl.load(Ids + t[:, None] * K + kc[None, :], mask=valid & mk, other=-1)
        row = (RANK * C + t)[:, None]
        for r in tl.static_range(P):
            xw = tl.load(XW + r).to(tl.pointer_type(dt))
            tl.store(xw + row * D + cols[None, :], x, mask=inside & mx)
            tl.store(xw + w_offset + row * K + kc[None, :], w.to(dt), mask=inside & mk)
            idb = tl.load(IdBufs + r).to(tl.pointer_type(tl.int64))
            tl.store(idb + row * K + kc[None, :], ids.to(tl.int64), mask=inside & mk)
    _flag_and_wait(Flags, calls, pid, 0, RANK, P, MAX_PROGRAMS, STRIDE)
    tl.store(Count + pid, calls + 1)


@triton.jit
def _ep_combine_add_rmsnorm(Y, R, W, Out, T, C, D, Bufs, Flags, Count, eps, RANK: tl.constexpr, P: tl.constexpr,
                            MAX_PROGRAMS: tl.constexpr, STRIDE: tl.constexpr, ROWS: tl.constexpr,
                            BLOCK: tl.constexpr):
    # Y [P * C, D]: this rank's expert outputs for every rank's tokens; rank q's rows go to q's buffer at RANK * C
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    k = tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    dt = Y.dtype.element_ty
    calls = tl.load(Count + pid)
    iters = tl.cdiv(tl.cdiv(C - pid, G), ROWS)
    for it in range(0, iters):
        t = pid + (it * ROWS + k) * G
        m = (t < C)[:, None] & (cols[None, :] < D)
        for q in tl.static_range(P):
            if q != RANK:
                y = tl.load(Y + (q * C + t)[:, None] * D + cols[None, :], mask=m)
                dst = tl.load(Bufs + q).to(tl.pointer_type(dt))
                tl.store(dst + (RANK * C + t)[:, None] * D + cols[None, :], y, mask=m)
    _flag_and_wait(Flags, calls, pid, 1, RANK, P, MAX_PROGRAMS, STRIDE)
    mine = tl.load(Bufs + RANK).to(tl.pointer_type(dt))
    for it in range(0, iters):
        t = pid + (it * ROWS + k) * G
        m = (t < T)[:, None] & (cols[None, :] < D)
        off = t[:, None] * D + cols[None, :]
        _sum_add_norm(Y + RANK * C * D + off, mine + off, C * D, R, W, Out, off, cols, m, D, eps, RANK, P, ROWS,
                      BLOCK)
    tl.store(Count + pid, calls + 1)


class SymmetricBuffers:
    """Symmetric-memory tensors of one process group with the table of every rank's address of each, the flags and
    the per-program call counts. Set up collectively (every rank constructs it at the same point)."""

    MAX_PROGRAMS = 256  # flags per peer and phase; rows beyond the grid loop within a program

    def __init__(self, group: dist.ProcessGroup, sizes: dict[str, tuple[int, torch.dtype]], device: torch.device,
                 phases: int) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.P, self.rank = dist.get_world_size(group), dist.get_rank(group)
        sizes = dict(sizes, flags=(phases * self.P * self.MAX_PROGRAMS * FLAG_STRIDE, torch.int32))
        self.bufs: dict[str, torch.Tensor] = {}
        self.ptrs: dict[str, torch.Tensor] = {}
        for name, (numel, dtype) in sizes.items():
            t = symm_mem.empty(numel, dtype=dtype, device=device)
            if name == "flags":
                t.zero_()
                torch.cuda.synchronize(device)
            h = symm_mem.rendezvous(t, group.group_name)
            # a tensor may start inside its rendezvous block: the same offset holds on every rank
            self.bufs[name] = t
            self.ptrs[name] = torch.tensor([p + t.data_ptr() - h.buffer_ptrs[self.rank] for p in h.buffer_ptrs],
                                           dtype=torch.int64, device=device)
        self.count = torch.zeros(phases, self.MAX_PROGRAMS, dtype=torch.int32, device=device)
        dist.barrier(group)  # no peer signals before every rank's flags are zero


class FusedAllReduceNorm:
    """TP's all-reduce + residual add + RMSNorm (`_allreduce_add_rmsnorm`) over [T, D] of at most `max_numel`."""

    TWO_SHOT_MIN_BYTES = 8 << 20  # from here each rank sums only its share (H200 x2: benchmarks/comm_bench.py)

    def __init__(self, group: dist.ProcessGroup, max_numel: int, dtype: torch.dtype, device: torch.device) -> None:
        P = dist.get_world_size(group)
        self.sym = SymmetricBuffers(group, {"rows": (2 * 2 * P * max_numel, dtype)}, device, phases=2)
        self.P, self.rank, self.max_numel, self.dtype = P, self.sym.rank, max_numel, dtype
        # grid cap, rows per iteration at most, warps per program (benchmarks/comm_bench.py varies them)
        self.programs, self.max_rows, self.num_warps = 256, 4, 8

    def fits(self, x: torch.Tensor) -> bool:
        return x.dtype == self.dtype and x.dim() == 2 and x.is_contiguous() and x.numel() <= self.max_numel

    def calls(self) -> int:
        """Launches so far (program 0 runs in every one); a diagnostic, it reads the device."""
        return int(self.sym.count[0, 0])

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
                x_TD, residual_TD, weight, out, self.sym.ptrs["rows"], self.sym.ptrs["flags"], self.sym.count[0], T,
                N, self.max_numel, eps, RANK=self.rank, P=self.P, MAX_PROGRAMS=SymmetricBuffers.MAX_PROGRAMS,
                STRIDE=FLAG_STRIDE, ROWS=rows, BLOCK=triton.next_power_of_2(N), TWO_SHOT=two_shot,
                num_warps=self.num_warps)
        return out


class EPExchange:
    """EP's dispatch (all-gather of token rows, weights and ids into every rank's buffer) and combine + residual add
    + RMSNorm (reduce-scatter of expert outputs), for capacities up to `max_capacity` tokens per rank."""

    def __init__(self, group: dist.ProcessGroup, max_capacity: int, hidden: int, top_k: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        P = dist.get_world_size(group)
        rows = P * max_capacity
        self.w_offset = rows * hidden  # the routing weights follow the token rows in the same buffer
        self.sym = SymmetricBuffers(group, {"xw": (rows * (hidden + top_k), dtype), "ids": (rows * top_k, torch.int64),
                                            "y": (rows * hidden, dtype)}, device, phases=2)
        self.P, self.rank, self.max_capacity = P, self.sym.rank, max_capacity
        self.hidden, self.top_k, self.dtype = hidden, top_k, dtype
        self.programs, self.max_rows, self.num_warps = 256, 4, 8

    def fits(self, capacity: int) -> bool:
        """Decided on what every rank agrees on (the capacity), so all ranks take the same path."""
        return 0 < capacity <= self.max_capacity

    def calls(self) -> int:
        """Dispatches so far (program 0 runs in every one); a diagnostic, it reads the device."""
        return int(self.sym.count[0, 0])

    def _launch(self, C: int) -> tuple[int, int]:
        grid = min(C, self.programs)
        return grid, min(self.max_rows, triton.next_power_of_2(-(-C // grid)))

    def dispatch(self, x_TD: torch.Tensor, w_TK: torch.Tensor, ids_TK: torch.Tensor, capacity: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every rank's rows, padded to `capacity`: x [P * C, D], weights [P * C, K], ids [P * C, K] (views of this
        rank's buffer, valid until the next dispatch)."""
        C, D, K = capacity, self.hidden, self.top_k
        if x_TD.dtype != self.dtype or x_TD.shape[1] != D or w_TK.shape[1] != K:
            raise ValueError(f"EP exchange set up for [T, {D}] {self.dtype} rows and top-{K} routing, got "
                             f"{x_TD.dtype} {tuple(x_TD.shape)} and {tuple(w_TK.shape)}")
        grid, rows = self._launch(C)
        _ep_dispatch[(grid,)](
            x_TD.contiguous(), w_TK.contiguous(), ids_TK.contiguous(), x_TD.shape[0], C, D, self.sym.ptrs["xw"],
            self.sym.ptrs["ids"], self.sym.ptrs["flags"], self.sym.count[0], self.w_offset, RANK=self.rank,
            P=self.P, K=K, MAX_PROGRAMS=SymmetricBuffers.MAX_PROGRAMS, STRIDE=FLAG_STRIDE, ROWS=rows,
            BLOCK=triton.next_power_of_2(D), KB=triton.next_power_of_2(K), num_warps=self.num_warps)
        xw, n = self.sym.bufs["xw"], self.P * C
        return (xw[: n * D].view(n, D), xw[self.w_offset: self.w_offset + n * K].view(n, K),
                self.sym.bufs["ids"][: n * K].view(n, K))

    def combine_add_norm(self, y_ND: torch.Tensor, num_tokens: int, capacity: int, residual_TD: torch.Tensor,
                         weight: torch.Tensor, eps: float) -> torch.Tensor:
        """rms_norm(residual + this rank's tokens' rows summed over ranks) * weight; residual updated in place."""
        C, D = capacity, self.hidden
        out = torch.empty_like(residual_TD)
        grid, rows = self._launch(C)
        _ep_combine_add_rmsnorm[(grid,)](
            y_ND.contiguous(), residual_TD, weight, out, num_tokens, C, D, self.sym.ptrs["y"], self.sym.ptrs["flags"],
            self.sym.count[1], eps, RANK=self.rank, P=self.P, MAX_PROGRAMS=SymmetricBuffers.MAX_PROGRAMS,
            STRIDE=FLAG_STRIDE, ROWS=rows, BLOCK=triton.next_power_of_2(D), num_warps=self.num_warps)
        return out
