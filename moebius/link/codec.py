"""The one codec of the messages between the front end and the ranks (`link/messages.py`).

Every message is a dataclass. `encode(obj)` turns one into JSON-able data and `decode(cls, data)` back, guided by
the fields' types: None, bool, int, float, str, Any (JSON-able as it is), lists, tuples, dicts with string keys,
unions of those, enums (by value), nested dataclasses, tensors (float32 bytes, base64) and `TokenIds` (token ids as
base64 int32: quicker both ways than a JSON list of numbers). A dataclass's init fields travel; others are derived
again on arrival. Nothing that arrives is unpickled.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import types
import typing
from collections.abc import Callable, Mapping
from typing import Annotated, Any, TypeVar

import torch

from moebius.parallel.groups import ids_from_json, ids_to_json, tensor_from_json, tensor_to_json

TokenIds = Annotated[list[int], "token ids"]

T = TypeVar("T")
Coder = Callable[[Any], Any]
_SCALARS = (type(None), bool, int, float, str)


def _same(v: Any) -> Any:
    return v


@functools.cache
def _coders(tp: Any) -> tuple[Coder, Coder]:
    """(encode, decode) for values of type `tp`; `_same` where JSON holds the value as it is."""
    if tp is Any or tp in _SCALARS:
        return _same, _same
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Annotated and args[1:] == ("token ids",):
        return ids_to_json, ids_from_json
    if tp is torch.Tensor:
        return tensor_to_json, tensor_from_json
    if origin in (typing.Union, types.UnionType):
        coders = [_coders(a) for a in args if a is not type(None)]
        if all(c == (_same, _same) for c in coders):
            return _same, _same
        if len(coders) == 1:  # X | None
            enc, dec = coders[0]
            return (lambda v: None if v is None else enc(v)), (lambda v: None if v is None else dec(v))
        raise TypeError(f"no codec for the union {tp}: only one member may need converting")
    if origin is list:
        enc, dec = _coders(args[0])
        if (enc, dec) == (_same, _same):
            return _same, _same
        return (lambda v: [enc(x) for x in v]), (lambda v: [dec(x) for x in v])
    if origin is tuple:
        items = [_coders(a) for a in args if a is not Ellipsis]
        if Ellipsis in args:
            enc, dec = items[0]
            return (lambda v: [enc(x) for x in v]), (lambda v: tuple(dec(x) for x in v))
        return ((lambda v: [e(x) for (e, _), x in zip(items, v, strict=True)]),
                (lambda v: tuple(d(x) for (_, d), x in zip(items, v, strict=True))))
    if origin is dict:
        if args[0] is not str:
            raise TypeError(f"no codec for {tp}: JSON object keys are strings")
        enc, dec = _coders(args[1])
        if (enc, dec) == (_same, _same):
            return _same, _same
        return (lambda v: {k: enc(x) for k, x in v.items()}), (lambda v: {k: dec(x) for k, x in v.items()})
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return (lambda v: v.value), tp
    if dataclasses.is_dataclass(tp):
        return _dataclass_coders(tp)
    raise TypeError(f"no codec for {tp!r}")


def _dataclass_coders(cls: type) -> tuple[Coder, Coder]:
    hints = typing.get_type_hints(cls, include_extras=True)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    fields = [(n, *_coders(hints[n])) for n in names]
    plain = [n for n, enc, _ in fields if enc is _same]
    converted = [(n, enc, dec) for n, enc, dec in fields if enc is not _same]

    def encode_one(obj: Any) -> dict[str, Any]:
        out = {n: getattr(obj, n) for n in plain}
        for n, enc, _ in converted:
            out[n] = enc(getattr(obj, n))
        return out

    def decode_one(d: Mapping[str, Any]) -> Any:
        missing = [n for n in names if n not in d]
        if missing:
            raise ValueError(f"{cls.__name__} message lacks {missing}")
        kwargs = {n: d[n] for n in plain}
        for n, _, dec in converted:
            kwargs[n] = dec(d[n])
        return cls(**kwargs)

    return encode_one, decode_one


def encode(obj: Any, tp: Any = None) -> Any:
    """JSON-able data of `obj` (of type `tp`; default: its own class, for a dataclass)."""
    return _coders(type(obj) if tp is None else tp)[0](obj)


def decode(tp: type[T], data: Any) -> T:
    """The `tp` that `encode` turned into `data`."""
    return _coders(tp)[1](data)
