"""The switch's peer transport (moebius/switch/transport.py) on CPU ranks (gloo, shared-memory files standing in for
symmetric memory): its exchanges out of and into the staging every rank addresses move the bytes the collective
all-to-all moves, several staging exchanges share one pair of barriers, exchanges of other tensors go through the
collective transport, and no shared-memory file is left behind."""

from __future__ import annotations

import glob

import pytest
import torch
import torch.distributed as dist
from conftest import run_gloo_ranks

from moebius.parallel.groups import Groups
from moebius.switch.transport import CollectiveTransport, PeerTransport

SHAPES = [torch.Size([6, 4, 5]), torch.Size([6, 5, 2])]  # (w13-like, w2-like): 6 experts' rows, split evenly


def _rank(rank: int, world: int) -> None:
    groups = Groups(rank, world, dist.group.WORLD, dist.group.WORLD)
    shapes = [torch.Size([world * 3, *s[1:]]) for s in SHAPES]
    peer = PeerTransport.build(groups, torch.device("cpu"), shapes, torch.float32, pairs=2)
    ref = CollectiveTransport(dist.group.WORLD)
    calls = [0]
    barrier = peer.buffers.barrier

    def counted() -> None:
        calls[0] += 1
        barrier()

    peer.buffers.barrier = counted  # type: ignore[method-assign]
    g = torch.Generator().manual_seed(rank)
    splits = [3] * world
    for j, (s13, s2) in enumerate(peer.staging()):
        # pull (EP -> TP): this rank packed its shards for every peer into its staging
        s13.copy_(torch.randn(s13.shape, generator=g))
        s2.copy_(torch.randn(s2.shape, generator=g))
        out13, out2 = torch.full(shapes[0], float("nan")), torch.full(shapes[1], float("nan"))
        want13, want2 = torch.empty_like(out13), torch.empty_like(out2)
        ref.all_to_all(want13, s13.clone(), splits, splits)
        ref.all_to_all(want2, s2.clone(), splits, splits)
        before = calls[0]
        peer.all_to_all_many([(out13, s13, splits, splits), (out2, s2, splits, splits)])
        assert calls[0] - before == 2, "two staging exchanges share one pair of barriers"
        assert torch.equal(out13, want13) and torch.equal(out2, want2), f"pull into buffer pair {j}"
        # push (TP -> EP): the TP views' rows go into every peer's staging
        v13, v2 = torch.randn(shapes[0], generator=g), torch.randn(shapes[1], generator=g)
        ref.all_to_all(want13, v13, splits, splits)
        ref.all_to_all(want2, v2, splits, splits)
        peer.all_to_all_many([(s13, v13, splits, splits), (s2, v2, splits, splits)])
        assert torch.equal(s13, want13) and torch.equal(s2, want2), f"push into buffer pair {j}"
    assert peer.peer_exchanges == 8
    # not the staging (as the KV rows): the collective transport, no barrier of its own
    rows = torch.randn(2 * world, 3, generator=g)
    got, want = torch.empty_like(rows), torch.empty_like(rows)
    before = calls[0]
    peer.all_to_all(got, rows, [2] * world, [2] * world)
    ref.all_to_all(want, rows, [2] * world, [2] * world)
    assert torch.equal(got, want) and calls[0] == before and peer.peer_exchanges == 8


@pytest.mark.parametrize("world", [2, 3])
def test_peer_transport_moves_what_the_all_to_all_moves(world: int) -> None:
    before = set(glob.glob("/dev/shm/moebius-switch-*"))
    run_gloo_ranks(_rank, world)
    assert set(glob.glob("/dev/shm/moebius-switch-*")) == before, "shared-memory files left behind"
