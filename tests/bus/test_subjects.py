"""Names on the bus: which strings may be one subject token, and how a live copy's subject
is read back."""

from __future__ import annotations

import pytest

from rlfabric.bus import InvalidName, Subjects
from rlfabric.bus.subjects import check_token, is_token
from rlfabric.schemas import SCHEMA_MAJOR


@pytest.mark.parametrize("value", ["a", "w-0_Z9", "x" * 64])
def test_tokens_that_may_name_things(value: str) -> None:
    assert is_token(value) and check_token(value, "worker id") == value


@pytest.mark.parametrize("value", ["", "x" * 65, "a.b", "a b", "a*", ">", "abc\n", "\nabc",
                                   "é", "a\x00", "a/b"])
def test_tokens_refused(value: str) -> None:
    assert not is_token(value)
    with pytest.raises(InvalidName, match="worker id"):
        check_token(value, "worker id")


def test_ack_subjects() -> None:
    s = Subjects("job")
    assert s.ack("c1") == s.ack_prefix + "c1" == "job.ack.c1"
    with pytest.raises(InvalidName, match="command id"):
        s.ack("c.1")


def test_live_copy_subject_round_trips_and_others_are_not_live_copies() -> None:
    s = Subjects("job")
    assert s.live_parts(s.live_copy("pause", 42)) == (s.live("pause"), SCHEMA_MAJOR, 42)
    for subject in ("1.42", ".1.42", "job.live.pause.x.42", "job.live.pause.1.-2",
                    "job.live.pause.1.4²", "job.live.pause.1."):
        assert s.live_parts(subject) is None, subject
