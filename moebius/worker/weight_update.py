"""A weight update on a rank (`WeightUpdate`), between two steps: the load path with another source. The rank's
resident specs (dense regions of both layouts, experts of the active one: `resident_specs`) are cut again by their
own loads and written into the same views, so no address changes and every captured graph stays valid; the next
switch moves the new experts like any others. Every rank first says whether it holds the update's tensors (a
shared-memory segment it could not map, a directory it could not open): one that does not, and no rank writes.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping

import torch

from moebius.config import ModelConfig
from moebius.link.messages import WeightUpdate
from moebius.link.shared_tensors import attach
from moebius.memory.umm import UnifiedMemory
from moebius.model.loader import Checkpoint, load_weights, write_update
from moebius.model.weights import ParamSpec, resident_specs, spec_reads
from moebius.parallel.groups import Groups, all_gather_json
from moebius.parallel.layout import Layout


class WeightTargets:
    """The views an update may write on a rank, per active layout, each with the checkpoint tensors its cut reads
    (worked out at the first update, then kept)."""

    def __init__(self, cfg: ModelConfig, layouts: dict[str, Layout], dtype: torch.dtype) -> None:
        self.cfg, self.layouts, self.dtype = cfg, layouts, dtype
        self._specs: dict[str, list[tuple[ParamSpec, tuple[str, ...]]]] = {}
        self._reads: dict[tuple[str, int | None, int], tuple[str, ...]] = {}  # a region's reads: both layouts'

    def specs(self, mode: str) -> list[tuple[ParamSpec, tuple[str, ...]]]:
        if mode not in self._specs:
            specs = [s for s in resident_specs(self.cfg, self.layouts, mode, self.dtype.itemsize)
                     if s.load is not None]
            self._specs[mode] = [(s, self._reads.setdefault((s.name, s.slot, s.offset), spec_reads(s)))
                                 for s in specs]
        return self._specs[mode]


def _source(update: WeightUpdate) -> Checkpoint | Mapping[str, torch.Tensor]:
    if update.path is not None:
        return Checkpoint(update.path)
    if update.segment is not None:
        try:
            return attach(update.segment, update.tensors)
        except FileNotFoundError:
            raise FileNotFoundError(f"no shared-memory segment {update.segment} on {socket.gethostname()}: tensors "
                                    "in memory reach the ranks of the front end's machine only") from None
    return update.local


def apply_update(umm: UnifiedMemory, targets: WeightTargets, mode: str, update: WeightUpdate,
                 groups: Groups) -> tuple[int, str | None]:
    """Write the update into this rank's views (`mode`: the active layout) once every rank holds its tensors.
    Returns (views written, None), or (0, why) when some rank could not reach them (then no rank wrote)."""
    source: Checkpoint | Mapping[str, torch.Tensor] | None = None
    error = None
    try:
        source = _source(update)
    except (OSError, ValueError, RuntimeError) as e:  # a segment this rank cannot map (another machine?)
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
    return write_update(umm, specs, source, targets.dtype), None
