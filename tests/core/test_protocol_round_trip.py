"""Every wire message survives encoding and decoding, every field of it on the wire.

The messages are found in the protocol module (every request and reply class), and each is
built with a value other than its default in every field (``msgspec.inspect`` says what each
field accepts), so a new message type or field is covered without touching this file.
"""

from __future__ import annotations

import typing
from typing import Any

import msgspec
import msgspec.inspect as mi
import pytest

from testbed.core import protocol as p
from testbed.core.kv_layout import PagedLayout, SharedKVFile

LAYOUT = PagedLayout(
    layer_offsets_bytes=[0, 4096],
    shape=[8, 16, 4],
    strides_bytes=[128, 8, 2],
    dtype="bfloat16",
    itemsize=2,
    block_dim=0,
    block_size=16,
)
VALID: dict[type, Any] = {
    # Structs whose fields constrain each other: one valid value each, every field set.
    PagedLayout: LAYOUT,
    SharedKVFile: SharedKVFile(path="kvtb-kv-1-ab", file_bytes=1 << 20, layout=LAYOUT),
    p.CudaKV: p.CudaKV(
        storages=[
            p.CudaStorage(
                device_uuid="GPU-1",
                ipc_handle=b"h" * 64,
                storage_bytes=1 << 20,
                offset_bytes=512,
                ref_counter_handle=b"/torch_1",
                ref_counter_offset=8,
                event_handle=b"e" * 64,
                event_sync_required=True,
            )
        ],
        layer_storages=[0, 0],
        layout=LAYOUT,
    ),
}


def messages(base: type) -> list[type]:
    """Every message class of the protocol module deriving from ``base``."""
    return [
        value
        for name, value in vars(p).items()
        if isinstance(value, type) and issubclass(value, base) and not name.startswith("_")
    ]


REQUESTS = messages(p._Request)
REPLIES = messages(p._Reply)


def sample(info: mi.Type, default: Any = msgspec.NODEFAULT) -> Any:
    """A valid value of type ``info`` other than ``default``."""
    if isinstance(info, mi.StructType):
        if info.cls in VALID:
            return VALID[info.cls]
        fields = {f.name: sample(f.type, f.default) for f in info.fields}
        return info.cls(**fields)
    if isinstance(info, mi.UnionType):
        chosen = next(t for t in info.types if not isinstance(t, mi.NoneType))
        return sample(chosen, default)
    if isinstance(info, mi.ListType):
        return [sample(info.item_type)] * max(1, info.min_length or 0)
    if isinstance(info, mi.DictType):
        return {sample(info.key_type): sample(info.value_type)}
    if isinstance(info, mi.LiteralType):
        return next(value for value in reversed(info.values) if value != default)
    if isinstance(info, mi.BoolType):
        return default is not True
    if isinstance(info, mi.FloatType):
        return 1.5 if default != 1.5 else 2.5
    if isinstance(info, mi.IntType):
        low = 0 if info.ge is None else info.ge
        value = low + 3 if info.le is None else min(low + 3, info.le)
        return value if value != default else value - 1 if value > low else value + 1
    if isinstance(info, mi.StrType | mi.BytesType):
        size = info.min_length or min(5, info.max_length or 5)
        text = "s7" * size
        value = text[:size] if isinstance(info, mi.StrType) else text[:size].encode()
        return value if value != default else value[:-1] + value[:1]
    raise TypeError(f"no sample for {info!r}: teach sample() this type")


def build(cls: type) -> msgspec.Struct:
    return sample(mi.type_info(cls))


def wire_fields(message: msgspec.Struct) -> dict[str, Any]:
    """The message as the frame's map: what actually travels."""
    return msgspec.msgpack.decode(p.encode(message))


def decode(cls: type, frame: bytes) -> msgspec.Struct:
    return (p.decode_request if issubclass(cls, p._Request) else p.decode_reply)(frame)


def test_the_protocol_defines_every_message_of_its_unions():
    """The decoders know a message only through the unions: none may be left out of them."""
    assert set(REQUESTS) == {*typing.get_args(p.Request), p.Batch}
    assert set(REPLIES) == {*typing.get_args(p.Reply), p.Replies}
    assert len(REQUESTS) >= 18 and len(REPLIES) >= 16


@pytest.mark.parametrize("cls", REQUESTS + REPLIES, ids=lambda cls: cls.__name__)
def test_every_message_round_trips_with_every_field_on_the_wire(cls):
    message = build(cls)
    frame = p.encode(message)
    decoded = decode(cls, frame)
    assert type(decoded) is cls and decoded == message
    names = {f.encode_name for f in mi.type_info(cls).fields}
    assert set(wire_fields(message)) == {"op", *names}, "a field was left off the wire"


@pytest.mark.parametrize("cls", REQUESTS + REPLIES, ids=lambda cls: cls.__name__)
def test_a_frame_missing_any_field_or_under_another_tag_does_not_decode_as_sent(cls):
    """The round trip has teeth: each field and the tag must arrive for the message to."""
    message = build(cls)
    sent = wire_fields(message)
    for name in sent:
        if name == "op":
            continue
        cut = {key: value for key, value in sent.items() if key != name}
        assert _decoded_or_none(cls, cut) != message, f"{cls.__name__}.{name} is not needed"
    family = REQUESTS if issubclass(cls, p._Request) else REPLIES
    other = next(c for c in family if c is not cls)
    retagged = {**sent, "op": other.__struct_config__.tag}
    assert _decoded_or_none(cls, retagged) != message


def _decoded_or_none(cls: type, fields: dict[str, Any]) -> msgspec.Struct | None:
    frame = msgspec.msgpack.encode({"op": fields["op"], **fields})
    try:
        return decode(cls, frame)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None


def test_unknown_ops_and_malformed_hashes_are_rejected():
    with pytest.raises(msgspec.ValidationError):
        p.decode_request(msgspec.msgpack.encode({"op": "format_disk"}))
    short = p.Lookup(session_id="s", model="m", world_size=1, chunk_hashes=[b"short"])
    with pytest.raises(msgspec.ValidationError):
        p.decode_request(p.encode(short))
