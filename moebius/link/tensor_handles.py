"""Named tensors by handle, in a plain JSON-safe description another process of the same machine opens without a
copy: CUDA tensors by their CUDA IPC handle (the fields torch's `UntypedStorage._share_cuda_()` gives, rebuilt with
`UntypedStorage._new_shared_cuda` as torch/multiprocessing/reductions.py does, but from JSON: nothing is pickled),
CPU tensors copied once into a POSIX shared-memory segment and read where they lie.

This file imports only torch and the standard library, so a trainer process with nothing else installed can use it
(copy the file, or `from moebius.link.tensor_handles import export_tensors` where Moebius is installed):

    with export_tensors(model.named_parameters()) as description:   # the tensors stay alive until the block ends
        httpx.post(f"{url}/update_weights_from_tensor", json={"named_tensors": description})

The description (format FORMAT):
    {"format": "moebius.tensors.v1", "host": <the exporter's hostname>, "segment": <shared-memory name> | null,
     "storages": [{"gpu_uuid", "device", "handle", "storage_size", "storage_offset_bytes", "ref_counter",
                   "ref_counter_offset", "event_handle", "event_sync_required"}, ...],   (CUDA storages, once each)
     "tensors": [{"name", "dtype" (torch's name: "bfloat16"), "shape", and either
                  "offset" (bytes into the segment: a contiguous CPU tensor) or
                  "cuda": {"storage" (an index into storages), "stride", "storage_offset"}}, ...]}
The byte strings (handle, ref_counter, event_handle) are base64; `stride` and `storage_offset` are in elements.
The exporter must keep its tensors (and the segment) until the update call has returned: the engine reads them in
place.
"""

from __future__ import annotations

import base64
import binascii
import os
import re
import socket
from collections.abc import Iterable, Mapping
from multiprocessing import shared_memory
from typing import Any

import torch

FORMAT = "moebius.tensors.v1"
SHM_DIR = "/dev/shm"  # where Linux keeps POSIX shared-memory segments (a RAM file system)
ALIGN = 64  # bytes: every tensor in a segment starts at an offset its dtype (and vectorised copies) can read from
# one exported CUDA storage: what torch's _share_cuda_() gives (bytes in base64), and the GPU's UUID
STORAGE_FIELDS = {"gpu_uuid": str, "device": int, "handle": str, "storage_size": int, "storage_offset_bytes": int,
                  "ref_counter": str, "ref_counter_offset": int, "event_handle": str, "event_sync_required": bool}
