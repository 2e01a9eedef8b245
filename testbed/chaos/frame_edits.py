"""How fuzz frames are built and bent: msgpack maps with exactly the keys, order and raw values
wanted, nesting, paths into a request's nested structs, and values just outside what a
field's schema allows. Pure; used by :mod:`testbed.chaos.frames`.
"""

from __future__ import annotations

import random
from typing import Any

import msgspec
import msgspec.inspect as mi

from testbed.core import protocol as p

MAX_UINT64 = (1 << 64) - 1
# Length prefixes claiming 4 GiB (or -1 read as int32) and 64 Ki items, with almost no data.
HUGE_HEADERS = (
    b"\xdb\xff\xff\xff\xff",  # str32
    b"\xdb\x80\x00\x00\x00",
    b"\xc6\xff\xff\xff\xff",  # bin32
    b"\xdd\xff\xff\xff\xff",  # array32
    b"\xdf\xff\xff\xff\xff",  # map32
    b"\xda\xff\xff",  # str16
    b"\xdc\xff\xff",  # array16
    b"\xde\xff\xff",  # map16
    b"\xc9\xff\xff\xff\xff\x01",  # ext32
)
OTHER_KIND_VALUES: dict[str, tuple[Any, ...]] = {
    "int": (0, 7, -1, 1 << 40),
    "str": ("", "x", "\x00\u2603"),
    "bytes": (b"", b"\x00" * 16),
    "list": ([], [1, "a", None]),
    "map": ({}, {"a": 1}),
    "nil": (None,),
    "bool": (True, False),
    "float": (1.5, -0.0, float("nan"), float("inf")),
}


_encoder = msgspec.msgpack.Encoder()


def encode_map(pairs: list[tuple[Any, Any]]) -> bytes:
    """A msgpack map with exactly these (key, value) pairs in this order (duplicates kept);
    values may be ``msgspec.Raw`` (written as they are)."""
    n = len(pairs)
    if n < 16:
        header = bytes([0x80 | n])
    elif n < 1 << 16:
        header = b"\xde" + n.to_bytes(2, "big")
    else:
        header = b"\xdf" + n.to_bytes(4, "big")
    return header + b"".join(_encoder.encode(k) + _encoder.encode(v) for k, v in pairs)


def nested(depth: int, rng: random.Random) -> bytes:
    """``depth`` levels of one-element arrays and maps around ``nil``, in a few runs."""
    cuts = sorted(rng.randint(0, depth) for _ in range(3))
    runs = [b - a for a, b in zip([0, *cuts], [*cuts, depth], strict=True)]
    levels = [(b"\x91" if i % 2 == 0 else b"\x81\xa1k") * n for i, n in enumerate(runs)]
    return b"".join(levels) + b"\xc0"


def set_key(pairs: list[tuple[str, Any]], key: str, value: Any) -> list[tuple[str, Any]]:
    if any(k == key for k, _ in pairs):
        return [(k, value if k == key else v) for k, v in pairs]
    return [*pairs, (key, value)]


Path = tuple[Any, ...]


def field_paths(info: mi.StructType, pairs: list[tuple[str, Any]]) -> list[tuple[Path, mi.Type]]:
    """Every field that can be set: top-level fields (present or not), and the fields of
    nested structs that are present (``layout``, the first of ``items``)."""
    values = dict(pairs)
    found: list[tuple[Path, mi.Type]] = []
    for f in info.fields:
        found.append(((f.encode_name,), f.type))
        value = values.get(f.encode_name)
        if isinstance(f.type, mi.StructType) and isinstance(value, dict):
            found += [((f.encode_name, g.encode_name), g.type) for g in f.type.fields]
        if (
            isinstance(f.type, mi.ListType)
            and isinstance(f.type.item_type, mi.StructType)
            and isinstance(value, list)
            and value
        ):
            item = f.type.item_type
            found += [((f.encode_name, 0, g.encode_name), g.type) for g in item.fields]
    return found


def set_path(pairs: list[tuple[str, Any]], path: Path, value: Any) -> list[tuple[str, Any]]:
    if len(path) == 1:
        return set_key(pairs, path[0], value)
    values = dict(pairs)
    container = deep_copy(values[path[0]])
    target = container
    for step in path[1:-1]:
        target = target[step]
    target[path[-1]] = value
    return set_key(pairs, path[0], container)


def deep_copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: deep_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [deep_copy(v) for v in value]
    return value


def is_struct_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and isinstance(value[0], dict)


_KINDS: dict[type[mi.Type], str] = {
    mi.IntType: "int",
    mi.StrType: "str",
    mi.BytesType: "bytes",
    mi.BoolType: "bool",
    mi.ListType: "list",
    mi.StructType: "map",
    mi.NoneType: "nil",
}
"""The msgpack kind (a key of :data:`OTHER_KIND_VALUES`) of each field type a request has."""


def kinds_of(info: mi.Type) -> set[str]:
    if isinstance(info, mi.UnionType):  # an optional field: any of its kinds, or nil
        return set().union(*(kinds_of(t) for t in info.types))
    kind = _KINDS.get(type(info))
    if kind is None:
        raise TypeError(f"unexpected field type {info!r}")
    return {kind}


def violations(info: mi.Type) -> list[Any]:
    """Values just outside what ``info`` allows (none when it allows every value)."""
    out: list[Any] = []
    if isinstance(info, mi.IntType):
        if info.ge is not None:
            out += [info.ge - 1, -(1 << 63)]
        if info.le is not None and info.le < MAX_UINT64:
            out += [info.le + 1, MAX_UINT64]
    elif isinstance(info, mi.StrType):
        if info.max_length is not None:
            out.append("a" * (info.max_length + 1))
    elif isinstance(info, mi.BytesType):
        if info.min_length:
            out.append(b"\x01" * (info.min_length - 1))
        if info.max_length is not None:
            out.append(b"\x01" * (info.max_length + 1))
    elif isinstance(info, mi.ListType):
        if info.max_length is not None and info.max_length <= p.MAX_ITEMS_PER_BATCH:
            element = _minimal(info.item_type)
            out.append([element] * (info.max_length + 1))
        out += [[bad] for bad in violations(info.item_type)[:1]]
    return out


def _minimal(info: mi.Type) -> Any:
    """The smallest valid value of ``info``."""
    if isinstance(info, mi.IntType):
        return info.ge or 0
    if isinstance(info, mi.BoolType):
        return True
    if isinstance(info, mi.StrType):
        return ""
    if isinstance(info, mi.BytesType):
        return b"\x01" * (info.min_length or 0)
    if isinstance(info, mi.StructType):
        return {f.encode_name: _minimal(f.type) for f in info.fields if f.required}
    if isinstance(info, mi.ListType):
        return []
    raise TypeError(f"unexpected field type {info!r}")
