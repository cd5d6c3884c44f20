"""`check_request` refuses a prompt holding a negative token id, whatever its length, and
names the lowest; it passes every prompt of ids in range. Its one-pass check passes exactly
what the field-by-field checks pass, bound by bound."""

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


FIELD_VALUES = {  # each field around its bounds, plain-typed as a decoded request holds it
    "request_id": ["r", "", "x" * 256, "x" * 257, "a\nb"],
    "ids": [[1], [], [0, 2**31 - 1], [3, -1]],
    "n": [0, 1, 1024, 1025, True],
    "max_tokens": [0, 1, 1 << 20, (1 << 20) + 1],
    "top_k": [-1, 0, 2**31 - 1, 2**31],
    "logprobs": [-1, 0, 20, 21],
    "seed": [None, -1, 0, 2**63 - 1, 2**63],
    "temperature": [0.0, 1.0, -0.5, float("nan"), float("inf")],
    "top_p": [0.0, 0.5, 1.0, 1.5, float("nan")],
    "stop_token_ids": [(), (5,), (-5,)],
    "min_weight_version": [-2, -1, 0, 2**63],
    "deadline": [0.0, 1e9, -1.0, float("inf")],
    "adapter": ["", "qv"],
    "adapter_version": [-1, 0, 3],
    "metadata": [{}, {"k": "v"}],
}
VALID = {"request_id": "r", "ids": [1], "n": 1, "max_tokens": 1, "top_k": 0, "logprobs": 0,
         "seed": None, "temperature": 1.0, "top_p": 1.0, "stop_token_ids": (),
         "min_weight_version": 0, "deadline": 0.0, "adapter": "", "adapter_version": -1,
         "metadata": {}}


def _build(f: dict) -> RolloutRequest:
    return RolloutRequest(
        request_id=f["request_id"], prompt_token_ids=PackedI32(f["ids"]),
        sampling=SamplingParams(n=f["n"], max_tokens=f["max_tokens"], top_k=f["top_k"],
                                logprobs=f["logprobs"], seed=f["seed"],
                                temperature=f["temperature"], top_p=f["top_p"],
                                stop_token_ids=f["stop_token_ids"]),
        min_weight_version=f["min_weight_version"], deadline=f["deadline"],
        adapter=f["adapter"], adapter_version=f["adapter_version"], metadata=f["metadata"])


def _agree(f: dict) -> None:
    """`check_request` first tries every bound at once and only then names the failing field:
    a request the one pass lets through must pass every field check, and plain values it
    refuses must fail one (stop ids, an adapter and metadata it leaves to the field checks)."""
    from rlfabric.schemas.validation import _first_invalid, _plainly_valid

    req = _build(f)
    try:
        _first_invalid(req)
        valid = True
    except InvalidRequest:
        valid = False
    if _plainly_valid(req):
        assert valid, f
    elif not (f["stop_token_ids"] or f["adapter"] or f["metadata"]):
        assert not valid, f
    try:
        check_request(req)
        assert valid, f
    except InvalidRequest:
        assert not valid, f


@pytest.mark.parametrize(("field", "value"), [
    (field, value) for field, values in FIELD_VALUES.items() for value in values])
def test_the_one_pass_check_agrees_with_the_field_checks_on_each_bound(field: str,
                                                                      value: object) -> None:
    from rlfabric.schemas.validation import _plainly_valid

    assert _plainly_valid(_build(VALID))
    _agree(VALID | {field: value})


@given(st.fixed_dictionaries({k: st.sampled_from(v) for k, v in FIELD_VALUES.items()}))
def test_the_one_pass_check_agrees_with_the_field_checks_on_any_mix(f: dict) -> None:
    _agree(f)
