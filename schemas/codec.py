"""Encoding and decoding of wire messages, with the schema version in a header.

One long-lived msgpack Decoder per message type (`codec_for(T)`), as msgspec recommends, and
one Encoder for all (`encode`: what it writes does not depend on the type). Every message
carries the header `rlf-schema: <major>.<minor>`; a reader accepts any minor of its own major
(new fields have defaults) and rejects another major with `UnknownSchemaVersion` before looking
at the payload. Two messages sent once per worker and command go without headers unless tracing
is on (parsing them cost more than the rest of the message): a command's live copy, whose
subject carries the major (`Subjects.live_copy`), and the `Ack` of a command the worker
decoded, which is of the sender's major by then.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, Generic, TypeVar

import msgspec

from rlfabric.schemas.arrays import PACKED_TYPES
from rlfabric.schemas.errors import MalformedMessage, SchemaError, UnknownSchemaVersion

SCHEMA_HEADER = "rlf-schema"
#: set by senders so a receiver can answer even a payload it cannot decode
CMD_ID_HEADER = "rlf-cmd-id"
CLIENT_ID_HEADER = "rlf-client-id"
REQUEST_ID_HEADER = "rlf-request-id"
#: on a `RolloutRequests` message: how many requests it holds
COUNT_HEADER = "rlf-count"
#: on a message combining items of several traced calls: each item's `traceparent`, in order
TRACEPARENTS_HEADER = "rlf-traceparents"
#: on a stored command: `<writer>.<serial>` of the last desired-state write its sender sent
STATE_MARK_HEADER = "rlf-state-mark"
SCHEMA_VERSION = "1.9"
SCHEMA_MAJOR = 1

T = TypeVar("T")
#: what msgspec raises on bytes that are not the type (ValueError: also invalid UTF-8)
DECODE_ERRORS = (msgspec.DecodeError, ValueError, TypeError)


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, PACKED_TYPES):
        return obj.tobytes()
    raise NotImplementedError(f"rlfabric cannot encode {type(obj).__name__}")


#: a packed type from the bytes msgspec read for it (a msgpack bin is always `bytes`)
_FROM_WIRE = {kind: kind.from_wire for kind in PACKED_TYPES}


def _dec_hook(kind: type, obj: Any) -> Any:
    make = _FROM_WIRE.get(kind)
    if make is None:
        raise NotImplementedError(f"rlfabric cannot decode {kind!r}")
    if type(obj) is not bytes:
        raise TypeError(f"expected packed bytes, got {type(obj).__name__}")
    return make(obj)


def _type_name(kind: Any) -> str:
    return getattr(kind, "__name__", None) or " | ".join(a.__name__ for a in kind.__args__)


def check_schema_version(headers: Mapping[str, str] | None, *, subject: str = "",
                         type_name: str = "") -> None:
    """Raise unless `headers` carry an `rlf-schema` of this build's major version."""
    version = (headers or {}).get(SCHEMA_HEADER)
    where = f" on {subject!r}" if subject else ""
    if version is None:
        raise SchemaError(
            f"message{where} has no {SCHEMA_HEADER!r} header; it was not sent by rlfabric "
            f"(expected {type_name or 'an rlfabric message'})",
            subject=subject,
            type_name=type_name,
        )
    major, _, _ = version.partition(".")
    if major != str(SCHEMA_MAJOR):
        raise UnknownSchemaVersion(
            f"message{where} declares {SCHEMA_HEADER} {version}, an unknown major version; "
            f"this rlfabric reads {SCHEMA_MAJOR}.x: upgrade the side that runs the older "
            "rlfabric so both speak the same major version",
            version=version,
            subject=subject,
            type_name=type_name,
        )


class Codec(Generic[T]):
    """Encoder and decoder for one message type (or tagged union of types)."""

    __slots__ = ("_decoder", "_encoder", "decode_raw", "encode_raw", "type", "type_name")

    def __init__(self, kind: Any) -> None:
        self.type = kind
        self.type_name = _type_name(kind)
        self._encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
        self._decoder = msgspec.msgpack.Decoder(kind, dec_hook=_dec_hook)
        #: msgspec's own methods, for a path each worker runs per message: the same bytes as
        #: `encode`; a decode that fails raises one of `DECODE_ERRORS`, not `MalformedMessage`
        self.encode_raw: Callable[[T], bytes] = self._encoder.encode
        self.decode_raw: Callable[[bytes], T] = self._decoder.decode

    def encode(self, msg: T) -> bytes:
        return self._encoder.encode(msg)

    def decode(self, data: bytes, headers: Mapping[str, str] | None = None, *,
               subject: str = "", check_version: bool = True) -> T:
        """Decode `data`; with `check_version`, verify the `rlf-schema` header first."""
        if check_version:
            check_schema_version(headers, subject=subject, type_name=self.type_name)
        try:
            out: T = self._decoder.decode(data)
            return out
        except DECODE_ERRORS as exc:
            # ValueError also covers invalid UTF-8 in a string field
            where = f" on {subject!r}" if subject else ""
            raise MalformedMessage(
                f"cannot decode {self.type_name}{where}: {exc}",
                subject=subject,
                type_name=self.type_name,
            ) from exc


@functools.cache
def codec_for(kind: Any) -> Codec[Any]:
    """The shared, long-lived codec of a message type."""
    return Codec(kind)


def headers(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The headers every rlfabric message carries (plus `extra`)."""
    out = {SCHEMA_HEADER: SCHEMA_VERSION}
    if extra:
        out.update(extra)
    return out


#: encode any rlfabric message: msgspec's own method, without a frame of ours
encode: Callable[[Any], bytes] = msgspec.msgpack.Encoder(enc_hook=_enc_hook).encode


def _schema_hook(kind: type) -> dict[str, Any]:
    if kind in PACKED_TYPES:
        width = "int32" if kind.dtype.kind == "i" else "float32"
        return {
            "type": "string",
            "contentEncoding": "base64",
            "description": f"packed little-endian {width} array (msgpack bin on the wire)",
        }
    raise NotImplementedError(kind)


def json_schema(types: Mapping[str, Any]) -> dict[str, Any]:
    """A JSON Schema document describing every named message type."""
    (schemas, components) = msgspec.json.schema_components(
        list(types.values()), schema_hook=_schema_hook, ref_template="#/$defs/{name}"
    )
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": f"rlfabric wire messages, schema {SCHEMA_VERSION}",
        "description": f"msgpack on the wire; header {SCHEMA_HEADER}: {SCHEMA_VERSION}",
        "messages": dict(zip(types.keys(), schemas, strict=True)),
        "$defs": components,
    }
