"""TP's vocabulary-sliced logits: across P ranks (CPU, gloo) the greedy token is exactly argmax over the whole
vocabulary (ties go to the first id, as torch.argmax), a temperature-sampled token is the one the whole vocabulary
draws, and gathered logits are the whole logits in vocabulary order."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import free_port

from moebius.layers.sampler import SamplingBatch, race_scores, sample
from moebius.parallel.dispatch import TPComm


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
        whole[5] = -whole[5].abs() - 1.0  # all negative: the keys order negative floats too
        mine = whole.chunk(P, dim=-1)[rank]
        comm = TPComm(dist.group.WORLD, vocab_first=rank * mine.shape[1])
        sb = SamplingBatch(temperature=torch.tensor([0.7, 0.0, 1.0, 1.3, 0.9, 1.0]), top_k=torch.full((T,), V),
                           top_p=torch.ones(T), seeds=torch.arange(T) * 7919, steps=torch.arange(T),
                           all_greedy=False, any_top_k=False, any_top_p=False)
        drawn = comm.vocab_argmax(race_scores(mine, sb, comm.vocab_first(mine.shape[1])))
        q.put((rank, comm.vocab_argmax(mine).tolist(), whole.argmax(dim=-1).tolist(),
               torch.equal(comm.gather_vocab(mine), whole), drawn.tolist(), sample(whole, sb).tolist()))
    finally:
        dist.destroy_process_group()


def test_vocab_slices_give_whole_vocabulary_argmax_and_logits() -> None:
    for P in (2, 3):
        ctx = mp.get_context("spawn")
        q = ctx.SimpleQueue()
        port = free_port()
        procs = [ctx.Process(target=_rank, args=(r, P, port, q)) for r in range(P)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
            assert p.exitcode == 0
        results = sorted(q.get() for _ in range(P))
        for _, got, want, gathered, drawn, want_drawn in results:
            assert got == want
            assert gathered
            assert drawn == want_drawn
        assert results[0][1][1] == 0 and results[0][1][2] == 3


def test_tp_engine_samples_what_one_rank_samples(ckpt) -> None:
    """End to end on 2 TP ranks: greedy, temperature-only (sliced scores), top-k and min_tokens (whole logits
    gathered) requests give one rank's tokens."""
    from conftest import PROMPTS, make_llm

    from moebius import SamplingParams

    params = [SamplingParams(temperature=0.8, seed=11, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=1.2, seed=5, max_tokens=10, top_k=7, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=3, max_tokens=6, min_tokens=4)]
    path = ckpt("tied_mha_nonorm")  # 300-token vocabulary: 150 ids per rank
    outs = {}
    for P in (1, 2):
        llm = make_llm(path, num_ranks=P, mode="tp")
        # one kind per batch: a top-k row would send the whole batch through the gathered-logits path
        outs[P] = [[o.token_ids for o in llm.generate(PROMPTS[1:4], sp)] for sp in params]
        llm.close()
    assert outs[2] == outs[1]
