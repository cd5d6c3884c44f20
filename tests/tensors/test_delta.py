"""Weight deltas: a real AdamW step between two versions of a real model, in fp32 and bf16,
packed; the delta applied to the base gives the new buffer bit for bit (its digest the full
push's), is a fraction of its size, skips what did not change, and refuses, naming why, a base
it was not made against or a damaged piece."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlfabric.schemas import ErrorCode
from rlfabric.tensors import DeltaRefused
from rlfabric.tensors.delta import apply, encode, header, revert
from rlfabric.tensors.models import build_model
from rlfabric.tensors.packing import digest, pack_into, plan


def _packed(state: dict[str, torch.Tensor]) -> tuple[tuple, bytearray]:
    metas, size = plan(state)
    buf = bytearray(size)
    pack_into(state, metas, buf)
    return metas, buf


def _stepped(dtype: torch.dtype, lr: float) -> tuple[tuple, bytearray, bytearray]:
    """The tiny model packed before and after one AdamW step on seeded data."""
    model = build_model("tiny", dtype=dtype)
    metas, base = _packed(model.state_dict())
    model.train()
    x = torch.randint(3, 200, (2, 16), generator=torch.Generator().manual_seed(0))
    model(x, labels=x).loss.backward()
    # the embedding alone is frozen: a tensor that does not change is not sent
    model.get_input_embeddings().weight.grad = None
    torch.optim.AdamW([p for p in model.parameters() if p.grad is not None], lr=lr).step()
    _, new = _packed(model.state_dict())
    return metas, base, new


# an AdamW step moves every element: bf16 keeps most bit patterns, fp32 only their high bytes
@pytest.mark.parametrize(("dtype", "share"), [(torch.float32, 0.6), (torch.bfloat16, 0.2)])
def test_a_step_applied_as_a_delta_is_the_new_buffer_bit_for_bit(dtype: torch.dtype,
                                                                   share: float) -> None:
    metas, base, new = _stepped(dtype, 1e-5)
    delta = encode(base, new, metas, base_digest=digest(base), pays_below=1.0)
    assert delta is not None
    # encoded on 3 threads, tensor by tensor: the same bytes
    assert encode(base, new, metas, base_digest=digest(base), pays_below=1.0, threads=3) == delta
    got = apply(base, delta, base_digest=digest(base))
    assert got == new and digest(got) == digest(new)
    assert len(delta) < share * len(new)
    head, _ = header(delta)
    embed = next(m for m in metas if "embed_tokens" in m.name)
    changed = {p.offset for p in head.pieces}
    assert embed.offset not in changed  # unchanged: not sent
    assert len(changed) == sum(not torch.equal(_t(base, m), _t(new, m)) for m in metas)


def _t(buf: bytearray, m) -> torch.Tensor:
    return torch.frombuffer(buf, dtype=torch.uint8, count=m.nbytes, offset=m.offset) \
        if m.nbytes else torch.empty(0)


def test_a_delta_against_another_base_is_refused_naming_both() -> None:
    metas, base, new = _stepped(torch.bfloat16, 1e-5)
    delta = encode(base, new, metas, base_digest=digest(base))
    assert delta is not None
    other = bytearray(new)  # e.g. a worker one version ahead
    with pytest.raises(DeltaRefused) as got:
        apply(other, delta, base_digest=digest(other))
    assert got.value.code == ErrorCode.DELTA_BASE_MISSING
    assert digest(base) in str(got.value) and digest(other) in str(got.value)
    assert other == new  # untouched


def test_a_damaged_piece_is_refused_and_the_base_kept() -> None:
    metas, base, new = _stepped(torch.bfloat16, 1e-5)
    delta = bytearray(encode(base, new, metas, base_digest=digest(base)) or b"")
    kept = bytes(base)
    delta[-20] ^= 0xFF  # inside the last piece's compressed bytes
    with pytest.raises(DeltaRefused) as got:
        apply(base, delta, base_digest=digest(base))
    assert got.value.code == ErrorCode.DIGEST_MISMATCH and "damaged" in str(got.value)
    assert bytes(base) == kept
    with pytest.raises(DeltaRefused, match="delta mark"):
        apply(base, b"not a delta at all", base_digest=digest(base))
    with pytest.raises(DeltaRefused, match="outside"):
        apply(base, bytes(delta[:-100]), base_digest=digest(base))  # cut short


def test_applied_in_place_and_reverted_and_a_damaged_one_leaves_the_base() -> None:
    metas, base, new = _stepped(torch.bfloat16, 1e-5)
    kept, d = bytes(base), digest(base)
    delta = encode(base, new, metas, base_digest=d)
    assert delta is not None
    buf = bytearray(base)
    assert apply(buf, delta, base_digest=d, in_place=True) is buf and buf == new
    revert(buf, delta)
    assert buf == kept
    damaged = bytearray(delta)
    damaged[-20] ^= 0xFF  # the last piece: those before it are applied, then undone
    with pytest.raises(DeltaRefused, match="damaged"):
        apply(buf, damaged, base_digest=d, in_place=True)
    assert buf == kept


def test_a_delta_that_would_not_pay_is_none() -> None:
    g = torch.Generator().manual_seed(1)
    a = {"w": torch.randn(4096, generator=g)}
    b = {"w": torch.randn(4096, generator=g)}  # every element changed, at random
    metas, base = _packed(a)
    _, new = _packed(b)
    assert encode(base, new, metas, base_digest=digest(base)) is None
    assert encode(base, new, metas, base_digest=digest(base), pays_below=2.0) is not None


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 999), st.floats(-4, 4)),
                max_size=30))
def test_any_sparse_change_round_trips(changes: list[tuple[int, int, float]]) -> None:
    state = {"a": torch.zeros(1000), "b": torch.ones(37, dtype=torch.bfloat16),
             "c": torch.arange(1000, dtype=torch.float32)}
    metas, base = _packed(state)
    names = list(state)
    for which, i, v in changes:
        t = state[names[which]]
        t[i % t.numel()] = v
    _, new = _packed(state)
    delta = encode(base, new, metas, base_digest="b0", pays_below=10.0)
    assert delta is not None
    assert apply(base, delta, base_digest="b0") == new
