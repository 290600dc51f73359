"""Fill a layout's weight views: from a local safetensors checkpoint (single file or sharded), or dummy weights;
and rewrite some of them in a running engine (`check_update` at the front end, `write_update` on each rank).

A checkpoint's files are checked when it is opened (each header read and its byte ranges matched against the file's
size), and `check_checkpoint` checks, before any rank is built, that every tensor the weight specs read is there, of
its shape and stored as floating point; the tensors no spec reads are listed in one warning.

A quantized checkpoint (config.json's quantization_config) of a method its family reads (the family's `packings`:
one `Packing` a quant_method, e.g. GPT-OSS's MXFP4) serves each float tensor it packs by name, dequantized from its
stored pieces to the engine's dtype; the checks take the pieces for the name they stand for, and so does an update.
"""

from __future__ import annotations

import difflib
import glob
import json
import logging
import os
import re
import zlib
from collections.abc import Container, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from moebius.config import ConfigError, ModelConfig
from moebius.layers.rotary import rope_table
from moebius.memory.umm import UnifiedMemory
from moebius.models.fp8_blocks import SCALE
from moebius.models.registry import FAMILIES, family_for, family_of
from moebius.models.specs import Packing, ParamSpec, expert_names, fused_name, per_expert_names, spec_view
from moebius.parallel.layout import Layout

log = logging.getLogger("moebius")

INDEX = "model.safetensors.index.json"
# Stored dtypes the loader casts to the engine's dtype without changing what a value means; any other (float8,
# packed integers, 4/6-bit floats) holds quantized or packed data a plain cast would misread.
FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")
_MAX_HEADER = 100_000_000  # bytes: the safetensors format's own limit on a header
# safetensors' codes of the dtypes a packing stores its pieces in
_CODES = {torch.uint8: "U8", torch.int8: "I8", torch.int32: "I32", torch.float8_e4m3fn: "F8_E4M3",
          torch.float8_e5m2: "F8_E5M2", torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
_SHOWN = 5  # names a message lists before "and N more"


def _kind(dtype: str) -> str:
    """What a safetensors dtype code holds, in words."""
    if dtype.startswith("F8"):
        return "float8"
    if dtype in ("F4", "F6_E2M3", "F6_E3M2"):
        return "sub-byte float (packed)"
    if dtype[:1] in ("I", "U"):
        return "integer (packed or quantized values)"
    return {"BOOL": "boolean", "C64": "complex"}.get(dtype, "non-float")


def _some(names: list[str]) -> str:
    """The first few names, then how many more."""
    more = len(names) - _SHOWN
    return ", ".join(names[:_SHOWN]) + (f" and {more} more" if more > 0 else "")



def _packing_in(path: str) -> Packing | None:
    """The packing of a checkpoint directory: its config.json's quantization_config method where the family of its
    architectures reads it, else None (a method no family reads is refused at the front end, models/source.py; its
    tensors are then read as stored, and refused as not float)."""
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        return None
    try:
        with open(file, encoding="utf-8") as f:
            hf = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read {file}: {e}") from None
    q = hf.get("quantization_config") if isinstance(hf, dict) else None
    if not isinstance(q, dict):
        return None
    try:
        family = family_for(hf)
    except ConfigError:
        return None
    return family.packings.get(q.get("quant_method"))


@dataclass(frozen=True)
class TensorEntry:
    """One tensor as its file's header lists it."""

    file: str
    dtype: str  # safetensors code: "BF16", "F8_E4M3", "I32", ...
    shape: tuple[int, ...]


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def read_header(file: str) -> dict[str, TensorEntry]:
    """The tensors a safetensors file holds; ConfigError naming the file when it is cut short, padded, or its
    header is not one (the safetensors library would raise only "incomplete metadata" without the file)."""
    try:
        size = os.path.getsize(file)
        with open(file, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ConfigError(f"safetensors file {file!r} is truncated: it holds {size} bytes, fewer than the 8 "
                                  "of the header length every safetensors file starts with")
            n = int.from_bytes(head, "little")
            if n > size - 8 or n > _MAX_HEADER:
                raise ConfigError(f"safetensors file {file!r} is truncated or not a safetensors file: its first 8 "
                                  f"bytes give a header of {n} bytes, but the file holds {size - 8} bytes after them")
            raw = f.read(n)
    except OSError as e:
        raise ConfigError(f"cannot read safetensors file {file!r}: {e.strerror}") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"safetensors file {file!r} has a corrupt header (not JSON: {e}); is the file cut short or "
                          "overwritten?") from None
    if not isinstance(header, dict):
        raise ConfigError(f"safetensors file {file!r} has a corrupt header: a JSON {type(header).__name__}, not an "
                          "object of tensors")
    entries: dict[str, TensorEntry] = {}
    end = 0
    for name, e in header.items():
        if name == "__metadata__":
            continue
        ok = (isinstance(e, dict) and isinstance(e.get("dtype"), str) and isinstance(e.get("shape"), list)
              and all(map(_is_int, e["shape"])) and isinstance(e.get("data_offsets"), list)
              and len(e["data_offsets"]) == 2 and all(map(_is_int, e["data_offsets"]))
              and e["data_offsets"][0] <= e["data_offsets"][1])
        if not ok:
            raise ConfigError(f"safetensors file {file!r} has a corrupt header: the entry of tensor {name} is {e!r}, "
                              "not {dtype, shape, data_offsets}")
        entries[name] = TensorEntry(file, e["dtype"], tuple(e["shape"]))
        end = max(end, e["data_offsets"][1])
    data = size - 8 - n
    if end > data:
        raise ConfigError(f"safetensors file {file!r} is truncated: its header lists {end} bytes of tensor data, the "
                          f"file holds {data} (an interrupted download or copy?)")
    if end < data:
        raise ConfigError(f"safetensors file {file!r} is corrupt: it holds {data} bytes of tensor data where its "
                          f"header lists {end}")
    try:  # what the header check does not cover (overlapping ranges, sizes that disagree with a shape)
        with safe_open(file, framework="pt"):
            pass
    except SafetensorError as e:
        raise ConfigError(f"safetensors file {file!r} is corrupt: {e}") from None
    return entries


def _read_index(index: str) -> dict[str, str]:
    """The weight map of a sharded checkpoint's index, or ConfigError naming the file and what is wrong."""
    try:
        with open(index, encoding="utf-8") as f:
            doc = json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{index} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read {index}: {e}") from None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ConfigError(f"{index} has no \"weight_map\" object of tensor name -> file name")
    return weight_map