# a segment's name as Python's shared_memory makes them: never a path (a description may come from the network)
_SEGMENT = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,254}")


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(where: str, text: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{where} is not base64: {text[:40]!r}") from None


def gpu_uuid(device: int) -> str:
    """The GPU's UUID: the same in every process whatever CUDA_VISIBLE_DEVICES numbers it."""
    return str(torch.cuda.get_device_properties(device).uuid)


class TensorExport:
    """Named tensors exported by handle (`export_tensors`): `description` is the plain JSON-safe dict to send; the
    tensors and the shared-memory segment stay alive until `close()` (or the end of a `with` block), which unlinks
    the segment. Keep it open until the engine has answered the update."""

    def __init__(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]) -> None:
        if isinstance(named_tensors, Mapping):
            named_tensors = named_tensors.items()
        items = [(name, t.detach()) for name, t in named_tensors]
        self._keep: list[torch.Tensor] = []  # what the handles point into, until close()
        self._segment: shared_memory.SharedMemory | None = None
        seen: set[str] = set()
        for name, t in items:  # (before a segment exists that a refusal would leave behind)
            if name in seen:
                raise ValueError(f"tensor {name} is given twice")
            seen.add(name)
            if t.device.type not in ("cpu", "cuda"):
                raise ValueError(f"tensor {name} is on {t.device}: only CPU and CUDA tensors can be exported")
            if t.device.type == "cuda" and t.untyped_storage().nbytes() == 0:
                raise ValueError(f"tensor {name} is empty: a CUDA IPC handle needs memory to point at")
        host = [(n, t) for n, t in items if t.device.type == "cpu"]
        offsets, end = {}, 0
        for name, t in host:
            offsets[name] = end
            end += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
        try:
            if host:
                self._segment = shared_memory.SharedMemory(create=True, size=max(end, 1))
                self._segment.close()  # (Python's own mapping: the bytes are written through torch's)
                buf = map_segment(self._segment.name, end)
                for name, t in host:
                    n = t.numel() * t.element_size()
                    buf[offsets[name]: offsets[name] + n].view(t.dtype).view(t.shape).copy_(t)
            self.description = self._describe(items, offsets)
        except BaseException:
            self.close()
            raise

    def _describe(self, items: list[tuple[str, torch.Tensor]], offsets: dict[str, int]) -> dict[str, Any]:
        entries: list[dict[str, Any]] = []
        storages: list[dict[str, Any]] = []
        index: dict[tuple[int, int], int] = {}  # one _share_cuda_ a storage (views of one bucket share it)
        for name, t in items:
            entry: dict[str, Any] = {"name": name, "dtype": str(t.dtype).removeprefix("torch."),
                                     "shape": list(t.shape)}
            if t.device.type == "cpu":
                entry["offset"] = offsets[name]
            else:
                storage = t.untyped_storage()
                key = (storage.data_ptr(), storage.nbytes())
                if key not in index:
                    (device, handle, size, offset_bytes, ref_counter, ref_counter_offset, event_handle,
                     event_sync) = storage._share_cuda_()
                    index[key] = len(storages)
                    storages.append({"gpu_uuid": gpu_uuid(device), "device": device, "handle": _b64(handle),
                                     "storage_size": size, "storage_offset_bytes": offset_bytes,
                                     "ref_counter": _b64(ref_counter), "ref_counter_offset": ref_counter_offset,
                                     "event_handle": _b64(event_handle), "event_sync_required": bool(event_sync)})
                entry["cuda"] = {"storage": index[key], "stride": list(t.stride()),
                                 "storage_offset": t.storage_offset()}
                self._keep.append(t)
            entries.append(entry)
        return {"format": FORMAT, "host": socket.gethostname(),
                "segment": self._segment.name if self._segment is not None else None, "storages": storages,
                "tensors": entries}

    def close(self) -> None:
        """Drop the tensors and unlink the segment (the engine must be done with them)."""
        self._keep = []
        if self._segment is not None:
            try:
                self._segment.unlink()
            except FileNotFoundError:
                pass
            self._segment = None

    def __enter__(self) -> dict[str, Any]:
        return self.description

    def __exit__(self, *exc: object) -> None:
        self.close()


def export_tensors(named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]) -> TensorExport:
    """Export `(name, tensor)` pairs for another process of this machine: CUDA tensors by IPC handle (no copy; keep
    them unchanged until the update is done), CPU ones copied into one new shared-memory segment. Use it as a
    context manager (`with export_tensors(...) as description:`) or call `close()` once the engine answered."""
    return TensorExport(named_tensors)


