"""The unified memory manager: one device buffer per rank, every long-lived tensor a view at a fixed offset.

Planning and allocation are separate: the engine first declares every region (`MemoryPlan.add`, `add_slots`),
then `UnifiedMemory` allocates the buffer once and hands out views. N layers get N + 1 equal layer slots; a slot
holds one layer's expert weights and that layer's KV pages. Nothing long-lived is allocated afterwards, so the
buffer address and every view's data_ptr() stay fixed for the life of the process (CUDA graphs rely on it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

ALIGN = 256  # bytes; keeps every view aligned for vectorised loads


def _round_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class Region:
    name: str
    offset: int
    nbytes: int


@dataclass
class MemoryPlan:
    """Byte layout of the buffer: named regions followed by `num_slots` layer slots of `slot_bytes` each."""

    regions: dict[str, Region] = field(default_factory=dict)
    end: int = 0
    num_slots: int = 0
    slot_bytes: int = 0
    slots_offset: int = 0

    def add(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> Region:
        if name in self.regions:
            raise ValueError(f"region {name!r} planned twice")
        if self.num_slots:
            raise ValueError("regions must be planned before the layer slots")
        nbytes = _nbytes(shape, dtype)
        region = Region(name, self.end, nbytes)
        self.regions[name] = region
        self.end = _round_up(self.end + nbytes)
        return region

    def add_slots(self, num_slots: int, slot_bytes: int) -> None:
        self.slots_offset = self.end
        self.num_slots = num_slots
        self.slot_bytes = _round_up(slot_bytes)
        self.end = self.slots_offset + self.num_slots * self.slot_bytes

    @property
    def total_bytes(self) -> int:
        return self.end


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = 1
    for s in shape:
        n *= s
    return n * dtype.itemsize


class UnifiedMemory:
    """Owns the one buffer of a rank; hands out typed views of planned regions and slot ranges."""

    def __init__(self, plan: MemoryPlan, device: torch.device) -> None:
        self.plan = plan
        self.device = device
        # Zeroed once: a KV page or a padding row is never read before it is written, but bytes that were never
        # written must not hold NaN bit patterns (0 * NaN in a masked attention sum is NaN).
        try:
            self.buffer = torch.zeros(plan.total_bytes, dtype=torch.uint8, device=device)
        except RuntimeError as e:  # torch.OutOfMemoryError, or the CPU allocator's plain RuntimeError
            raise MemoryError(f"could not allocate the unified buffer of {plan.total_bytes / 2**30:.2f} GiB "
                              f"({plan.num_slots} layer slots of {plan.slot_bytes / 2**30:.3f} GiB) on {device}: "
                              f"{str(e).splitlines()[0]}") from None
        self.base_ptr = self.buffer.data_ptr()

    def _view(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype, limit: int) -> torch.Tensor:
        nbytes = _nbytes(shape, dtype)
        if offset % dtype.itemsize:
            raise ValueError(f"offset {offset} not aligned for {dtype}")
        if nbytes > limit:
            raise ValueError(f"view of {nbytes} bytes does not fit in {limit}")
        return self.buffer[offset: offset + nbytes].view(dtype).view(shape)

    def view(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        region = self.plan.regions[name]
        return self._view(region.offset, shape, dtype, region.nbytes)

    def slot_view(self, slot: int, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A view `offset` bytes into layer slot `slot`."""
        if not 0 <= slot < self.plan.num_slots:
            raise IndexError(f"slot {slot} out of range (have {self.plan.num_slots})")
        base = self.plan.slots_offset + slot * self.plan.slot_bytes
        return self._view(base + offset, shape, dtype, self.plan.slot_bytes - offset)
