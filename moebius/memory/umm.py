"""The unified memory manager: one device buffer per rank, every long-lived tensor a view at a fixed offset.

Planning and allocation are separate: the engine first declares every region (`MemoryPlan.add`, `add_slots`), then
`UnifiedMemory` allocates the buffer once and hands out views. N layers get N + 1 layer slots (or more:
`parallel.layout.slot_shifts`); a slot holds one layer's expert weights and that layer's KV pages. Nothing long-lived is
allocated afterwards, so the buffer address and every view's data_ptr() stay fixed for the life of the process (CUDA
graphs rely on it).

Memory release (colocated RL training): the plan tags its bytes `weights` or `kv_cache`; `release(tags)` gives the
physical memory under them back while keeping the virtual range, and `resume(tags)` maps fresh memory at the same
addresses (restoring the weights from a host copy when asked to keep them), so every view and captured graph stays
valid. On the GPU the buffer is a CUDA virtual-memory reservation with physical memory mapped in segments
(`cuda.bindings`, CUDA's driver API; torch's own allocator without it, and then no release); on the CPU an anonymous
mapping whose pages `madvise(MADV_DONTNEED)` drops.
"""

from __future__ import annotations

import mmap
import time
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

ALIGN = 256  # bytes; keeps every view aligned for vectorised loads
TAGS = ("weights", "kv_cache")  # what release_memory_occupation names (SGLang's and vLLM's tags)


def _round_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class Region:
    name: str
    offset: int
    nbytes: int