def check_description(description: Any) -> dict[str, Any]:
    """The description checked field by field (ValueError naming the first bad one); nothing is opened."""
    if not isinstance(description, Mapping):
        raise ValueError(f"a tensor description is a JSON object, got {type(description).__name__}")
    if description.get("format") != FORMAT:
        raise ValueError(f"format must be {FORMAT!r}, got {description.get('format')!r}")
    host, segment, tensors = description.get("host"), description.get("segment"), description.get("tensors")
    storages = description.get("storages", [])
    if not isinstance(host, str) or not host:
        raise ValueError(f"host must be the exporter's hostname, got {host!r}")
    if segment is not None and not (isinstance(segment, str) and _SEGMENT.fullmatch(segment)):
        raise ValueError(f"segment must be a shared-memory name (letters, digits, '_', '.', '-'), got {segment!r}")
    if not isinstance(tensors, list) or not tensors:
        raise ValueError(f"tensors must be a non-empty list, got {type(tensors).__name__}")
    if not isinstance(storages, list):
        raise ValueError(f"storages must be a list, got {type(storages).__name__}")
    for k, st in enumerate(storages):
        if not isinstance(st, Mapping):
            raise ValueError(f"storages[{k}] must be an object, got {type(st).__name__}")
        for field, kind in STORAGE_FIELDS.items():
            value = st.get(field)
            if not (_int(value) if kind is int else isinstance(value, kind)):
                raise ValueError(f"storages[{k}].{field} must be {kind.__name__}, got {value!r}")
        for field in ("handle", "ref_counter", "event_handle"):
            _unb64(f"storages[{k}].{field}", st[field])
    names = set()
    for k, t in enumerate(tensors):
        where = f"tensors[{k}]"
        if not isinstance(t, Mapping):
            raise ValueError(f"{where} must be an object, got {type(t).__name__}")
        name = t.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"{where}.name must be a non-empty string, got {name!r}")
        if name in names:
            raise ValueError(f"tensor {name} is given twice")
        names.add(name)
        where = f"tensor {name}"
        dtype = t.get("dtype")
        if not (isinstance(dtype, str) and isinstance(getattr(torch, dtype, None), torch.dtype)):
            raise ValueError(f"{where}: dtype must be a torch dtype name such as 'bfloat16', got {dtype!r}")
        shape = t.get("shape")
        if not _ints(shape):
            raise ValueError(f"{where}: shape must be a list of non-negative integers, got {shape!r}")
        if ("cuda" in t) == ("offset" in t):
            raise ValueError(f"{where} needs exactly one of 'offset' (in the segment) and 'cuda' (an IPC handle)")
        if "offset" in t:
            offset = t["offset"]
            if segment is None:
                raise ValueError(f"{where} lies in the segment, but the description names none")
            if not (_int(offset) and offset % getattr(torch, dtype).itemsize == 0):
                raise ValueError(f"{where}: offset must be a non-negative multiple of its element size, got "
                                 f"{offset!r}")
            continue
        cuda = t["cuda"]
        if not isinstance(cuda, Mapping):
            raise ValueError(f"{where}: cuda must be an object, got {type(cuda).__name__}")
        k = cuda.get("storage")
        if not (_int(k) and k < len(storages)):
            raise ValueError(f"{where}: cuda.storage must index storages (of {len(storages)}), got {k!r}")
        stride, offset = cuda.get("stride"), cuda.get("storage_offset")
        if not (_ints(stride) and len(stride) == len(shape)):
            raise ValueError(f"{where}: cuda.stride must be a list of integers, one a dimension, got {stride!r}")
        if not _int(offset):
            raise ValueError(f"{where}: cuda.storage_offset must be a non-negative integer, got {offset!r}")
        size = storages[k]["storage_size"]
        last = offset + sum((n - 1) * st for n, st in zip(shape, stride, strict=True))
        if 0 not in shape and (last + 1) * getattr(torch, dtype).itemsize > size:
            raise ValueError(f"{where}: shape {shape}, stride {stride} and storage_offset {offset} reach past its "
                             f"storage of {size} bytes")
    return {**description, "storages": storages}


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _ints(v: Any) -> bool:
    return isinstance(v, list) and all(_int(x) for x in v)


def map_segment(segment: str, nbytes: int) -> torch.Tensor:
    """The segment as bytes, mapped shared (its tensors are views; the mapping goes with the last of them);
    FileNotFoundError where this machine has no such segment, ValueError where it is shorter than `nbytes`."""
    path = os.path.join(SHM_DIR, segment)
    # (torch.from_file would create a missing file, or extend a short one, with zeros: weights of nothing)
    size = os.stat(path).st_size
    if size < nbytes:
        raise ValueError(f"shared-memory segment {segment} holds {size} bytes, fewer than the {nbytes} of its tensors")
    return torch.from_file(path, shared=True, size=max(nbytes, 1), dtype=torch.uint8)  # (segments hold >= 1 byte)


def segment_end(tensors: list[Mapping[str, Any]]) -> int:
    """The bytes the segment must hold for the tensors that lie in it."""
    return max((t["offset"] + torch.Size(t["shape"]).numel() * getattr(torch, t["dtype"]).itemsize
                for t in tensors if "offset" in t), default=0)


