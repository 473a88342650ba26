"""Hand-written protobuf wire form of FetchAdapter data chunks, so 1 MiB payload slices cross the
stream with one copy on each side instead of three (message build, serialize, parse).

A FetchAdapterResponse carrying a chunk is, in protobuf's wire format:
    0x12 <len>                      field 2 (chunk), length-delimited
        0x08 <offset varint>        DataChunk.offset (field 1, varint)
        0x12 <n> <n data bytes>     DataChunk.data (field 2, length-delimited)
The bytes are exactly what `FetchAdapterResponse(chunk=DataChunk(...)).SerializeToString()` gives
(protobuf omits offset 0, which decodes the same). Manifests go through protobuf as usual.
"""

from __future__ import annotations

from google.protobuf.message import DecodeError

from loraserve.v1 import store_pb2

CHUNK_TAG = 0x12  # field 2, wire type 2
# Trailing metadata of a FetchAdapter that ends DATA_LOSS because bytes it had already sent came from
# a damaged copy (the store dropped it): the client starts again from offset 0 rather than resuming.
REFETCH_KEY = "loraserve-refetch"


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        if n:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ValueError("truncated or overlong varint")
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
        shift += 7


def encode_chunk(offset: int, data: memoryview | bytes) -> bytes:
    """Serialized FetchAdapterResponse(chunk=DataChunk(offset, data)), built with a single copy of data."""
    inner = (b"\x08" + _varint(offset) if offset else b"") + (
        b"\x12" + _varint(len(data)) if len(data) else b""
    )
    return b"".join((bytes((CHUNK_TAG,)), _varint(len(inner) + len(data)), inner, data))


def serialize_response(msg: store_pb2.FetchAdapterResponse | bytes) -> bytes:
    """Response serializer of FetchAdapter: pre-encoded chunks pass through, messages are serialized."""
    return msg if isinstance(msg, bytes) else msg.SerializeToString()


def _parse(raw: bytes) -> store_pb2.FetchAdapterResponse:
    try:
        return store_pb2.FetchAdapterResponse.FromString(raw)
    except DecodeError as exc:
        raise ValueError(f"corrupt FetchAdapterResponse: {exc}") from exc


def decode_response(raw: bytes) -> store_pb2.FetchAdapterResponse | tuple[int, memoryview]:
    """A manifest message, or (offset, data view) of a chunk, from one serialized FetchAdapterResponse.
    ValueError when the bytes are not a valid message."""
    buf = memoryview(raw)
    if not buf or buf[0] != CHUNK_TAG:
        return _parse(raw)
    length, pos = _read_varint(buf, 1)
    end = pos + length
    if end != len(buf):  # not a lone chunk field: leave the general case to protobuf
        return _parse(raw)
    offset, data = 0, buf[0:0]
    while pos < end:
        key, pos = _read_varint(buf, pos)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _read_varint(buf, pos)
            if field == 1:
                offset = value
        elif wire == 2:
            n, pos = _read_varint(buf, pos)
            if pos + n > end:
                raise ValueError("chunk data runs past the message")
            if field == 2:
                data = buf[pos : pos + n]
            pos += n
        else:
            return _parse(raw)
    return offset, data
