"""Every message type round-trips through the codec; versions and bad bytes are rejected."""

from __future__ import annotations

import types
import typing
from typing import Any, Literal

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlfabric.schemas import (
    MESSAGE_TYPES,
    Command,
    MalformedMessage,
    PackedF32,
    PackedI32,
    Pause,
    RolloutReply,
    RolloutResult,
    SchemaError,
    UnknownSchemaVersion,
    codec_for,
    encode,
    headers,
    json_schema,
)

I32 = st.integers(-(2**31), 2**31 - 1)
F32_BITS = st.integers(0, 2**32 - 1).map(
    lambda b: float(np.array([b], dtype="<u4").view("<f4")[0])  # every bit pattern, NaNs too
)


def strategy(tp: Any) -> st.SearchStrategy[Any]:
    """Values of a wire type, built from its annotations (finite floats outside packed arrays,
    where a NaN would not equal itself)."""
    origin = typing.get_origin(tp)
    if tp is PackedI32:
        return st.lists(I32, max_size=40).map(PackedI32)
    if tp is PackedF32:
        return st.lists(F32_BITS, max_size=40).map(PackedF32)
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        fields = msgspec.structs.fields(tp)
        return st.builds(tp, **{f.name: strategy(f.type) for f in fields})
    if tp is bool:
        return st.booleans()
    if tp is int:
        return st.integers(-(2**63), 2**63 - 1)
    if tp is float:
        return st.floats(allow_nan=False)
    if tp is str:
        return st.text(max_size=20)
    if tp is bytes:
        return st.binary(max_size=40)
    if tp is type(None):
        return st.none()
    if origin is Literal:
        return st.sampled_from(typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return st.one_of([strategy(a) for a in typing.get_args(tp)])
    if origin is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return st.lists(strategy(args[0]), max_size=4).map(tuple)
        return st.tuples(*(strategy(a) for a in args))
    if origin is list:
        return st.lists(strategy(typing.get_args(tp)[0]), max_size=4)
    if origin is dict:
        k, v = typing.get_args(tp)
        return st.dictionaries(strategy(k), strategy(v), max_size=3)
    raise NotImplementedError(tp)


@pytest.mark.parametrize("name", sorted(MESSAGE_TYPES))
def test_every_message_round_trips(name: str) -> None:
    kind = MESSAGE_TYPES[name]
    codec = codec_for(kind)

    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(strategy(kind))
    def check(msg: Any) -> None:
        back = codec.decode(codec.encode(msg), headers())
        assert back == msg
        assert type(back) is kind

    check()


@settings(max_examples=200, deadline=None)
@given(st.lists(I32, max_size=300), st.lists(F32_BITS, max_size=300))
def test_packed_arrays_keep_exact_values(ids: list[int], lps: list[float]) -> None:
    msg = RolloutResult(request_id="r", worker_id="w", completion_token_ids=ids, logprobs=lps,
                        finish_reason="length")
    back = codec_for(RolloutReply).decode(encode(msg), headers())
    assert back.completion_token_ids.tolist() == ids
    assert back.completion_token_ids.numpy().dtype == np.dtype("<i4")
    expect = np.array(lps, dtype="<f4")
    # bit-exact, NaN payloads and signed zeros included
    assert back.logprobs.numpy().view("<u4").tolist() == expect.view("<u4").tolist()


def test_numpy_view_does_not_copy() -> None:
    res = codec_for(RolloutReply).decode(
        encode(RolloutResult(request_id="r", worker_id="w", completion_token_ids=[1, 2, 3],
                             logprobs=[-1.0, -2.0, -3.0], finish_reason="stop")),
        headers(),
    )
    view = res.completion_token_ids.numpy()
    assert view.base is not None and not view.flags.writeable
    assert np.shares_memory(view, np.asarray(res.completion_token_ids))


def test_tagged_union_picks_the_type() -> None:
    codec = codec_for(Command)
    back = codec.decode(encode(Pause(cmd_id="c1", mode="keep")), headers())
    assert isinstance(back, Pause) and back.mode == "keep"


def test_unknown_major_version_is_rejected_by_name() -> None:
    data = encode(Pause(cmd_id="c1"))
    with pytest.raises(UnknownSchemaVersion, match=r"rlf-schema 7\.2.*unknown major") as ei:
        codec_for(Command).decode(data, {"rlf-schema": "7.2"}, subject="rl.control.pause")
    assert ei.value.version == "7.2"
    assert "rl.control.pause" in str(ei.value)


def test_newer_minor_version_is_read() -> None:
    back = codec_for(Command).decode(encode(Pause(cmd_id="c1")), {"rlf-schema": "1.9"})
    assert back == Pause(cmd_id="c1")


def test_missing_header_is_a_schema_error() -> None:
    with pytest.raises(SchemaError, match="no 'rlf-schema' header"):
        codec_for(Command).decode(encode(Pause(cmd_id="c1")), {})


def test_garbage_and_wrong_type_say_where() -> None:
    with pytest.raises(MalformedMessage, match="malformed"):
        codec_for(Command).decode(b"\xc1\x00garbage", headers())
    wrong = encode(Pause(cmd_id="c1", mode="keep")).replace(b"keep", b"kee\xa0")
    with pytest.raises(MalformedMessage):
        codec_for(Command).decode(wrong, headers())
    with pytest.raises(MalformedMessage, match=r"`\$\.sampling\.max_tokens`|\$\.sampling"):
        codec_for(MESSAGE_TYPES["RolloutRequest"]).decode(
            msgspec.msgpack.encode({"request_id": "r", "prompt_token_ids": b"",
                                    "sampling": {"max_tokens": "many"}}),
            headers(),
        )


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_decode_or_raise_schema_error(data: bytes) -> None:
    for kind in (Command, RolloutReply, MESSAGE_TYPES["RolloutRequest"]):
        try:
            codec_for(kind).decode(data, headers())
        except SchemaError:
            pass


def test_packed_input_validation() -> None:
    with pytest.raises(ValueError, match="whole number"):
        PackedI32(b"\x00\x01\x02")
    with pytest.raises(ValueError, match="outside int32"):
        PackedI32([2**31])
    with pytest.raises(TypeError, match="integers"):
        PackedI32([1.5])
    assert PackedI32(np.arange(4, dtype=np.int64)).tolist() == [0, 1, 2, 3]


def test_json_schema_covers_every_message() -> None:
    doc = json_schema(MESSAGE_TYPES)
    assert set(doc["messages"]) == set(MESSAGE_TYPES)
    req = doc["$defs"]["RolloutRequest"]["properties"]["prompt_token_ids"]
    assert req["contentEncoding"] == "base64"
