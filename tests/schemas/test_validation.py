"""`check_request` refuses a prompt holding a negative token id, whatever its length, and
names the lowest; it passes every prompt of ids in range."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rlfabric.schemas import PackedI32, RolloutRequest, SamplingParams
from rlfabric.schemas.validation import InvalidRequest, check_request

I32 = st.integers(-(2**31), 2**31 - 1)


def request(ids: list[int]) -> RolloutRequest:
    return RolloutRequest(request_id="r", prompt_token_ids=PackedI32(ids),
                          sampling=SamplingParams(max_tokens=1))


@given(st.lists(I32, min_size=1, max_size=3000))
def test_a_prompt_is_refused_exactly_when_an_id_is_negative(ids: list[int]) -> None:
    if min(ids) < 0:
        with pytest.raises(InvalidRequest, match=rf"prompt token id {min(ids)} is negative"):
            check_request(request(ids))
    else:
        check_request(request(ids))


@pytest.mark.parametrize("bad", [-1, -(2**31), -256, -(2**24)])
def test_one_negative_id_anywhere_in_a_long_prompt_is_found(bad: int) -> None:
    for at in (0, 4095, 9999):
        ids = [2**31 - 1, 255, 256, 2**24] * 2500
        ids[at] = bad
        with pytest.raises(InvalidRequest, match=rf"token id {bad} is negative"):
            check_request(request(ids))
    check_request(request([2**31 - 1, 255, 256, 2**24, 0] * 2000))


def test_an_adapter_version_needs_an_adapter_and_a_name_is_bounded() -> None:
    import msgspec

    base = request([1, 2])
    check_request(msgspec.structs.replace(base, adapter="qv", adapter_version=3))
    with pytest.raises(InvalidRequest, match=r"adapter_version=3.*\[-1, -1\]"):
        check_request(msgspec.structs.replace(base, adapter_version=3))
    with pytest.raises(InvalidRequest, match=r"adapter 'x.*printable"):
        check_request(msgspec.structs.replace(base, adapter="x" * 300))