def check_segment(description: Mapping[str, Any]) -> None:
    """ValueError unless the checked description's segment exists on this machine and holds its tensors."""
    tensors = description["tensors"]
    if description["segment"] is None or not any("offset" in t for t in tensors):
        return
    try:
        map_segment(description["segment"], segment_end(tensors))
    except FileNotFoundError:
        raise ValueError(f"no shared-memory segment {description['segment']} on {socket.gethostname()}: the "
                         "exporter must keep it until the update is done, on this machine") from None


def _local_device(uuid: str, name: str) -> int:
    """This process's index of the GPU with this UUID; RuntimeError naming why when it sees no such GPU."""
    if not torch.cuda.is_available():
        raise RuntimeError(f"tensor {name} is a CUDA tensor (IPC handle of GPU {uuid}) but this process sees no GPU")
    for i in range(torch.cuda.device_count()):
        if gpu_uuid(i) == uuid:
            return i
    raise RuntimeError(f"tensor {name} lies on GPU {uuid}, which this process does not see (CUDA_VISIBLE_DEVICES="
                       f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}): a CUDA IPC handle opens on the GPUs of this "
                       "machine this process can use")


class CudaOpener:
    """Rebuilds CUDA tensors from their IPC fields (checked by `check_description`), one storage a handle and
    offset (two tensors of one exported storage share it here too). `synchronize()` once the tensors are read:
    the exporter may change them as soon as the update returns, and a reader's copies run asynchronously."""

    def __init__(self, host: str) -> None:
        if host != socket.gethostname():
            raise RuntimeError(f"the tensors were exported on host {host!r} and this process runs on "
                               f"{socket.gethostname()!r}: CUDA IPC handles and shared memory reach processes of "
                               "one machine only")
        self._storages: dict[tuple[str, int], torch.UntypedStorage] = {}
        self.devices: set[int] = set()

    def open(self, name: str, dtype: str, shape: list[int], cuda: Mapping[str, Any],
             storage_fields: Mapping[str, Any]) -> torch.Tensor:
        st = storage_fields
        device = _local_device(st["gpu_uuid"], name)
        key = (st["handle"], st["storage_offset_bytes"])
        storage = self._storages.get(key)
        if storage is None:
            torch.cuda._lazy_init()
            try:  # (the same call as torch.multiprocessing.reductions.rebuild_cuda_tensor, its fields from JSON)
                storage = torch.UntypedStorage._new_shared_cuda(
                    device, _unb64("handle", st["handle"]), st["storage_size"], st["storage_offset_bytes"],
                    _unb64("ref_counter", st["ref_counter"]), st["ref_counter_offset"],
                    _unb64("event_handle", st["event_handle"]), st["event_sync_required"])
            except RuntimeError as e:
                raise RuntimeError(f"tensor {name}: the CUDA IPC handle of GPU {st['gpu_uuid']} (cuda:{device} "
                                   f"here) could not be opened: {e}") from None
            self._storages[key] = storage
            self.devices.add(device)
        t = torch.empty(0, dtype=getattr(torch, dtype), device=f"cuda:{device}")
        return t.set_(storage, cuda["storage_offset"], shape, cuda["stride"])

    def synchronize(self, *more: torch.device) -> None:
        """Wait until this process's work on the exported tensors' GPUs (and `more`) is done."""
        for d in sorted(self.devices | {m.index or 0 for m in more if m.type == "cuda"}):
            torch.cuda.synchronize(d)


def open_tensors(description: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], CudaOpener]:
    """The described tensors by name, where they lie (views of the segment, CUDA tensors opened by handle), after
    `check_description`; with the opener, whose `synchronize()` the reader calls once it has read them."""
    description = check_description(description)
    opener = CudaOpener(description["host"])
    tensors = description["tensors"]
    out: dict[str, torch.Tensor] = {}
    if description["segment"] is not None and any("offset" in t for t in tensors):
        buf = map_segment(description["segment"], segment_end(tensors))
    for t in tensors:
        if "cuda" in t:
            out[t["name"]] = opener.open(t["name"], t["dtype"], t["shape"], t["cuda"],
                                         description["storages"][t["cuda"]["storage"]])
        else:
            dtype = getattr(torch, t["dtype"])
            n = torch.Size(t["shape"]).numel() * dtype.itemsize
            out[t["name"]] = buf[t["offset"]: t["offset"] + n].view(dtype).view(t["shape"])
    return out, opener


