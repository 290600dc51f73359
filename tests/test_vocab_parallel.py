"""TP's vocabulary-sliced logits: across P ranks (CPU, gloo) the greedy token is exactly argmax over the whole
vocabulary (ties go to the first id, as torch.argmax), and gathered logits are the whole logits in vocabulary order."""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moebius.parallel.dispatch import TPComm


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, P: int, port: int, q: mp.SimpleQueue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=P)
    try:
        g = torch.Generator().manual_seed(0)
        T, V = 6, 12 * P
        whole = torch.randn(T, V, generator=g)
        whole[1] = 0.0  # every id ties: the first wins
        whole[2, [3, V - 1]] = 9.0  # a tie across ranks: the lower id wins
        whole[3, V - 1] = 9.0  # the best id in the last rank's slice
        whole[4, [0, 1]] = 7.0  # a tie inside the first rank's slice
        comm = TPComm(dist.group.WORLD)
        mine = whole.chunk(P, dim=-1)[rank]
        q.put((rank, comm.vocab_argmax(mine).tolist(), whole.argmax(dim=-1).tolist(),
               torch.equal(comm.gather_vocab(mine), whole)))
    finally:
        dist.destroy_process_group()


def test_vocab_slices_give_whole_vocabulary_argmax_and_logits() -> None:
    for P in (2, 3):
        ctx = mp.get_context("spawn")
        q = ctx.SimpleQueue()
        port = _port()
        procs = [ctx.Process(target=_rank, args=(r, P, port, q)) for r in range(P)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
            assert p.exitcode == 0
        results = sorted(q.get() for _ in range(P))
        for _, got, want, gathered in results:
            assert got == want
            assert gathered
        assert results[0][1][1] == 0 and results[0][1][2] == 3
