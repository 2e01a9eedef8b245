"""Structure-aware fuzz frames, made from the protocol's own structs. Pure: no sockets.

:class:`FrameFuzzer` reads the request types of :mod:`testbed.core.protocol` through
``msgspec.inspect`` and makes, deterministically from a seed, one ZeroMQ message per
:class:`FuzzCase`: valid requests of every type with random field values (drawn near the
limits the schema states, and from pools of the client's own and another client's session
ids, operation ids and handles), then mutations of them: wrong types, out-of-range numbers
and lengths, missing and unknown fields, unknown ops, ``op`` not the first key, huge or
"negative" (32-bit all-ones) length prefixes, truncation, trailing bytes, bit flips, nesting
thousands of levels deep, frames that are not maps, oversized frames, empty frames,
multi-frame messages, wrong versions and wrong or missing credentials.

Each case says whether the server *must* answer it with an ``Error`` (``expect_error``: it
cannot decode, or must refuse it) and whether it was sent without a valid credential
(``unauthenticated``: anything but an ``Error``, or ``Pong`` for ``ping``, accepts an
unauthorized request). Every case gets exactly one reply from a correct server.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgspec
import msgspec.inspect as mi

from testbed.chaos.frame_edits import (
    HUGE_HEADERS,
    MAX_UINT64,
    OTHER_KIND_VALUES,
    deep_copy,
    encode_map,
    field_paths,
    is_struct_list,
    kinds_of,
    nested,
    set_key,
    set_path,
    violations,
)
from testbed.core import protocol as p

_REQUEST_TYPES: tuple[mi.StructType, ...] = mi.type_info(p.Request).types  # type: ignore[attr-defined]
REQUEST_OPS: tuple[str, ...] = tuple(str(t.tag) for t in _REQUEST_TYPES)
"""Every request op of the protocol, in the order of :data:`testbed.core.protocol.Request`."""

_encoder = msgspec.msgpack.Encoder()
_Made = tuple[list[bytes], bool, bool]
"""What a mutation makes: the message's frames, whether it must get an ``Error``, whether it
carries no valid credential."""
_OWN_SESSIONS = tuple(f"fuzz-{i}" for i in range(16))
_OWN_OP_IDS = tuple(range(1, 33))


@dataclass(frozen=True)
class FuzzContext:
    """What the fuzzing client knows: its credential, the server's epoch, and another
    client's identifiers (which it must never be able to use)."""

    token: str
    epoch: int
    foreign_sessions: tuple[str, ...] = ()
    foreign_op_ids: tuple[int, ...] = ()
    foreign_handles: tuple[bytes, ...] = ()
    """Another client's lock-group handles; only ever paired with session ids that are not
    that client's (a handle *with* its session is a capability the owner hands its workers)."""
    chunk_hashes: tuple[bytes, ...] = ()
    models: tuple[str, ...] = ()
    max_message_bytes: int = 1 << 20


@dataclass(frozen=True)
class FuzzCase:
    index: int
    kind: str
    """The mutation (``valid`` for none)."""
    op: str
    """The request type the case was made from."""
    frames: tuple[bytes, ...]
    rid: int
    """The correlation id the request carries (0 when the mutation destroyed it)."""
    expect_error: bool
    unauthenticated: bool

    @property
    def num_bytes(self) -> int:
        return sum(len(frame) for frame in self.frames)