@dataclass
class MemoryPlan:
    """Byte layout of the buffer: named regions followed by the layer slots (`slots`: each one's offset and bytes;
    a slot's parts, its experts and its KV pages, may differ in size from another's). A region or a part of a slot
    may carry a tag (`TAGS`): the bytes a release of that tag gives back."""

    regions: dict[str, Region] = field(default_factory=dict)
    end: int = 0
    slots: list[Region] = field(default_factory=list)
    tagged: list[tuple[int, int, str]] = field(default_factory=list)  # (offset, nbytes, tag)

    def add(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, tag: str | None = None) -> Region:
        if name in self.regions:
            raise ValueError(f"region {name!r} planned twice")
        if self.slots:
            raise ValueError("regions must be planned before the layer slots")
        nbytes = _nbytes(shape, dtype)
        region = Region(name, self.end, nbytes)
        self.regions[name] = region
        if tag is not None:
            self.tagged.append((region.offset, _round_up(nbytes), _check_tag(tag)))
        self.end = _round_up(self.end + nbytes)
        return region

    def add_slots(self, slots: Sequence[Sequence[tuple[str | None, int]]]) -> None:
        """One layer slot for each entry: its parts, (tag or None, bytes) from its start, in order."""
        if self.slots:
            raise ValueError("the layer slots are planned once")
        for s, parts in enumerate(slots):
            at = self.end
            for tag, nbytes in parts:
                if tag is not None:
                    self.tagged.append((at, nbytes, _check_tag(tag)))
                at += nbytes
            self.slots.append(Region(f"slot {s}", self.end, at - self.end))
            self.end = _round_up(at)

    @property
    def num_slots(self) -> int:
        return len(self.slots)

    @property
    def total_bytes(self) -> int:
        return self.end

    def segments(self, granularity: int) -> list[tuple[int, int, str | None]]:
        """The buffer (rounded up to `granularity`) cut into runs of whole granules: (offset, nbytes, tag), the tag
        where every byte of the run has it, None for the rest (granules that hold untagged bytes or two tags stay
        mapped through any release)."""
        total = _round_up(self.total_bytes, granularity)
        n = total // granularity
        of: list[str | None] = [None] * n
        for a, b, tag in _merged(self.tagged):
            for g in range(-(-a // granularity), min(b // granularity, n)):
                of[g] = tag
        out: list[tuple[int, int, str | None]] = []
        for g, tag in enumerate(of):
            if out and out[-1][2] == tag:
                a, nb, _ = out[-1]
                out[-1] = (a, nb + granularity, tag)
            else:
                out.append((g * granularity, granularity, tag))
        return out


def _check_tag(tag: str) -> str:
    if tag not in TAGS:
        raise ValueError(f"memory tag {tag!r} is not one of {', '.join(TAGS)}")
    return tag


def _merged(tagged: list[tuple[int, int, str]]) -> list[tuple[int, int, str]]:
    """Tagged ranges as (start, end, tag), adjacent ranges of one tag joined."""
    out: list[tuple[int, int, str]] = []
    for a, nb, tag in sorted(tagged):
        if out and out[-1][2] == tag and out[-1][1] >= a:
            out[-1] = (out[-1][0], max(out[-1][1], a + nb), tag)
        else:
            out.append((a, a + nb, tag))
    return out


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = 1
    for s in shape:
        n *= s
    return n * dtype.itemsize


@dataclass
class ReleaseStats:
    """What a release or resume did on a rank: the bytes given back (or mapped again), those copied to or from the
    host, and the seconds it took."""

    nbytes: int = 0
    host_bytes: int = 0
    seconds: float = 0.0


class UnifiedMemory:
    """Owns the one buffer of a rank; hands out typed views of planned regions and slot ranges."""

    def __init__(self, plan: MemoryPlan, device: torch.device) -> None:
        self.plan = plan
        self.device = device
        self.backing = _backing(plan, device)
        self.buffer = self.backing.tensor
        self.base_ptr = self.buffer.data_ptr()
        self._unmapped: dict[int, str] = {}  # offset -> tag of every segment released now
        self._host: dict[int, torch.Tensor] = {}  # segment offset -> its host copy's memory (kept once pinned)
        self._kept: dict[int, bool] = {}  # segment offset -> its host copy holds the bytes released

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
        region = self.plan.slots[slot]
        return self._view(region.offset + offset, shape, dtype, region.nbytes - offset)

    def releasable_bytes(self, tags: Iterable[str] = TAGS) -> int:
        """The bytes a release of `tags` gives back (whole granules of one tag: the rest stays mapped)."""
        want = set(tags)
        return sum(nb for _, nb, tag in self.backing.segments if tag in want)

    @property
    def released(self) -> set[str]:
        """The tags with memory released now."""
        return set(self._unmapped.values())

    def release(self, tags: Iterable[str], keep_weights: bool = True) -> ReleaseStats:
        """Give back the physical memory under `tags` (what is released already stays so), keeping every address.
        Weights are first copied to the host when `keep_weights` (resume restores them), else dropped (zeros after
        resume, until an update writes them). The caller makes sure nothing touches these bytes until `resume`; a
        release that failed midway leaves what it did released (resume undoes it)."""
        if not self.backing.can_release:
            raise RuntimeError(f"releasing memory on {self.device} needs CUDA's virtual memory management through "
                               "cuda-python (pip install cuda-python): this buffer came from torch's allocator")
        want = {_check_tag(t) for t in tags}
        todo = [(a, nb, tag) for a, nb, tag in self.backing.segments if tag in want and a not in self._unmapped]
        t0, stats = time.perf_counter(), ReleaseStats()
        self.backing.synchronize()  # the steps before are done with these bytes
        if not keep_weights:
            self.drop_host_copies()
        kept = [(a, nb) for a, nb, tag in todo if tag == "weights" and keep_weights]
        for a, nb in kept:
            host = self._host.get(a)
            if host is None:  # pinned once, then kept for the next release (pinning is the slow part)
                self._host[a] = host = self.backing.host_buffer(nb)
            host.copy_(self.buffer[a: a + nb], non_blocking=True)
            self._kept[a] = True
            stats.host_bytes += nb
        self.backing.synchronize()
        for a, nb, tag in todo:
            self.backing.unmap(a, nb)
            self._unmapped[a] = tag
            stats.nbytes += nb
        stats.seconds = time.perf_counter() - t0
        return stats

    def resume(self, tags: Iterable[str]) -> ReleaseStats:
        """Map memory again under the released `tags` at the same addresses: kept weights copied back, every other
        byte zeros (as at start: no NaN bit patterns in pages never written since)."""
        want = {_check_tag(t) for t in tags}
        todo = [(a, nb) for a, nb, tag in self.backing.segments if tag in want and a in self._unmapped]
        t0, stats = time.perf_counter(), ReleaseStats()
        for a, nb in todo:
            self.backing.map(a, nb)
            del self._unmapped[a]
            host = self._host.get(a) if self._kept.pop(a, False) else None
            if host is not None:
                self.buffer[a: a + nb].copy_(host, non_blocking=True)
                stats.host_bytes += nb
            elif not self.backing.maps_zeros:
                self.buffer[a: a + nb].zero_()
            stats.nbytes += nb
        self.backing.synchronize()
        stats.seconds = time.perf_counter() - t0
        return stats

    @property
    def host_copy_bytes(self) -> int:
        """Host memory held for the weights' copies (kept after a resume, for the next release)."""
        return sum(h.numel() for h in self._host.values())

    def drop_host_copies(self) -> None:
        """Free the host memory of the weights' copies (a release that drops the weights, or the caller's call)."""
        for a in [a for a in self._host if not self._kept.get(a)]:  # (never the copy of weights still released)
            del self._host[a]  # (a pinned one is unregistered as it goes: _unregister)


def _backing(plan: MemoryPlan, device: torch.device) -> _HostBacking | _TorchBacking | _DeviceBacking:
    try:
        if device.type == "cpu":
            return _HostBacking(plan)
        if device.type == "cuda" and _driver() is not None:
            return _DeviceBacking(plan, device)
        return _TorchBacking(plan, device)
    except (RuntimeError, MemoryError, OSError, OverflowError) as e:  # torch.OutOfMemoryError, mmap's ENOMEM, ...
        raise MemoryError(f"could not allocate the unified buffer of {plan.total_bytes / 2**30:.2f} GiB "
                          f"({plan.num_slots} layer slots of {sum(r.nbytes for r in plan.slots) / 2**30:.3f} GiB "
                          f"in all) on {device}: "
                          f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


class _HostBacking:
    """The CPU buffer: an anonymous private mapping (zeros until written); a released range's pages are dropped with
    madvise(MADV_DONTNEED) and come back as zero pages when touched."""

    can_release = hasattr(mmap, "MADV_DONTNEED")
    maps_zeros = True  # (zeroing them would only make the pages resident again)

    def __init__(self, plan: MemoryPlan) -> None:
        # private: a shared mapping's pages live on in shmem after MADV_DONTNEED (only the page tables go)
        self.map_ = mmap.mmap(-1, _round_up(max(plan.total_bytes, 1), mmap.PAGESIZE),
                              flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.tensor = torch.frombuffer(self.map_, dtype=torch.uint8)[: plan.total_bytes]
        self.segments = plan.segments(mmap.PAGESIZE)

    def synchronize(self) -> None:
        pass

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def unmap(self, offset: int, nbytes: int) -> None:
        self.map_.madvise(mmap.MADV_DONTNEED, offset, nbytes)

    def map(self, offset: int, nbytes: int) -> None:
        pass  # the next touch maps a zero page


class _TorchBacking:
    """A GPU buffer from torch's caching allocator (no cuda-python): it cannot be released."""

    can_release = False
    maps_zeros = False

    def __init__(self, plan: MemoryPlan, device: torch.device) -> None:
        self.tensor = torch.zeros(plan.total_bytes, dtype=torch.uint8, device=device)
        self.segments: list[tuple[int, int, str | None]] = []

    def synchronize(self) -> None:
        pass


def _driver() -> Any:
    """CUDA's driver API through cuda-python, or None where it is not installed."""
    try:
        from cuda.bindings import driver
    except ImportError:
        return None
    return driver


def _check(result: Any, what: str) -> Any:
    """A cuda-python call's (error, *values): the values, or an error naming the call."""
    err, *values = result if isinstance(result, tuple) else (result,)
    drv = _driver()
    if err != drv.CUresult.CUDA_SUCCESS:
        _, name = drv.cuGetErrorName(err)
        oom = err == drv.CUresult.CUDA_ERROR_OUT_OF_MEMORY
        raise (MemoryError if oom else RuntimeError)(f"{what} failed: {name.decode() if name else err}")
    return None if not values else values[0] if len(values) == 1 else tuple(values)


class _VirtualRange:
    """A reserved range of device addresses with physical memory mapped in segments (the handles by offset), seen by
    torch through the CUDA array interface; the range is freed when the last tensor over it goes."""

    def __init__(self, device: torch.device, total: int, granularity: int, prop: Any) -> None:
        drv = _driver()
        self.device, self.total, self.prop = device, total, prop
        self.ptr = int(_check(drv.cuMemAddressReserve(total, granularity, 0, 0), "cuMemAddressReserve"))
        self.handles: dict[int, Any] = {}
        self._finalizer = weakref.finalize(self, _free_range, self.ptr, total, self.handles)

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {"shape": (self.total,), "typestr": "|u1", "data": (self.ptr, False), "version": 3}

    def map(self, offset: int, nbytes: int) -> None:
        drv = _driver()
        handle = _check(drv.cuMemCreate(nbytes, self.prop, 0), f"cuMemCreate of {nbytes / 2**30:.2f} GiB")
        try:
            at = drv.CUdeviceptr(self.ptr + offset)
            _check(drv.cuMemMap(at, nbytes, 0, handle, 0), "cuMemMap")
        except BaseException:
            drv.cuMemRelease(handle)
            raise
        access = drv.CUmemAccessDesc()
        access.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = self.device.index
        access.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        _check(drv.cuMemSetAccess(at, nbytes, [access], 1), "cuMemSetAccess")
        self.handles[offset] = (handle, nbytes)

    def unmap(self, offset: int, nbytes: int) -> None:
        drv = _driver()
        handle, mapped = self.handles.pop(offset)
        assert mapped == nbytes, (offset, mapped, nbytes)
        _check(drv.cuMemUnmap(drv.CUdeviceptr(self.ptr + offset), nbytes), "cuMemUnmap")
        _check(drv.cuMemRelease(handle), "cuMemRelease")


def _free_range(ptr: int, total: int, handles: dict[int, Any]) -> None:
    drv = _driver()
    for offset, (handle, nbytes) in handles.items():
        drv.cuMemUnmap(drv.CUdeviceptr(ptr + offset), nbytes)
        drv.cuMemRelease(handle)
    handles.clear()
    drv.cuMemAddressFree(drv.CUdeviceptr(ptr), total)


class _DeviceBacking:
    """The GPU buffer in CUDA virtual memory: one reservation, physical memory mapped segment by segment, so a
    tag's segments can be unmapped and mapped again at the same addresses. The host copies of released weights are
    pinned (page-locked in place, so a 60 GB copy is not rounded up by torch's pinned-memory cache)."""

    can_release = True
    maps_zeros = False  # (cuMemCreate's memory holds whatever was there)

    def __init__(self, plan: MemoryPlan, device: torch.device) -> None:
        drv = _driver()
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.synchronize(device)  # the device's primary context current on this thread for the driver calls
        prop = drv.CUmemAllocationProp()
        prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = device.index
        granularity = int(_check(drv.cuMemGetAllocationGranularity(
            prop, drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
            "cuMemGetAllocationGranularity"))
        self.device = device
        self.segments = plan.segments(granularity)
        # (the tensor keeps the range too: it is freed with the last view, whichever goes last)
        self.vrange = _VirtualRange(device, _round_up(plan.total_bytes, granularity), granularity, prop)
        for a, nb, _ in self.segments:
            self.vrange.map(a, nb)
        self.tensor = torch.as_tensor(self.vrange, device=device)[: plan.total_bytes]
        self.tensor.zero_()

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        # huge pages where the kernel gives them: page-locking is what a first release waits on, and 4 KiB pages
        # lock at half the rate (benchmarks/results/h200-pinned-host.json)
        anon = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            anon.madvise(mmap.MADV_HUGEPAGE)
        host = torch.frombuffer(anon, dtype=torch.uint8)
        _check(_driver().cuMemHostRegister(host.data_ptr(), nbytes, 0),
               f"page-locking {nbytes / 2**30:.2f} GiB of host memory for the weights")
        weakref.finalize(host, _unregister, host.data_ptr())  # (before its pages go with the last reference)
        return host

    def unmap(self, offset: int, nbytes: int) -> None:
        self.vrange.unmap(offset, nbytes)

    def map(self, offset: int, nbytes: int) -> None:
        self.vrange.map(offset, nbytes)


def _unregister(ptr: int) -> None:
    _driver().cuMemHostUnregister(ptr)
