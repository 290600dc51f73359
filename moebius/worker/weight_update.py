"""A weight update on a rank (`WeightUpdate`), between two steps: the load path with another source. The rank's
resident specs (dense regions of both layouts, experts of the active one: `Family.resident_specs`) are cut again by
their own loads (experts: copied from the source's views straight into the slot, `ParamSpec.fill`) and written into the
same views, so no address changes and every captured graph stays valid; the next
switch moves the new experts like any others. Every rank first says whether it holds the update's tensors (a
shared-memory segment it could not map, a directory it could not open, a trainer's broadcast it did not receive):
one that does not, and no rank writes. Joining and leaving a trainer's process group (`worker/update_group.py`)
come the same way: every rank or none.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from moebius.config import ModelConfig
from moebius.link.messages import UpdateGroupOrder, WeightUpdate
from moebius.link.tensor_handles import open_tensors
from moebius.memory.umm import UnifiedMemory
from moebius.models.loader import Checkpoint, check_update, load_weights, write_update
from moebius.models.registry import family_of
from moebius.models.specs import ParamSpec, spec_reads
from moebius.parallel.groups import Groups, all_gather_json
from moebius.parallel.layout import Layout
from moebius.worker import update_group


class WeightTargets:
    """The views an update may write on a rank, per active layout, each with the checkpoint tensors its cut reads
    (worked out at the first update, then kept)."""

    def __init__(self, cfg: ModelConfig, layouts: dict[str, Layout], dtype: torch.dtype) -> None:
        self.cfg, self.layouts, self.dtype = cfg, layouts, dtype
        self._specs: dict[str, list[tuple[ParamSpec, tuple[str, ...]]]] = {}
        self._reads: dict[tuple[str, int | None, int], tuple[str, ...]] = {}  # a region's reads: both layouts'
        self.update_groups: dict[str, torch.distributed.ProcessGroup] = {}  # trainers' groups joined, by name

    def specs(self, mode: str) -> list[tuple[ParamSpec, tuple[str, ...]]]:
        if mode not in self._specs:
            specs = [s for s in family_of(self.cfg).resident_specs(self.cfg, self.layouts, mode, self.dtype.itemsize)
                     if s.load is not None]
            self._specs[mode] = [(s, self._reads.setdefault((s.name, s.slot, s.offset), spec_reads(s)))
                                 for s in specs]
        return self._specs[mode]


def _source(update: WeightUpdate, targets: WeightTargets, device: torch.device
            ) -> Checkpoint | Mapping[str, torch.Tensor]:
    if update.broadcast is not None:
        pg = targets.update_groups.get(update.broadcast.group_name)
        if pg is None:
            raise ValueError(f"no process group {update.broadcast.group_name!r} joined on this rank")
        # received whole before any write: the trainer's tensors cut like in-memory ones (fused experts kept whole)
        return check_update(targets.cfg, update_group.receive(pg, update.broadcast, device))
    if update.path is not None:
        return Checkpoint(update.path)
    if update.handles is not None:  # (their copies read the exporter's memory: apply_update waits for them)
        return check_update(targets.cfg, open_tensors(update.handles)[0])  # (by the checkpoint's names)
    return update.local


def apply_update(umm: UnifiedMemory, targets: WeightTargets, mode: str, update: WeightUpdate,
                 groups: Groups) -> tuple[int, str | None]:
    """Write the update into this rank's views (`mode`: the active layout) once every rank holds its tensors.
    Returns (views written, None), or (0, why) when some rank could not reach them (then no rank wrote)."""
    source: Checkpoint | Mapping[str, torch.Tensor] | None = None
    error = None
    if update.group is not None:
        return _group_order(targets, update.group, groups)
    try:
        source = _source(update, targets, umm.device)
    except (OSError, ValueError, RuntimeError) as e:  # a segment this rank cannot map (another machine?), a broadcast
        error = f"{type(e).__name__}: {e}"
    errors = all_gather_json(error, groups)
    failed = [f"rank {r}: {e}" for r, e in enumerate(errors) if e]
    if failed:
        return 0, "no rank wrote a byte: " + "; ".join(failed)
    specs = targets.specs(mode)
    if isinstance(source, Checkpoint):  # every tensor is there (checked at the front end): the load itself
        load_weights(umm, [s for s, _ in specs], source, targets.dtype, targets.cfg)
        return len(specs), None
    assert source is not None
    views = write_update(umm, specs, source, targets.dtype)
    if update.handles is not None and umm.device.type == "cuda":  # the exporter may change them once we answer
        torch.cuda.synchronize(umm.device)
    return views, None


def _group_order(targets: WeightTargets, order: UpdateGroupOrder, groups: Groups) -> tuple[int, str | None]:
    """Join or leave a trainer's process group on every rank; a join that failed on some rank is undone on the
    others, so the ranks stay alike. Returns (0, None) or (0, why)."""
    error = None
    joined = targets.update_groups
    try:
        if order.init:
            if order.group_name in joined:
                raise ValueError(f"process group {order.group_name!r} is joined already")
            joined[order.group_name] = update_group.join(order, groups.rank)
        else:
            pg = joined.pop(order.group_name, None)
            if pg is None:
                raise ValueError(f"no process group {order.group_name!r} joined")
            update_group.leave(pg)
    except (OSError, ValueError, RuntimeError) as e:  # a trainer that never came (timeout), a port refused
        error = f"{type(e).__name__}: {e}"
    failed = [f"rank {r}: {e}" for r, e in enumerate(all_gather_json(error, groups)) if e]
    if failed and order.init and error is None:
        update_group.leave(joined.pop(order.group_name))
    return 0, ("; ".join(failed) if failed else None)
