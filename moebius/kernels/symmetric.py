"""Cross-GPU exchanges through torch symmetric memory, fused with the math around them (Triton, one launch each).

Every GPU of the group maps every peer's symmetric-memory buffers (torch `_symmetric_memory`), so a program writes
rows into a peer's buffer over NVLink (posted stores: faster than reading the peer's, which waits a round trip
per load), tells the peer through a flag in the peer's memory, waits for the peers' flags, and reads what they
wrote locally. Flags carry call numbers: program p of every rank makes the same calls (the ranks run the same steps
with the same sizes, so the grids agree), so in its call n program p sets its flag in each peer to n + 1 and waits
until each peer's flag for p has reached n + 1. No host-side state, so the kernels replay inside CUDA graphs.

- TP, `FusedAllReduceNorm`: the sum of the ranks' partial outputs + the residual add + the next RMSNorm. Summed in
  rank order in float32 and rounded once, every rank gets the same bits. Small batches go one-shot (every rank
  sums every row), large ones two-shot (each rank sums its share and sends the results back), as torch's and
  NCCL's all-reduces do. Rows land in one of two slots, chosen by the call number: a rank writes a peer's slot
  again only two calls later, after waiting for the peer's flag of the call in between, which the peer raises only
  once its previous call (the reads of this slot) has ended. Reference: `add_rms_norm(all_reduce(x), ...)`.
  Up to 16 tokens, the low-latency protocol instead (`_allreduce_ll`): each value travels as one 8-byte word, its
  float32 bits tagged with the call number, so a word that arrived is valid by itself: no fence, no flag.
- EP, `EPExchange`: dispatch (every rank's token rows, routing weights and expert ids, padded to the agreed
  capacity, land in every rank's buffer: the all-gather) and combine (each rank's expert outputs for another
  rank's tokens go to that rank, which sums them in rank order, adds the residual and norms: the reduce-scatter +
  add + norm). One buffer each, no slots: a dispatch writes a peer's buffer only after the combine before it waited
  for the peer's combine, which the peer starts only after its experts finished reading its dispatch buffer; and
  the other way round. Reference: `EPComm`'s NCCL all-gather / reduce-scatter path.

Both sublayer-end kernels also take the MoE's outputs per (token, k) pair (`kernels.pairs.PairRows`) and sum each
token's local pairs as they read them (`_partial`, as fused.py's `_sum_k` would before them), up to the sizes
where the separate sum measured faster (benchmarks/results/h200x2-pair-sum-fold-ab.json). A rank's own partial
rows, where it needs them after raising its flag, go to its own section of its buffer first (no peer writes there):
the EP combine must not read the dispatched ids then, since a peer's next dispatch may already be overwriting them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from moebius.kernels import DEFAULT_KERNELS, KernelConfig
from moebius.kernels.pairs import PairRows
from moebius.kernels.pdl import pdl, release, wait

FLAG_STRIDE = 32  # int32s between flags: one 128-byte line each, so spinning programs do not share a line


MAX_RANKS_INT = 8  # one NVLink domain of an HGX board
MAX_RANKS = tl.constexpr(MAX_RANKS_INT)


@triton.jit
def _flag_arrays(Flags, P: tl.constexpr):
    """Every rank's flag array address [MAX_RANKS] (a fixed table: kernels read it before they wait for the kernel
    before them, so it is not a round trip between their peer writes and their flags)."""
    r = tl.arange(0, MAX_RANKS)
    return tl.load(Flags + r, mask=r < P, other=0)


@triton.jit
def _flags_of(flags, r):
    return tl.sum(tl.where(tl.arange(0, MAX_RANKS) == r, flags, 0), 0).to(tl.pointer_type(tl.int32))


@triton.jit
def _flag_and_wait(flags, calls, pid, PHASE: tl.constexpr, RANK: tl.constexpr, P: tl.constexpr,
                   MAX_PROGRAMS: tl.constexpr, STRIDE: tl.constexpr):
    """Tell every peer this program's writes of this phase of call number `calls` are done (the flag holds the
    number of the call + 1); wait until every peer has told us. flags: `_flag_arrays`."""
    tl.debug_barrier()  # every thread's writes precede the flag
    for r in tl.static_range(P):
        if r != RANK:
            peer = _flags_of(flags, r)
            tl.atomic_xchg(peer + ((PHASE * P + RANK) * MAX_PROGRAMS + pid) * STRIDE, calls + 1, sem="release",
                           scope="sys")
    mine = _flags_of(flags, RANK)
    for r in tl.static_range(P):
        if r != RANK:
            flag = mine + ((PHASE * P + r) * MAX_PROGRAMS + pid) * STRIDE
            # cheap polling (the atomic below orders what follows) until the flag has reached calls + 1, counted
            # modulo 2^32: call numbers wrap (an int32 a program, which a long-running server exceeds)
            while ((tl.load(flag, volatile=True).to(tl.int64) - calls - 1) & 0xFFFFFFFF) >= 0x80000000:
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
def _partial(X, Ids, row, rm, cols, N, first, E, K: tl.constexpr, PAIRS: tl.constexpr, ROWS: tl.constexpr,
             BLOCK: tl.constexpr):
    """This rank's partial rows [ROWS, BLOCK] in X's dtype (zero where masked): X's rows `row`, or (PAIRS) for each
    token row t the sum of its pairs' rows X[t * K + k] whose expert (Ids[t, k] - first) is one of the E local
    ones, in float32 in k order, rounded once (as fused.py's `_sum_k`, which this replaces)."""
    m = rm[:, None] & (cols < N)[None, :]
    if PAIRS:
        acc = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
        for k in tl.static_range(K):
            e = tl.load(Ids + row.to(tl.int64) * K + k, mask=rm, other=-1) - first
            ok = (e >= 0) & (e < E)
            src = X + (row.to(tl.int64) * K + k)[:, None] * N + cols[None, :]
            acc += tl.load(src, mask=m & ok[:, None], other=0.0).to(tl.float32)
        return acc.to(X.dtype.element_ty)
    else:
        return tl.load(X + row[:, None] * N + cols[None, :], mask=m, other=0.0)


@triton.jit
def _sum_add_norm(own, peers, peer_stride, R, W, Out, off, cols, m, N, eps, RANK: tl.constexpr, P: tl.constexpr,
                  ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """Rows summed over ranks in rank order (so every rank rounds the same sum): this rank's partial rows `own`,
    rank r's as received at `peers + r * peer_stride`; then residual + sum and its RMSNorm stored. Returns the new
    residual rows (rounded as the unfused path rounds: the sum, then residual + sum, then the norm)."""
    acc = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
    for r in tl.static_range(P):
        if r == RANK:
            acc += own.to(tl.float32)
        else:  # .cg: past L1, which is not coherent with what a peer wrote during this kernel
            acc += tl.load(peers + r * peer_stride, mask=m, other=0.0, cache_modifier=".cg").to(tl.float32)
    return _add_norm(acc, R, W, Out, off, cols, m, N, eps)


@triton.jit
def _add_norm(acc, R, W, Out, off, cols, m, N, eps):
    """acc: the rows' float32 sums over ranks: residual + sum (rounded as the unfused path rounds: the sum, then
    residual + sum) and its RMSNorm stored; returns the new residual rows."""
    dt = R.dtype.element_ty
    x = (acc.to(dt).to(tl.float32) + tl.load(R + off, mask=m, other=0.0).to(tl.float32)).to(dt)
    _store_norm(x, R, W, Out, off, cols, m, N, eps)
    return x


@triton.jit
def _allreduce_ll(X, Ids, R, W, Out, LLBufs, Count, T, N, ll_numel, first, E, eps, RANK: tl.constexpr,
                  P: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, K: tl.constexpr, PAIRS: tl.constexpr):
    """One-shot all-reduce + add + norm of a few rows, low-latency protocol: each value travels as one 8-byte word, its
    float32 bits under the call number + 1 of the program that sends it (the tag), so a word that has arrived is
    valid on its own: no fence after the data, no flag behind it (a flag costs the wait for the data's
    acknowledgement over NVLink, then the flag's own flight). Buffers ([2 slots][P source ranks][ll_numel words] on
    every rank, zero at start) alternate by call parity as in the flag protocol. The grid is the same for every such
    call, so row r always travels with program r % G's call number: a word left from an older call never matches."""
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    k = tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    calls = tl.load(Count + pid)
    # calls + 1 modulo 2^31 with the top bit set: never 0 (a word never written), distinct over 2^31 calls
    tag = (((calls + 1).to(tl.int64) & 0x7FFFFFFF) | 0x80000000) << 32
    slot = (calls & 1).to(tl.int64)
    mine = tl.load(LLBufs + RANK).to(tl.pointer_type(tl.int64))
    # each iteration sends its rows, then sums them with the peers' (every rank runs the same iterations, so a
    # rank waiting for a peer's rows of this iteration has sent its own: no deadlock), the own partial read once
    for it in range(0, tl.cdiv(tl.cdiv(T - pid, G), ROWS)):
        row = pid + (it * ROWS + k) * G
        off = row[:, None] * N + cols[None, :]
        m = (row < T)[:, None] & (cols < N)[None, :]
        x = _partial(X, Ids, row, row < T, cols, N, first, E, K, PAIRS, ROWS, BLOCK)
        word = tag | (x.to(tl.float32).to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF)
        for r in tl.static_range(P):
            if r != RANK:
                dst = tl.load(LLBufs + r).to(tl.pointer_type(tl.int64)) + (slot * P + RANK) * ll_numel
                tl.store(dst + off, word, mask=m)
        acc = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
        for r in tl.static_range(P):  # in rank order, as the flag protocol sums
            if r == RANK:
                acc += x.to(tl.float32)
            else:
                src = mine + (slot * P + r) * ll_numel + off
                word = tl.load(src, mask=m, other=tag, volatile=True)
                while tl.sum(((word & -4294967296) != tag).to(tl.int32), axis=None) > 0:
                    word = tl.load(src, mask=m, other=tag, volatile=True)
                acc += (word & 0xFFFFFFFF).to(tl.int32).to(tl.float32, bitcast=True)
        _add_norm(acc, R, W, Out, off, cols, m, N, eps)
    tl.store(Count + pid, calls + 1)


@triton.jit
def _allreduce_add_rmsnorm(X, Ids, R, W, Out, Bufs, Flags, Count, T, N, sec_numel, first, E, eps, LLBufs, ll_numel,
                           RANK: tl.constexpr, P: tl.constexpr, MAX_PROGRAMS: tl.constexpr, STRIDE: tl.constexpr,
                           ROWS: tl.constexpr, BLOCK: tl.constexpr, TWO_SHOT: tl.constexpr, K: tl.constexpr,
                           PAIRS: tl.constexpr, LL: tl.constexpr, PDL: tl.constexpr):
    release(PDL)
    flags = _flag_arrays(Flags, P)
    wait(PDL)
    if LL:
        _allreduce_ll(X, Ids, R, W, Out, LLBufs, Count, T, N, ll_numel, first, E, eps, RANK, P, ROWS, BLOCK, K,
                      PAIRS)
        return
    # Each rank's buffer: [2 slots][2 phases][P source ranks][rows, N], rows at their index in the batch. Rows
    # travel as posted NVLink stores into the peer's buffer (pushed: faster than reading the peer's, which waits a
    # round trip per load), and are read locally. A program's rows are pid, pid + G, ...; it moves ROWS of
    # them per iteration, so more loads and stores are in flight.
    # One-shot: every rank receives every row and sums them all.
    # Two-shot: a program's j-th row belongs to rank j % P; each rank receives the partials of its rows, sums,
    # adds and norms them, and pushes the new residual rows to the peers (phase 1), which norm them too.
    # PAIRS: X holds expert outputs per (token, k) pair, summed here over each token's local pairs (`_partial`);
    # one-shot keeps its own partial rows in its own section of its buffer (which no peer writes) for phase 1.
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    k = tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    dt = X.dtype.element_ty
    calls = tl.load(Count + pid)
    slot = (calls & 1).to(tl.int64)  # (calls % 2 is -1 for odd calls once they wrap negative)
    mine = tl.load(Bufs + RANK).to(tl.pointer_type(dt))
    iters = tl.cdiv(tl.cdiv(T - pid, G), ROWS)
    for it in range(0, iters):
        j = it * ROWS + k
        row = pid + j * G
        off = row[:, None] * N + cols[None, :]  # int32: the buffer holds far fewer than 2^31 elements
        m = (row < T)[:, None] & (cols < N)[None, :]
        owner = (j % P)[:, None]
        rm = row < T
        if TWO_SHOT:
            m = m & (owner != RANK)
            rm = rm & (j % P != RANK)
        x = _partial(X, Ids, row, rm, cols, N, first, E, K, PAIRS, ROWS, BLOCK)
        if PAIRS and not TWO_SHOT:
            tl.store(mine + ((slot * 2) * P + RANK) * sec_numel + off, x, mask=m)
        for r in tl.static_range(P):
            if r != RANK:
                dst = tl.load(Bufs + r).to(tl.pointer_type(dt)) + ((slot * 2) * P + RANK) * sec_numel
                if TWO_SHOT:
                    tl.store(dst + off, x, mask=m & (owner == r))
                else:
                    tl.store(dst + off, x, mask=m)
    _flag_and_wait(flags, calls, pid, 0, RANK, P, MAX_PROGRAMS, STRIDE)
    for it in range(0, iters):
        j = it * ROWS + k
        row = pid + j * G
        off = row[:, None] * N + cols[None, :]
        m = (row < T)[:, None] & (cols < N)[None, :]
        owner = (j % P)[:, None]
        rm = row < T
        if TWO_SHOT:
            m = m & (owner == RANK)
            rm = rm & (j % P == RANK)
        if PAIRS and not TWO_SHOT:
            own = tl.load(mine + ((slot * 2) * P + RANK) * sec_numel + off, mask=m, other=0.0)
        else:  # two-shot: rows of this rank's share, not read before
            own = _partial(X, Ids, row, rm, cols, N, first, E, K, PAIRS, ROWS, BLOCK)
        x = _sum_add_norm(own, mine + (slot * 2) * P * sec_numel + off, sec_numel, R, W, Out, off, cols, m, N,
                          eps, RANK, P, ROWS, BLOCK)
        if TWO_SHOT:
            for r in tl.static_range(P):
                if r != RANK:
                    dst = tl.load(Bufs + r).to(tl.pointer_type(dt)) + ((slot * 2 + 1) * P + RANK) * sec_numel
                    tl.store(dst + off, x, mask=m)
    if TWO_SHOT:
        _flag_and_wait(flags, calls, pid, 1, RANK, P, MAX_PROGRAMS, STRIDE)
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
                 BLOCK: tl.constexpr, KB: tl.constexpr, PDL: tl.constexpr):
    release(PDL)
    flags = _flag_arrays(Flags, P)
    wait(PDL)
    # every rank's buffers hold [P * C, D] token rows (then [P * C, K] weights) and [P * C, K] ids, rank r's rows at
    # r * C; rows from T to C are padding: zero rows, zero weights, expert id -1 (no rank owns it)
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    k = tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    kcols = tl.arange(0, KB)
    dt = X.dtype.element_ty
    calls = tl.load(Count + pid)
    for it in range(0, tl.cdiv(tl.cdiv(C - pid, G), ROWS)):
        t = pid + (it * ROWS + k) * G
        valid = (t < T)[:, None]
        inside = (t < C)[:, None]
        mx = cols[None, :] < D
        mk = kcols[None, :] < K
        x = tl.load(X + t[:, None] * D + cols[None, :], mask=valid & mx, other=0.0)
        w = tl.load(W + t[:, None] * K + kcols[None, :], mask=valid & mk, other=0.0)
        ids = tl.load(Ids + t[:, None] * K + kcols[None, :], mask=valid & mk, other=-1)
        row = (RANK * C + t)[:, None]
        for r in tl.static_range(P):
            xw = tl.load(XW + r).to(tl.pointer_type(dt))
            tl.store(xw + row * D + cols[None, :], x, mask=inside & mx)
            tl.store(xw + w_offset + row * K + kcols[None, :], w.to(dt), mask=inside & mk)
            idb = tl.load(IdBufs + r).to(tl.pointer_type(tl.int64))
            tl.store(idb + row * K + kcols[None, :], ids.to(tl.int64), mask=inside & mk)
    _flag_and_wait(flags, calls, pid, 0, RANK, P, MAX_PROGRAMS, STRIDE)
    tl.store(Count + pid, calls + 1)


@triton.jit
def _ep_combine_add_rmsnorm(Y, Ids, R, W, Out, T, C, D, Bufs, Flags, Count, first, E, eps, RANK: tl.constexpr,
                            P: tl.constexpr, MAX_PROGRAMS: tl.constexpr, STRIDE: tl.constexpr, ROWS: tl.constexpr,
                            BLOCK: tl.constexpr, K: tl.constexpr, PAIRS: tl.constexpr, PDL: tl.constexpr):
    release(PDL)
    flags = _flag_arrays(Flags, P)
    wait(PDL)
    # Y [P * C, D]: this rank's expert outputs for every rank's tokens; rank q's rows go to q's buffer at RANK * C.
    # PAIRS: Y [P * C * K, D] per (token, k) pair, summed over the local pairs here (`_partial`; Ids: the dispatched
    # ids, in the dispatch buffer, which a peer's next dispatch may overwrite once this rank has raised its flag:
    # so this rank's own rows are summed before it, into its own section of its buffer, which no peer writes).
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
            if q != RANK or PAIRS:  # (q = RANK: this rank's own rows into its own section)
                y = _partial(Y, Ids, q * C + t, t < C, cols, D, first, E, K, PAIRS, ROWS, BLOCK)
                dst = tl.load(Bufs + q).to(tl.pointer_type(dt))
                tl.store(dst + (RANK * C + t)[:, None] * D + cols[None, :], y, mask=m)
    _flag_and_wait(flags, calls, pid, 1, RANK, P, MAX_PROGRAMS, STRIDE)
    mine = tl.load(Bufs + RANK).to(tl.pointer_type(dt))
    for it in range(0, iters):
        t = pid + (it * ROWS + k) * G
        m = (t < T)[:, None] & (cols[None, :] < D)
        off = t[:, None] * D + cols[None, :]
        if PAIRS:
            own = tl.load(mine + RANK * C * D + off, mask=m, other=0.0)
        else:
            own = _partial(Y, Ids, RANK * C + t, t < T, cols, D, first, E, K, PAIRS, ROWS, BLOCK)
        _sum_add_norm(own, mine + off, C * D, R, W, Out, off, cols, m, D, eps, RANK, P, ROWS, BLOCK)
    tl.store(Count + pid, calls + 1)


def _pair_args(pairs: PairRows | None, x: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """The kernels' (Ids, first, E, K) for expert outputs per pair; placeholders, never read, for plain rows."""
    return (pairs.ids_TK, pairs.first_expert, pairs.num_local, pairs.ids_TK.shape[1]) if pairs else (x, 0, 0, 1)


class SymmetricBuffers:
    """Symmetric-memory tensors of one process group with the table of every rank's address of each, the flags and
    the per-program call counts. Set up collectively (every rank constructs it at the same point)."""

    MAX_PROGRAMS = 256  # flags per peer and phase; rows beyond the grid loop within a program

    def __init__(self, group: dist.ProcessGroup, sizes: dict[str, tuple[int, torch.dtype]], device: torch.device,
                 phases: int) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.P, self.rank = dist.get_world_size(group), dist.get_rank(group)
        if self.P > MAX_RANKS_INT:
            raise ValueError(f"symmetric-memory exchanges take up to {MAX_RANKS_INT} ranks, not {self.P} "
                             "(--disable-custom-all-reduce uses NCCL)")
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

    TWO_SHOT_MIN_BYTES = 8 << 20  # from here each rank sums only its share (`python benchmarks/comm/comm_bench.py`)
    # Up to this many elements (16 tokens of 2048), the low-latency protocol (`_allreduce_ll`), always on
    # LL_PROGRAMS programs: each value travels as an 8-byte word carrying the call number.
    LL_MAX_NUMEL = 16 * 2048
    LL_PROGRAMS = 16

    def __init__(self, group: dist.ProcessGroup, max_numel: int, dtype: torch.dtype, device: torch.device) -> None:
        P = dist.get_world_size(group)
        self.sym = SymmetricBuffers(group, {"rows": (2 * 2 * P * max_numel, dtype),
                                            "ll": (2 * P * self.LL_MAX_NUMEL, torch.int64)}, device, phases=2)
        self.P, self.rank, self.max_numel, self.dtype = P, self.sym.rank, max_numel, dtype
        # grid cap, rows per iteration at most, warps per program (`python benchmarks/comm/comm_bench.py` varies them)
        self.programs, self.max_rows, self.num_warps = 256, 4, 8

    def fits(self, x: torch.Tensor) -> bool:
        return x.dtype == self.dtype and x.dim() == 2 and x.is_contiguous() and x.numel() <= self.max_numel

    def calls(self) -> int:
        """Launches so far (program 0 runs in every one); a diagnostic, it reads the device."""
        return int(self.sym.count[0, 0])

    def __call__(self, x_TD: torch.Tensor, residual_TD: torch.Tensor, weight: torch.Tensor, eps: float,
                 two_shot: bool | None = None, *, kc: KernelConfig = DEFAULT_KERNELS) -> torch.Tensor:
        """rms_norm(residual + sum over ranks of x) * weight; residual updated in place."""
        if not self.fits(x_TD):
            raise ValueError(f"fused all-reduce takes contiguous [T, D] {self.dtype} of at most {self.max_numel} "
                             f"elements, not {x_TD.dtype} {tuple(x_TD.shape)}")
        return self._launch(x_TD, None, residual_TD, weight, eps, two_shot, kc)

    # One-shot calls of more rows sum pairs slower inside than `_sum_k` does before it (its grid is far wider);
    # two-shot calls (each rank sums half the rows) and one-shot calls of fewer rows gain (measured on whole steps:
    # benchmarks/results/h200x2-pair-sum-fold-ab.json)
    PAIRS_ONE_SHOT_MAX_ROWS = 512

    def _two_shot(self, T: int, N: int, dtype: torch.dtype) -> bool:
        return T * N * dtype.itemsize >= self.TWO_SHOT_MIN_BYTES

    def fits_pairs(self, pairs: PairRows) -> bool:
        """Whether `sum_pairs` takes these (else sum them first and call): not pairs carrying a per-token output to
        add (`PairRows.add_TD`), which this kernel does not read."""
        T, K = pairs.ids_TK.shape
        y = pairs.y_ND
        return (pairs.add_TD is None and y.dtype == self.dtype and y.is_contiguous() and pairs.ids_TK.is_contiguous()
                and y.shape[0] == T * K and T * y.shape[1] <= self.max_numel
                and (self._two_shot(T, y.shape[1], y.dtype) or T <= self.PAIRS_ONE_SHOT_MAX_ROWS))

    def sum_pairs(self, pairs: PairRows, residual_TD: torch.Tensor, weight: torch.Tensor, eps: float,
                  two_shot: bool | None = None, *, kc: KernelConfig = DEFAULT_KERNELS) -> torch.Tensor:
        """As the call, where x is each token's sum over its local pairs' expert outputs (summed in the kernel)."""
        if not self.fits_pairs(pairs):
            raise ValueError(f"fused all-reduce takes contiguous pair rows of [T, D] {self.dtype} of at most "
                             f"{self.max_numel} elements, not {pairs.y_ND.dtype} {tuple(pairs.y_ND.shape)} for "
                             f"{tuple(pairs.ids_TK.shape)} pairs")
        return self._launch(pairs.y_ND, pairs, residual_TD, weight, eps, two_shot, kc)

    def _launch(self, x: torch.Tensor, pairs: PairRows | None, residual_TD: torch.Tensor, weight: torch.Tensor,
                eps: float, two_shot: bool | None, kc: KernelConfig) -> torch.Tensor:
        T, N = residual_TD.shape
        out = torch.empty_like(residual_TD)
        if two_shot is None:
            two_shot = self._two_shot(T, N, x.dtype)
        if T:
            ll = not two_shot and T * N <= self.LL_MAX_NUMEL
            # two-shot: at least P rows per program, so that each program's rows alternate between owners
            grid = self.LL_PROGRAMS if ll else min(-(-T // self.P) if two_shot else T, self.programs)
            rows = min(self.max_rows, triton.next_power_of_2(-(-T // grid)))
            ids, first, E, K = _pair_args(pairs, x)
            _allreduce_add_rmsnorm[(grid,)](
                x, ids, residual_TD, weight, out, self.sym.ptrs["rows"], self.sym.ptrs["flags"], self.sym.count[0],
                T, N, self.max_numel, first, E, eps, self.sym.ptrs["ll"], self.LL_MAX_NUMEL, RANK=self.rank,
                P=self.P, MAX_PROGRAMS=SymmetricBuffers.MAX_PROGRAMS, STRIDE=FLAG_STRIDE, ROWS=rows,
                BLOCK=triton.next_power_of_2(N), TWO_SHOT=two_shot, K=K, PAIRS=pairs is not None, LL=ll,
                num_warps=self.num_warps, **pdl(x, kc))
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

    # Past this capacity the combine sums expert outputs per pair slower than `_sum_k` before it (measured on whole
    # steps: benchmarks/results/h200x2-pair-sum-fold-ab.json)
    PAIRS_MAX_CAPACITY = 512

    def fits(self, capacity: int) -> bool:
        """Decided on what every rank agrees on (the capacity), so all ranks take the same path."""
        return 0 < capacity <= self.max_capacity

    def calls(self) -> int:
        """Dispatches so far (program 0 runs in every one); a diagnostic, it reads the device."""
        return int(self.sym.count[0, 0])

    def _launch(self, C: int) -> tuple[int, int]:
        grid = min(C, self.programs)
        return grid, min(self.max_rows, triton.next_power_of_2(-(-C // grid)))

    def dispatch(self, x_TD: torch.Tensor, w_TK: torch.Tensor, ids_TK: torch.Tensor, capacity: int, *,
                 kc: KernelConfig = DEFAULT_KERNELS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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
            BLOCK=triton.next_power_of_2(D), KB=triton.next_power_of_2(K), num_warps=self.num_warps, **pdl(x_TD, kc))
        xw, n = self.sym.bufs["xw"], self.P * C
        return (xw[: n * D].view(n, D), xw[self.w_offset: self.w_offset + n * K].view(n, K),
                self.sym.bufs["ids"][: n * K].view(n, K))

    def combine_add_norm(self, y: torch.Tensor | PairRows, num_tokens: int, capacity: int,
                         residual_TD: torch.Tensor, weight: torch.Tensor, eps: float, *,
                         kc: KernelConfig = DEFAULT_KERNELS) -> torch.Tensor:
        """rms_norm(residual + this rank's tokens' rows summed over ranks) * weight; residual updated in place.
        y: [P * C, D], or the expert outputs per pair of those rows, summed here over each token's local pairs (in
        the kernel up to PAIRS_MAX_CAPACITY, before it beyond or where they carry a per-token output to add)."""
        C, D = capacity, self.hidden
        if isinstance(y, PairRows) and (C > self.PAIRS_MAX_CAPACITY or y.add_TD is not None):
            y = y.sum(kc=kc)
        pairs = y if isinstance(y, PairRows) else None
        y_ND = pairs.y_ND if pairs else y
        ids, first, E, K = _pair_args(pairs, y_ND)
        if y_ND.shape != (self.P * C * K, D) or (pairs and ids.shape[0] != self.P * C):
            raise ValueError(f"EP combine of capacity {C} wants [{self.P * C * K}, {D}] rows, got "
                             f"{tuple(y_ND.shape)}")
        out = torch.empty_like(residual_TD)
        grid, rows = self._launch(C)
        _ep_combine_add_rmsnorm[(grid,)](
            y_ND.contiguous(), ids, residual_TD, weight, out, num_tokens, C, D, self.sym.ptrs["y"],
            self.sym.ptrs["flags"], self.sym.count[1], first, E, eps, RANK=self.rank, P=self.P,
            MAX_PROGRAMS=SymmetricBuffers.MAX_PROGRAMS, STRIDE=FLAG_STRIDE, ROWS=rows,
            BLOCK=triton.next_power_of_2(D), K=K, PAIRS=pairs is not None, num_warps=self.num_warps, **pdl(y_ND, kc))
        return out