class Checkpoint:
    """Lazy access to the tensors of a Hugging Face safetensors checkpoint directory (every file's header checked
    when it is opened)."""

    def __init__(self, path: str) -> None:
        self.path = path
        index = os.path.join(path, INDEX)
        self._where: dict[str, TensorEntry] = {}
        if os.path.isfile(index):
            weight_map = _read_index(index)
            headers: dict[str, dict[str, TensorEntry]] = {}
            for shard in sorted(set(weight_map.values())):
                file = os.path.join(path, shard)
                if not os.path.isfile(file):
                    held = sorted(k for k, v in weight_map.items() if v == shard)
                    raise ConfigError(f"checkpoint file {file!r} is missing: {INDEX} puts {_some(held)} in it")
                headers[shard] = read_header(file)
            for name, shard in weight_map.items():
                if name not in headers[shard]:
                    raise ConfigError(f"{index} puts tensor {name} in {shard!r}, which holds no tensor of that name")
                self._where[name] = headers[shard][name]
        else:
            files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
            if not files:
                raise ConfigError(f"no *.safetensors files in {path!r} (use --load-format dummy for random weights)")
            for file in files:
                for name, entry in read_header(file).items():
                    if name in self._where:  # which copy counts is a guess: refuse it
                        raise ConfigError(f"tensor {name} is in both {self._where[name].file!r} and {file!r}; keep "
                                          f"one copy (or add {INDEX} naming the file to read)")
                    self._where[name] = entry
        self._open: dict[str, Any] = {}
        self.packing = _packing_in(path)

    def __contains__(self, name: str) -> bool:
        return name in self._where or self.packed(name) is not None

    def packed(self, name: str) -> tuple[str, ...] | None:
        """The stored pieces float tensor `name` is read from, where the checkpoint's packing packs it and any of
        them is stored, or the name itself in no float dtype (else None: a module the quantizer left out,
        modules_to_not_convert, is stored as it is)."""
        pieces = None if self.packing is None else self.packing.pieces(name)
        if pieces is None:
            return None
        # (a piece may be the name itself, FP8's weight beside its scales: the others say whether it is packed, or
        # its own dtype, no float one, where they are missing, so that the missing piece is named)
        own = self._where.get(name) if name in pieces else None
        others = any(p in self._where for p in pieces if p != name)
        return pieces if others or (own is not None and own.dtype not in FLOAT_DTYPES) else None

    def packed_entries(self, name: str, shape: tuple[int, ...]) -> list[TensorEntry]:
        """The header entries of the pieces `name` (a float tensor of `shape`) is packed in, each checked against
        the shape and dtype its packing stores: KeyError naming a missing piece (and what it is part of),
        ConfigError naming a piece of the wrong shape or dtype."""
        pieces, packing = self.packed(name), self.packing
        assert pieces is not None and packing is not None
        what = f"the {packing.method} pieces ({', '.join(pieces)}) of {name}, {tuple(shape)}"
        try:
            want = packing.stored(tuple(shape))
        except ValueError as e:
            raise ConfigError(f"checkpoint {self.path!r} stores {what}: {e}") from None
        entries = []
        for piece, (pshape, dtype) in zip(pieces, want, strict=True):
            e = self._where.get(piece)
            if e is None:
                raise KeyError(f"{piece} (one of {what})")
            if e.dtype != _CODES[dtype]:
                raise ConfigError(f"tensor {piece} in {e.file!r} is stored as {e.dtype}, expected {_CODES[dtype]} "
                                  f"({what})")
            if e.shape != pshape:
                raise ConfigError(f"tensor {piece} in {e.file!r} has shape {e.shape}, expected {pshape} ({what})")
            entries.append(e)
        return entries

    @property
    def names(self) -> list[str]:
        return list(self._where)

    def header(self, name: str) -> TensorEntry:
        """The header entry of `name` (KeyError if absent)."""
        return self._where[name]

    def entry(self, name: str, shape: tuple[int, ...]) -> TensorEntry:
        """The header entry of `name`: KeyError if absent, ConfigError naming it if its shape is not `shape`."""
        e = self._where[name]
        if e.shape != tuple(shape):
            raise ConfigError(f"tensor {name} in {e.file!r} has shape {e.shape}, expected {tuple(shape)}")
        return e

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The tensor `name`; KeyError if absent, ConfigError naming it if its shape is wrong or it is not stored as
        floating point (float8 or packed integers would be misread by a cast). A tensor the checkpoint packs comes
        dequantized from its pieces to `dtype` (`packed_entries` names a wrong or missing piece); a stored one as
        it is stored."""
        pieces = self.packed(name)
        if pieces is not None:
            assert self.packing is not None
            entries = self.packed_entries(name, shape)
            return self.packing.unpack([self._read(p, e.file) for p, e in zip(pieces, entries, strict=True)], dtype)
        if self._where[name].dtype not in FLOAT_DTYPES:  # first: a packed tensor's shape is not the weight's either
            raise ConfigError(_dtype_error([name], self._where[name]))
        return self._read(name, self.entry(name, shape).file)

    def _read(self, name: str, file: str) -> torch.Tensor:
        try:
            if file not in self._open:
                self._open[file] = safe_open(file, framework="pt")
            return self._open[file].get_tensor(name)
        except (SafetensorError, OSError) as err:  # changed on disk since it was opened
            raise ConfigError(f"cannot read tensor {name} from {file!r}: {err}") from None


def _dtype_error(names: list[str], first: TensorEntry) -> str:
    return (f"tensor {names[0]} in {first.file!r} is stored as {first.dtype} ({_kind(first.dtype)})"
            + (f", and so are {len(names) - 1} more the model reads ({_some(names[1:])})" if len(names) > 1 else "")
            + f": Moebius reads weights stored as {', '.join(FLOAT_DTYPES)} and would have to reinterpret or cast "
            "it; a quantized checkpoint is read only in a format its family reads, named by its config.json's "
            "quantization_config")


_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def _unsaid(ckpt: Checkpoint, cfg: ModelConfig, name: str) -> str:
    """Why a missing float tensor's pieces, stored in a format the family reads, were not read: no
    quantization_config names the format ("" where none of its pieces is stored)."""
    for packing in family_of(cfg).packings.values():
        pieces = packing.pieces(name)
        if ckpt.packing is None and pieces is not None and any(p in ckpt for p in pieces if p != name):
            return (f" (it stores {', '.join(pieces)}, the {packing.method} pieces of it, but no quantization_config "
                    f"in its config.json names quant_method {packing.method!r})")
    return ""


def check_checkpoint(ckpt: Checkpoint, cfg: ModelConfig, checkpoint_layers: int) -> None:
    """Before any rank is built: every tensor the weight specs read is in `ckpt`, of its shape and stored as
    floating point (ConfigError naming them), and the tensors no spec reads are listed in one warning (those of the
    layers past --num-layers excepted: the flag leaves them out). `checkpoint_layers`: the config's layer count."""
    read: set[str] = set()
    missing: list[str] = []
    not_float: list[str] = []

    def fetch(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        pieces = ckpt.packed(name)
        if pieces is not None:  # its pieces stand for it: each there, of the shape and dtype its packing stores
            read.update(pieces)
            ckpt.packed_entries(name, shape)
        elif name not in ckpt:
            raise KeyError(name)
        else:
            read.add(name)
            if ckpt.header(name).dtype not in FLOAT_DTYPES:  # named below (a packed tensor's shape is not the weight's)
                not_float.append(name)
            else:
                ckpt.entry(name, shape)
        # no bytes past the first dim: the spec's cut (P = 1: cat, stack, rows) runs on shapes only (meta tensors
        # would too, but their first torch.cat imports sympy: a second of start-up)
        return torch.empty(shape[:1] + (0,) * (len(shape) - 1))

    # one rank in TP holds every head and every expert whole: its specs read every tensor any layout reads
    for s in family_of(cfg).weight_specs(cfg, Layout(cfg, "tp", 0, 1), 4):
        if s.load is not None:
            try:
                s.load(fetch)
            except KeyError as e:
                missing.append(e.args[0])
    if not_float:
        raise ConfigError(_dtype_error(not_float, ckpt.header(not_float[0])))
    if missing:
        raise ConfigError(f"checkpoint {ckpt.path!r} is missing tensor{'s' if len(missing) > 1 else ''} "
                          f"{_some(missing)}{_unsaid(ckpt, cfg, missing[0])}")
    cut = range(cfg.num_layers, checkpoint_layers)

    def left_out(name: str) -> bool:
        m = _LAYER.match(name)
        return m is not None and int(m.group(1)) in cut

    unread = sorted(n for n in ckpt.names if n not in read and not left_out(n))
    if unread:
        log.warning("checkpoint %r holds %d tensor%s no Moebius weight reads (ignored): %s", ckpt.path, len(unread),
                    "s" if len(unread) > 1 else "", _some(unread))


class DummyCheckpoint:
    """Random weights of any asked-for shape, generated on the device from (seed, tensor name).

    Every rank draws the same full tensor for a name and cuts its own shard, so all layouts of all ranks see one
    consistent model. Norm weights are ones.
    """

    def __init__(self, seed: int, device: torch.device, std: float = 0.02) -> None:
        self.seed, self.device, self.std = seed, device, std
        self.path = "<dummy>"
        self._gen = torch.Generator(device=device)

    def __contains__(self, name: str) -> bool:
        return not name.endswith(SCALE)  # float weights: a packed format's pieces are not among them

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name.endswith("norm.weight"):
            return torch.ones(shape, device=self.device)
        self._gen.manual_seed((self.seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
        # drawn scaled in place: a second tensor of the whole (a vocabulary matrix: GBs) would be allocated again
        return torch.empty(shape, device=self.device).normal_(0.0, self.std, generator=self._gen)


def load_weights(umm: UnifiedMemory, specs: list[ParamSpec], ckpt: Checkpoint | DummyCheckpoint,
                 dtype: torch.dtype, cfg: ModelConfig) -> None:
    """Cut every view's shard from the checkpoint's full tensors (names checked, shapes checked), then RoPE."""

    def fetch(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in ckpt:
            raise KeyError(name)
        # a packed tensor dequantized straight to the engine's dtype (no float32 copy of a layer's experts)
        return ckpt.get(name, shape, dtype) if isinstance(ckpt, Checkpoint) else ckpt.get(name, shape)

    for s in specs:
        view = spec_view(umm, s, dtype)
        if s.load is None:  # the RoPE table: the family's, or plain RoPE over head_dim
            table = family_of(cfg).rope_table
            view.copy_(rope_table(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, umm.device)
                       if table is None else table(cfg, umm.device))
            continue
        try:
            if s.fill is not None:  # the cut straight into the view (experts: no stacked temporary)
                s.fill(fetch, view)
            else:
                view.copy_(s.load(fetch))
        except KeyError as e:
            raise ConfigError(f"checkpoint {ckpt.path!r} is missing tensor {e.args[0]}") from None


# Tensor dtypes an update takes: those of FLOAT_DTYPES (float8 would be quantized values without their scales)
UPDATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _unknown(name: str, cfg: ModelConfig, known: dict[str, tuple[int, ...]]) -> str:
    """Why `name` is no tensor of the model, in words."""
    m = _LAYER.match(name)
    if m is not None and int(m.group(1)) >= cfg.num_layers:
        return (f"tensor {name} is of layer {m.group(1)}, but the engine runs {cfg.num_layers} layers (0.."
                f"{cfg.num_layers - 1}; --num-layers)")
    if name == "lm_head.weight" and cfg.tie_word_embeddings:
        return ("tensor lm_head.weight: the model ties lm_head to the embedding (tie_word_embeddings), so it has no "
                "lm_head of its own; send model.embed_tokens.weight")
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.8)
    hint = (f"; did you mean {close[0]}?" if close
            else " (names are a Hugging Face checkpoint's, e.g. model.norm.weight)")
    return f"unknown tensor name {name!r}: the model has no weight of that name{hint}"


def _piece_of(name: str, accepted: Iterable[Packing], known: Container[str] | None = None
              ) -> tuple[str, Packing] | None:
    """(the float tensor, its packing) where `name` is a piece of one (of `known`, where given), else None."""
    for packing in accepted:
        base = packing.base_of(name)
        if base is not None and (known is None or base in known):
            return base, packing
    return None


def _not_float(name: str, t: torch.Tensor) -> str:
    """Why an update's tensor of no float dtype is not taken as the float tensor `name`."""
    kind = "float8 (quantized values, without their scales)" if "float8" in str(t.dtype) else "not floating point"
    return (f"tensor {name} is {t.dtype}, {kind}: an update takes "
            f"{', '.join(str(d).removeprefix('torch.') for d in UPDATE_DTYPES)} tensors")


def _own_piece(name: str, t: torch.Tensor, shape: tuple[int, ...], accepted: Iterable[Packing]
               ) -> tuple[str, Packing] | None:
    """(`name`, its packing) where the model's float tensor `name` of `shape` comes as a packed piece of its own name
    (FP8's float8 weight beside its scales: the piece's dtype, no float one, says it is one), else None."""
    if t.dtype in UPDATE_DTYPES:
        return None
    for packing in accepted:
        pieces = packing.pieces(name)
        if pieces is not None and name in pieces:
            try:
                if packing.stored(shape)[pieces.index(name)][1] == t.dtype:
                    return name, packing
            except ValueError:  # (the format cannot hold the tensor: not a piece of it)
                continue
    return None


def _check_dense(name: str, t: torch.Tensor) -> None:
    if t.layout != torch.strided or t.is_meta:
        raise ValueError(f"tensor {name} is a {'meta' if t.is_meta else str(t.layout)} tensor: an update needs "
                         "its values in a dense tensor")


def _check_piece(name: str, t: torch.Tensor, base: str, packing: Packing, shape: tuple[int, ...]) -> None:
    """ValueError naming a packed piece of the wrong shape or dtype for the model's float tensor `base`."""
    pieces = packing.pieces(base)
    assert pieces is not None
    what = f"{packing.method} piece of the model's {base} {shape}"
    try:
        pshape, pdtype = packing.stored(shape)[pieces.index(name)]
    except ValueError as e:
        raise ValueError(f"tensor {name}: {base} {shape} cannot be given as {packing.method} pieces: {e}") from None
    if tuple(t.shape) != pshape:
        raise ValueError(f"tensor {name} has shape {tuple(t.shape)}; as the {what} it is {pshape}")
    if t.dtype != pdtype:
        raise ValueError(f"tensor {name} is {t.dtype}; as the {what} it is {pdtype}")
    _check_dense(name, t)


def check_update(cfg: ModelConfig, named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """An update's tensors by name (a fused expert tensor kept whole: the expert cut takes it as it is), every one
    checked before a byte is written: TypeError for what is not a (name, tensor) pair, ValueError naming the
    first tensor whose name the model does not read, whose shape is not the model's (both shapes named), whose
    dtype is not floating point, or that comes twice. A float tensor may come as the pieces of a format its family
    reads (`packings`: MXFP4's `<name>_blocks` + `<name>_scales`, block FP8's float8 `<name>` +
    `<name>_scale_inv`), each of its shape and dtype, all of them together; they are kept as given (`write_update`
    dequantizes them on the rank)."""
    family = family_of(cfg)
    known = family.checkpoint_tensors(cfg)
    accepted = family.packings.values()
    names = expert_names(cfg)
    out: dict[str, torch.Tensor] = {}
    given_as: dict[str, str] = {}  # per-expert name -> the name it came under (a fused tensor's)
    packed: dict[str, Packing] = {}  # float tensor given as pieces -> its packing

    def claim(name: str, experts: int, under: str) -> None:
        for n in per_expert_names(cfg, name, experts):  # names only: no view a fused tensor's expert
            if n in given_as:
                twice = given_as[n] if given_as[n] == under else f"{given_as[n]} and {under}"
                raise ValueError(f"tensor {n} is given twice (in {twice}): which one counts would be a guess")
            given_as[n] = under

    if isinstance(named, Mapping):
        named = named.items()
    for item in named:
        if not (isinstance(item, tuple | list) and len(item) == 2):
            raise TypeError(f"a weight update is an iterable of (name, tensor) pairs; got a {type(item).__name__}")
        name, t = item
        if not isinstance(name, str):
            raise TypeError(f"a tensor name must be a string, got {type(name).__name__} {name!r}")
        name = names.checkpoint_name(name)
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tensor {name} must be a torch.Tensor, got {type(t).__name__}")
        piece = _own_piece(name, t, known[name], accepted) if name in known else _piece_of(name, accepted, known)
        if piece is not None:
            base, packing = piece
            _check_piece(name, t, base, packing, known[base])
            packed[base] = packing
            if name in out:
                raise ValueError(f"tensor {name} is given twice: which one counts would be a guess")
            out[name] = t.detach()
            continue
        if name not in known:
            raise ValueError(_unknown(name, cfg, known))
        if tuple(t.shape) != known[name]:
            raise ValueError(f"tensor {name} has shape {tuple(t.shape)}; the model's is {known[name]}")
        if t.dtype not in UPDATE_DTYPES:
            raise ValueError(_not_float(name, t))
        _check_dense(name, t)
        claim(name, t.shape[0], name)
        out[name] = t.detach()
    for base, packing in packed.items():
        pieces = packing.pieces(base)
        assert pieces is not None
        missing = [p for p in pieces if p not in out]
        if missing and base in out:  # (a float8 weight alone: no float tensor, and its scales not given)
            raise ValueError(f"{_not_float(base, out[base])}, or as {packing.method} pieces, all of "
                             f"{', '.join(pieces)}: {missing[0]} is missing")
        if missing:
            raise ValueError(f"tensor {missing[0]} is missing: {base} given as {packing.method} pieces needs all of "
                             f"{', '.join(pieces)}")
        for p in pieces:  # (a piece of the float name itself came as a float tensor: it is not one)
            _check_piece(p, out[p], base, packing, known[base])
        claim(base, known[base][0], f"the {packing.method} pieces of {base}")
    return out


class _Unpacked(Mapping[str, torch.Tensor]):
    """An update's tensors (`check_update`'s) with every float tensor given as packed pieces served under its own
    name, dequantized to `dtype` on `device` when asked (one at a time: never every layer's experts at once)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype, device: torch.device) -> None:
        self._tensors, self._dtype, self._device = tensors, dtype, device
        # (every family's packings: those check_update let through are among them)
        every = {p.method: p for f in FAMILIES.values() for p in f.packings.values()}.values()
        self._packed: dict[str, Packing] = {}
        for name in tensors:
            piece = _piece_of(name, every)
            if piece is not None:
                self._packed[piece[0]] = piece[1]

    def __contains__(self, name: object) -> bool:
        return name in self._packed or name in self._tensors

    def __getitem__(self, name: str) -> torch.Tensor:
        packing = self._packed.get(name)
        if packing is None:
            return self._tensors[name]
        pieces = packing.pieces(name)
        assert pieces is not None
        return packing.unpack([self._tensors[p].to(self._device) for p in pieces], self._dtype)

    def __iter__(self) -> Iterator[str]:
        return iter(dict.fromkeys([*self._tensors, *self._packed]))  # (FP8's weight is both a piece and the name)

    def __len__(self) -> int:
        return len(self._tensors.keys() | self._packed.keys())


def write_update(umm: UnifiedMemory, specs: list[tuple[ParamSpec, tuple[str, ...]]],
                 tensors: Mapping[str, torch.Tensor], dtype: torch.dtype) -> int:
    """Write checked tensors (`check_update`) into the views they feed; returns how many views changed. `specs`: the
    rank's resident specs, each with the tensors its cut reads (`spec_reads`: per-expert names; a fused tensor
    stands for its layer's). A spec with a copy-into form (the experts) is written by it, each given piece once
    straight from its source; one that is not given stands in as a meta tensor the cut skips. Any other spec is cut
    again by its own load; where it reads tensors not given (q_proj alone of the qkv stack), they stand in as zeros
    and an indicator cut the same way keeps the view's old values in their place. A float tensor given as packed
    pieces is dequantized to `dtype` on the device when its spec reads it."""
    device = umm.device
    tensors = _Unpacked(tensors, dtype, device)

    def covered(name: str) -> bool:
        return name in tensors or fused_name(name) in tensors

    def fetch(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        t = tensors.get(name)
        return t.to(device) if t is not None else torch.zeros(shape, dtype=dtype, device=device)

    def fetch_into(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        t = tensors.get(name)
        if t is not None:
            return t  # copy_ moves and casts it on the way into the view: no temporary on the device
        if covered(name):
            raise KeyError(name)  # its layer's fused tensor is given: the cut takes that one
        return torch.empty(shape, dtype=dtype, device="meta")

    def given(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.full(shape, name in tensors, dtype=torch.bool, device=device)

    written = 0
    for s, reads in specs:
        some = sum(map(covered, reads))
        if not some:
            continue
        assert s.load is not None
        view = spec_view(umm, s, dtype)
        if s.fill is not None:
            s.fill(fetch_into, view)
        elif some == len(reads):
            view.copy_(s.load(fetch))
        else:
            view.copy_(torch.where(s.load(given), s.load(fetch).to(view.dtype), view))
        written += 1
    return written