class FrameFuzzer:
    """Deterministic by ``seed``: the same seed and context give the same cases."""

    def __init__(self, seed: int, context: FuzzContext) -> None:
        self.rng = random.Random(seed)
        self.context = context
        self._hashes = tuple(self.rng.randbytes(16) for _ in range(48)) + context.chunk_hashes
        self._models = ("fuzz", "fuzz-2", *context.models)
        self._letters = "".join(self.rng.choices("abcXYZ09-_:|\x00\u00e9\u2603\U0001f600", k=8192))
        mutations = (
            ("valid", 30.0, self._valid),
            ("bad_auth", 8.0, self._bad_auth),
            ("version", 2.0, self._version),
            ("wrong_type", 8.0, self._wrong_type),
            ("out_of_range", 8.0, self._out_of_range),
            ("missing_field", 3.0, self._missing_field),
            ("unknown_field", 4.0, self._unknown_field),
            ("unknown_op", 3.0, self._unknown_op),
            ("op_not_first", 4.0, self._op_not_first),
            ("huge_length", 5.0, self._huge_length),
            ("truncated", 6.0, self._truncated),
            ("trailing_bytes", 2.0, self._trailing_bytes),
            ("bit_flip", 6.0, self._bit_flip),
            ("deep_nesting", 4.0, self._deep_nesting),
            ("not_a_map", 2.0, self._not_a_map),
            ("multi_frame", 2.0, self._multi_frame),
            ("empty_frame", 1.0, self._empty_frame),
            ("oversized", 0.1, self._oversized),
        )
        self._kinds = [name for name, _, _ in mutations]
        self._weights = [weight for _, weight, _ in mutations]
        self._makers = {name: maker for name, _, maker in mutations}
        self._op = ""
        self._begun: deque[int] = deque(maxlen=4)

    def cases(self, count: int) -> Iterator[FuzzCase]:
        for index in range(count):
            yield self.case(index)

    def case(self, index: int, kind: str | None = None, op: str | None = None) -> FuzzCase:
        """Case ``index``: a mutation ``kind`` (random by weight when ``None``) of a random
        valid request (of type ``op`` when given)."""
        rng = self.rng
        kind = kind or rng.choices(self._kinds, self._weights)[0]
        info = rng.choice(_REQUEST_TYPES) if op is None else _type_of(op)
        self._op = str(info.tag)
        rid = rng.randrange(1, 1 << 62)
        pairs = self.request(info, rid)
        frames, expect_error, unauthenticated = self._makers[kind](info, pairs)
        # Attribute replies by rid only where the frame still carries it unchanged.
        marker = _encoder.encode("rid") + _encoder.encode(rid)
        kept_rid = rid if frames and marker in frames[0] else 0
        return FuzzCase(
            index, kind, str(info.tag), tuple(frames), kept_rid, expect_error, unauthenticated
        )

    # -----------------------------------------------------------------------------------------
    # Valid requests
    # -----------------------------------------------------------------------------------------

    def request(self, info: mi.StructType, rid: int) -> list[tuple[str, Any]]:
        """A valid request of type ``info`` as (key, value) pairs, ``op`` first."""
        pairs: list[tuple[str, Any]] = [("op", info.tag), ("rid", rid)]
        for name, value in self._fields(info).items():
            if name != "rid":
                pairs.append((name, value))
        return pairs

    def _fields(self, info: mi.StructType) -> dict[str, Any]:
        values: dict[str, Any] = {}
        for f in info.fields:
            if f.name == "auth":
                values["auth"] = self.context.token
            elif f.required or self.rng.random() < 0.5:
                values[f.encode_name] = self._value(f.name, f.type)
        if "items" in values:  # a foreign handle never goes with a foreign session
            for item in values["items"]:
                if item.get("handle") in self.context.foreign_handles:
                    item["session_id"] = self.rng.choice(_OWN_SESSIONS)
        return values

    def _value(self, name: str, info: mi.Type) -> Any:
        rng, ctx = self.rng, self.context
        if name == "v":
            return p.PROTOCOL_VERSION
        if name == "epoch":
            return ctx.epoch if rng.random() < 0.85 else self._int(info)
        if name in ("op_id", "op_ids"):
            return self._op_ids(name)
        if name == "session_id":
            return rng.choice(_OWN_SESSIONS + ctx.foreign_sessions)
        if name == "model":
            return rng.choice(self._models)
        if name == "chunk_hashes":
            count = rng.choice((0, 1, 1, 2, 3, 4, 8, 16, 64, 300))
            known = rng.choices(self._hashes, k=count)
            return [h if rng.random() < 0.8 else rng.randbytes(16) for h in known]
        if name == "handle":
            return rng.choice((b"", rng.randbytes(16), *ctx.foreign_handles))
        if name in ("world_size", "kv_rank", "tp_size", "num_readers"):
            small = 1 if name != "kv_rank" else 0
            return rng.choice((small, small, small, small + 1, self._int(info)))
        if name in ("start_token", "end_token", "first_chunk"):
            return rng.choice((0, 64, 130, 1024, self._int(info)))
        if name == "block_size":
            return rng.choice((16, 64, 64, self._int(info)))
        if name == "bytes_per_token":
            return rng.choice((128, 128, 64, self._int(info)))
        if name == "dtype":
            return "float16"
        if name == "shared_kv":  # mostly worker-driven; else a file that is not there
            if rng.random() < 0.8:
                return None
            return {
                "path": f"/dev/shm/kvtb-kv-fuzz-{rng.getrandbits(32):08x}",
                "file_bytes": 2 * 4 * 16 * 128 * 2,
                "layout": _FUZZ_LAYOUT,
            }
        if name == "cuda_kv":  # mostly absent; else storages of a GPU this server cannot see
            return None if rng.random() < 0.8 else _cuda_kv(rng)
        if name == "cache_salt":
            return rng.choice(("", "", "salt"))
        if name in ("traceparent", "tracestate"):
            return rng.choice(("", "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01", self._text(info)))
        return self._generic(name, info)

    def _op_ids(self, name: str) -> int | list[int]:
        """Begins take fresh ids; commits, ends and aborts mostly name a recent begin (so
        that whole operations happen), else any id, the other client's included."""
        rng, pool = self.rng, _OWN_OP_IDS + self.context.foreign_op_ids
        if self._op in ("store_begin", "retrieve_begin"):
            op_id = rng.choice(pool)
            self._begun.append(op_id)
            return op_id
        recent = list(self._begun) or list(pool)
        if name == "op_id":
            return rng.choice(recent) if rng.random() < 0.6 else rng.choice(pool)
        return [rng.choice(recent + list(pool)) for _ in range(rng.choice((0, 1, 1, 2, 4)))]

    def _generic(self, name: str, info: mi.Type) -> Any:
        rng = self.rng
        if isinstance(info, mi.IntType):
            return self._int(info)
        if isinstance(info, mi.StrType):
            return self._text(info)
        if isinstance(info, mi.BytesType):
            lo, hi = info.min_length or 0, info.max_length or 64
            return rng.randbytes(rng.randint(lo, hi))
        if isinstance(info, mi.BoolType):
            return rng.random() < 0.5
        if isinstance(info, mi.ListType):
            count = rng.choice((0, 1, 1, 2, 3))
            return [self._value(name, info.item_type) for _ in range(count)]
        if isinstance(info, mi.StructType):
            return self._fields(info)
        if isinstance(info, mi.UnionType):  # optional fields: mostly absent, as clients send
            present = [t for t in info.types if not isinstance(t, mi.NoneType)]
            if len(present) < len(info.types) and rng.random() < 0.8:
                return None
            return self._value(name, rng.choice(present))
        raise TypeError(f"no generator for {info!r}")

    def _int(self, info: mi.Type) -> int:
        assert isinstance(info, mi.IntType)
        lo = info.ge if info.ge is not None else -(1 << 63)
        hi = info.le if info.le is not None else MAX_UINT64
        rng = self.rng
        candidates = (lo, lo + 1, hi, hi - 1, rng.randint(0, 100), rng.randint(0, 1 << 32))
        return min(hi, max(lo, rng.choice(candidates)))

    def _text(self, info: mi.Type) -> str:
        assert isinstance(info, mi.StrType)
        limit = info.max_length if info.max_length is not None else 64
        rng = self.rng
        length = max(info.min_length or 0, min(limit, rng.choice((0, 1, 8, 40, limit))))
        start = rng.randrange(len(self._letters) - length + 1)
        return self._letters[start : start + length]

    # -----------------------------------------------------------------------------------------
    # Mutations: each returns (frames, expect_error, unauthenticated)
    # -----------------------------------------------------------------------------------------

    def _valid(self, info: mi.StructType, pairs: list[tuple[str, Any]]) -> _Made:
        return [encode_map(pairs)], False, False

    def _bad_auth(self, info: mi.StructType, pairs: list[tuple[str, Any]]) -> _Made:
        wrong = self.rng.choice(("", "0" * 48, self.context.token[:-1], self.context.token + "x"))
        pairs = [(k, v) for k, v in pairs if k != "auth"]
        if wrong or self.rng.random() < 0.5:
            pairs.append(("auth", wrong))
        is_ping = info.tag == "ping"
        return [encode_map(pairs)], not is_ping, True

    def _version(self, info: mi.StructType, pairs: list[tuple[str, Any]]) -> _Made:
        version = self.rng.choice((0, 1, p.PROTOCOL_VERSION + 1, 1 << 40, -1))
        return [encode_map(set_key(pairs, "v", version))], True, False

    def _wrong_type(self, info: mi.StructType, pairs: list[tuple[str, Any]]) -> _Made:
        paths = [path for path in field_paths(info, pairs) if path[-1] != "op"]
        path, field_info = self.rng.choice(paths)
        kinds = [k for k in OTHER_KIND_VALUES if k not in kinds_of(field_info)]
        value = self.rng.choice(OTHER_KIND_VALUES[self.rng.choice(kinds)])
        return [encode_map(set_path(pairs, path, value))], True, False

    def _out_of_range(self, info: mi.StructType, pairs: list[tuple[str, Any]]) -> _Made:
        options = [
            (path, value)
            for path, field_info in field_paths(info, pairs)
            for value in violations(field_info)
        ]
        if not options:
            return self._version(info, pairs)
        path, value = self.rng.choice(options)
        return [encode_map(set_path(pairs, path, value))], True, False

    def _missing_field(self, info: mi.StructType, pairs: list[tuple[str, Any]]) -> _Made:
        required = [f.encode_name for f in info.fields if f.required]
        if not required:
            return self._valid(info, pairs)
        gone = self.rng.choice(required)
        return [encode_map([(k, v) for k, v in pairs if k != gone])], True, False

    def _unknown_field(self, info: mi.StructType, pairs: list[tuple[str, Any]]) -> _Made:
        extra: list[tuple[str, Any]] = [
            (f"x{self.rng.randrange(1 << 20)}_{i}", self.rng.choice((1, "x", None, [1], {})))
            for i in range(self.rng.choice((1, 1, 2, 20)))  # 20: a map16 header, op first
        ]
        nested_structs = [k for k, v in pairs if isinstance(v, dict) or is_struct_list(v)]
        if nested_structs and self.rng.random() < 0.3:  # inside ``layout`` or ``items[0]``
            key = self.rng.choice(nested_structs)
            container = deep_copy(dict(pairs)[key])
            target = container if isinstance(container, dict) else container[0]
            target.update(extra)
            return [encode_map(set_key(pairs, key, container))], True, False
        mixed = pairs[:1] + self.rng.sample(pairs[1:] + extra, len(pairs) - 1 + len(extra))
        return [encode_map(mixed)], True, False

    def _unknown_op(self, info: mi.StructType, pairs: list[tuple[str, Any]]) -> _Made:
        op = self.rng.choice(("drop_table", "", "LOOKUP", "lookup ", 7, None, b"lookup", ["ping"]))
        return [encode_map([("op", op), *pairs[1:]])], True, False

    def _op_not_first(self, info: mi.StructType, pairs: list[tuple[str, Any]]) -> _Made:
        rest = pairs[1:]
        at = self.rng.randint(1, len(rest))
        return [encode_map([*rest[:at], pairs[0], *rest[at:]])], True, False

    def _huge_length(self, info: mi.StructType, pairs: list[tuple[str, Any]]) -> _Made:
        key = self.rng.choice([k for k, _ in pairs[1:]])
        header = self.rng.choice(HUGE_HEADERS) + self.rng.randbytes(self.rng.randint(0, 8))
        moved = [(k, v) for k, v in pairs if k != key] + [(key, msgspec.Raw(header))]
        return [encode_map(moved)], True, False

    def _truncated(self, info: mi.StructType, pairs: list[tuple[str, Any]]) -> _Made:
        frame = encode_map(pairs)
        return [frame[: self.rng.randrange(len(frame))]], True, False

    def _trailing_bytes(self, info: mi.StructType, pairs: list[tuple[str, Any]]) -> _Made:
        tail = self.rng.choice((b"\x00", b"\xc0", encode_map(pairs), self.rng.randbytes(5)))
        return [encode_map(pairs) + tail], True, False

    def _bit_flip(self, info: mi.StructType, pairs: list[tuple[str, Any]]) -> _Made:
        frame = bytearray(encode_map(pairs))
        for _ in range(self.rng.choice((1, 1, 2, 4, 16))):
            frame[self.rng.randrange(len(frame))] ^= 1 << self.rng.randrange(8)
        return [bytes(frame)], False, False

    def _deep_nesting(self, info: mi.StructType, pairs: list[tuple[str, Any]]) -> _Made:
        nest = msgspec.Raw(nested(self.rng.choice((1_000, 1_009, 3_000, 20_000)), self.rng))
        where = self.rng.choice(("field", "unknown_field", "op", "inside_list"))
        if where == "field" and len(pairs) > 2:
            key = self.rng.choice([k for k, _ in pairs[2:]])
            mutated = set_key(pairs, key, nest)
        elif where == "op":
            mutated = [("op", nest), *pairs[1:]]
        elif where == "inside_list":
            key = "chunk_hashes" if "chunk_hashes" in dict(pairs) else "deep"
            mutated = set_key(pairs, key, [nest])
        else:
            mutated = [*pairs, ("deep", nest)]
        return [encode_map(mutated)], True, False

    def _not_a_map(self, info: mi.StructType, pairs: list[tuple[str, Any]]) -> _Made:
        rng = self.rng
        choice = rng.randrange(5)
        if choice == 0:  # the frame that used to kill the server: ~1,000 nested arrays
            frame = nested(rng.choice((1_000, 1_009, 5_000)), rng)
        elif choice == 1:
            frame = _encoder.encode([v for _, v in pairs])
        elif choice == 2:
            frame = _encoder.encode(rng.choice((None, 1, 2.5, "lookup", b"op", True)))
        elif choice == 3:
            frame = rng.randbytes(rng.randint(1, 300))
        else:
            frame = b"\xa2op" + encode_map(pairs)  # the tag key without a map around it
        return [frame], True, False

    def _multi_frame(self, info: mi.StructType, pairs: list[tuple[str, Any]]) -> _Made:
        frame = encode_map(pairs)
        frames = self.rng.choice(([frame, frame], [frame, b""], [b"", frame], [frame] * 3))
        return frames, True, False

    def _empty_frame(self, info: mi.StructType, pairs: list[tuple[str, Any]]) -> _Made:
        return [b""], True, False

    def _oversized(self, info: mi.StructType, pairs: list[tuple[str, Any]]) -> _Made:
        """Over the server's ``max_message_bytes`` (but under twice it, beyond which ZeroMQ
        drops the connection instead): an ``Error`` reply, nothing decoded."""
        limit = self.context.max_message_bytes
        padding = self.rng.randint(1, max(1, limit // 4))
        frame = encode_map([*pairs, ("pad", b"\x00" * (limit + padding))])
        return [frame], True, False


def _type_of(op: str) -> mi.StructType:
    for info in _REQUEST_TYPES:
        if info.tag == op:
            return info
    raise ValueError(f"unknown op {op!r}; ops: {', '.join(REQUEST_OPS)}")


_FUZZ_LAYOUT = {
    "layer_offsets_bytes": [0, 4 * 16 * 128 * 2],
    "shape": [4, 16, 128],
    "strides_bytes": [16 * 128 * 2, 128 * 2, 2],
    "dtype": "float16",
    "itemsize": 2,
    "block_dim": 0,
    "block_size": 16,
}
"""Two float16 layers of 4 blocks of 16 tokens (a registration's paged KV layout)."""


def _cuda_kv(rng: random.Random) -> dict[str, Any]:
    """A well-formed CUDA KV registration (two layers in one storage) of a made-up GPU."""
    return {
        "storages": [
            {
                "device_uuid": f"GPU-fuzz-{rng.getrandbits(32):08x}",
                "ipc_handle": rng.randbytes(64),
                "storage_bytes": 2 * 4 * 16 * 128 * 2,
                "offset_bytes": 0,
            }
        ],
        "layer_storages": [0, 0],
        "layout": _FUZZ_LAYOUT,
    }
