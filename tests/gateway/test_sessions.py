"""Agent sessions through the gateway, driven by the official openai client: exact tokens
across turns (and how often a naive server gets them wrong), forks and retries, streaming, two
gateways and a restart, and a fleet serving its checkpoint with no trainer attached."""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anyio
import httpx
import pytest

from rlfabric.bus import Bus
from rlfabric.bus.sessions.log import read_trajectory
from rlfabric.schemas import checkpoint_policy

pytestmark = [pytest.mark.nats, pytest.mark.slow]
MODEL = "tinyqwen"


def _turn(c: Any, sid: str, messages: list[dict[str, Any]], **kw: Any) -> Any:
    kw.setdefault("max_tokens", 8)
    return c.chat.completions.create(model=MODEL, messages=messages,
                                     extra_headers={"X-Session-ID": sid}, **kw)


def _reply(r: Any, i: int = 0) -> dict[str, Any]:
    """The assistant message as an agent sends it back (the SDK's own dump)."""
    return r.choices[i].message.model_dump(exclude_none=True)


def _trajectory(base: str, sid: str) -> dict[str, Any]:
    got = httpx.get(f"{base}/sessions/{sid}/trajectory", timeout=30)
    assert got.status_code == 200, got.text
    return got.json()


def _extends(extra: Any, before: Any, after: Any, i: int = 0) -> bool:
    """`after`'s prompt starts with `before`'s prompt + the tokens sampled for choice `i`."""
    head = extra(before, "prompt_token_ids") + extra(before.choices[i], "token_ids")
    return extra(after, "prompt_token_ids")[:len(head)] == head


def test_first_request_is_served_from_the_checkpoint_with_no_weight_push(fleet, client, extra):
    base = next(iter(fleet.gateways))
    r = client(base).chat.completions.create(model=MODEL, max_tokens=4,
                                             messages=[{"role": "user", "content": "hi"}])
    ids = extra(r.choices[0], "token_ids")
    assert len(ids) == r.usage.completion_tokens == 4

    async def state() -> tuple[Any, Any]:
        async with Bus.connect(fleet.nats, prefix=fleet.prefix) as bus:
            return await bus.state.read(), await bus.state.checkpoint_claim()

    desired, claim = anyio.run(state)
    assert desired.locator is None and desired.weight_version == -1  # nobody pushed
    assert claim is not None and claim.model == MODEL
    # named as the checkpoint the fleet serves, by its weights checksum
    assert extra(r.choices[0], "weight_versions") == [
        {"version": 0, "start": 0, "end": 4, "policy": checkpoint_policy(claim.checksum)}]


def test_naive_retokenization_differs_where_the_gateway_is_exact(fleet, client, extra,
                                                                chat_format):
    fmt = chat_format()
    base = next(iter(fleet.gateways))
    c = client(base)
    sessions, turns = 50, 3
    naive_bad = exact_bad = checked = 0

    def one(s: int) -> tuple[int, int, int]:
        sid = f"naive-{fleet.prefix}-{s}"
        msgs: list[dict[str, Any]] = [{"role": "user", "content": f"session {s}: go"}]
        prev = None
        bad_naive = bad_exact = n = 0
        for t in range(turns):
            r = _turn(c, sid, msgs, seed=1000 * s + t, temperature=1.0, max_tokens=10)
            if prev is not None:
                n += 1
                bad_exact += not _extends(extra, prev, r)
                # what a server that re-tokenizes the text history would have sent
                head = extra(prev, "prompt_token_ids") + extra(prev.choices[0], "token_ids")
                naive = fmt.encode(fmt.render(msgs, add_generation_prompt=True))
                bad_naive += naive[:len(head)] != head
            msgs = [*msgs, _reply(r), {"role": "user", "content": f"turn {t + 1}"}]
            prev = r
        traj = _trajectory(base, sid)
        assert [s["reason"] for s in traj["segments"]] == ["new_session"]
        return bad_naive, bad_exact, n

    with ThreadPoolExecutor(16) as pool:  # sessions side by side, as a harness runs episodes
        results = list(pool.map(one, range(sessions)))
    for a, b, n in results:
        naive_bad, exact_bad, checked = naive_bad + a, exact_bad + b, checked + n
    print(f"\nturns whose prompt re-tokenized from the text history differs from the sampled "
          f"ids: naive {naive_bad} of {checked}, gateway {exact_bad} of {checked}")
    assert checked == sessions * (turns - 1)
    assert exact_bad == 0
    assert naive_bad > checked // 4  # the exactness is not vacuous on this model


def test_stream_arrives_while_sampled_and_equals_the_completion(fleet, client, extra):
    base = next(iter(fleet.gateways))
    c = client(base)
    msgs = [{"role": "user", "content": "count to sixty-four"}]
    kw = {"model": MODEL, "messages": msgs, "max_tokens": 64, "seed": 7, "temperature": 1.0}
    whole = c.chat.completions.create(**kw)
    t0 = time.monotonic()
    first = None
    text, ids, finish = "", [], None
    for chunk in c.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        got = (ch.model_extra or {}).get("token_ids") or []
        if got and first is None:
            first = time.monotonic() - t0
        ids += got
        text += ch.delta.content or ""
        finish = ch.finish_reason or finish
    total = time.monotonic() - t0
    assert extra(whole.choices[0], "token_ids") == ids and len(ids) == 64
    assert whole.choices[0].message.content == text and whole.choices[0].finish_reason == finish
    print(f"\nfirst tokens after {first * 1e3:.0f} ms of {total * 1e3:.0f} ms")
    assert first is not None and first < total / 2


def test_forked_turn_continues_the_choice_sent_back(fleet, client, extra):
    base = next(iter(fleet.gateways))
    c = client(base)
    sid = f"fork-{fleet.prefix}"
    msgs = [{"role": "user", "content": "two ways"}]
    r1 = _turn(c, sid, msgs, n=2, seed=3)
    assert len(r1.choices) == 2
    r2 = _turn(c, sid, [*msgs, _reply(r1, 1), {"role": "user", "content": "go on"}])
    assert _extends(extra, r1, r2, i=1)
    segs = _trajectory(base, sid)["segments"]
    assert [s["reason"] for s in segs] == ["branch", "new_session"]
    branch, live = segs
    assert branch["token_ids"] == extra(r1, "prompt_token_ids") + extra(r1.choices[0],
                                                                          "token_ids")
    assert sum(live["loss_mask"]) == len(extra(r1.choices[1], "token_ids")) + len(
        extra(r2.choices[0], "token_ids"))


def test_a_retried_request_samples_the_same_prompt_again(fleet, client, extra):
    base = next(iter(fleet.gateways))
    c = client(base)
    sid = f"retry-{fleet.prefix}"
    msgs = [{"role": "user", "content": "again"}]
    r1 = _turn(c, sid, msgs, seed=1)
    r2 = _turn(c, sid, msgs, seed=2)  # a harness's retry after a timeout
    assert extra(r2, "prompt_token_ids") == extra(r1, "prompt_token_ids")
    r3 = _turn(c, sid, [*msgs, _reply(r2), {"role": "user", "content": "next"}])
    assert _extends(extra, r2, r3)
    segs = _trajectory(base, sid)["segments"]
    assert [s["reason"] for s in segs] == ["branch", "new_session"]


def test_an_assistant_message_the_session_never_produced_starts_a_segment(fleet, client,
                                                                         extra):
    base = next(iter(fleet.gateways))
    c = client(base)
    sid = f"edit-{fleet.prefix}"
    msgs = [{"role": "user", "content": "hello"}]
    r1 = _turn(c, sid, msgs)
    forged = {"role": "assistant", "content": "something the model never said"}
    r2 = _turn(c, sid, [*msgs, forged, {"role": "user", "content": "and?"}])
    assert r2.choices[0].message is not None
    segs = _trajectory(base, sid)["segments"]
    assert [s["reason"] for s in segs] == ["new_session", "assistant_not_sampled"]
    assert segs[0]["token_ids"] == extra(r1, "prompt_token_ids") + extra(r1.choices[0],
                                                                           "token_ids")


def test_turns_alternate_between_gateways_and_survive_a_restart(fleet, client, extra):
    a = next(iter(fleet.gateways))
    b = fleet.gateway()
    sid = f"two-{fleet.prefix}"
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "start"}]
    prev = None
    for t, base in enumerate([a, b, a, b]):
        r = _turn(client(base), sid, msgs, seed=t)
        if prev is not None:
            assert _extends(extra, prev, r), f"turn {t} on {base}"
        msgs = [*msgs, _reply(r), {"role": "user", "content": f"turn {t + 1}"}]
        prev = r
    proc = fleet.gateways.pop(b)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    b2 = fleet.gateway()  # a fresh process: it knows the session only from the bus
    r = _turn(client(b2), sid, msgs, seed=9)
    assert _extends(extra, prev, r)
    traj = _trajectory(b2, sid)
    assert [s["reason"] for s in traj["segments"]] == ["new_session"] and traj["turns"] == 5

    async def off_the_bus() -> Any:
        async with Bus.connect(fleet.nats, prefix=fleet.prefix) as bus:
            return await read_trajectory(bus, sid)

    seg = anyio.run(off_the_bus).segments[0]
    assert seg.token_ids.tolist() == traj["segments"][0]["token_ids"]
    assert seg.loss_mask.tolist() == traj["segments"][0]["loss_mask"]


def test_a_template_that_drops_reasoning_starts_segments_and_counts_them(fleet, client,
                                                                       extra, tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    base = fleet.gateway("--chat-template", "chatml-think", "--metrics", str(metrics))
    c = client(base)
    sid = f"think-{fleet.prefix}"
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "think quietly"}]
    kw = {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}
    rs = []
    for t in range(3):
        r = _turn(c, sid, msgs, seed=t, **kw)
        msgs = [*msgs, _reply(r), {"role": "user", "content": f"more {t}"}]
        rs.append(r)
    segs = _trajectory(base, sid)["segments"]
    assert [s["reason"] for s in segs] == ["new_session"] + ["template_rewrote_history"] * 2
    for seg, r in zip(segs, rs, strict=True):  # each segment exact within itself
        sampled = extra(r.choices[0], "token_ids")
        assert seg["token_ids"] == extra(r, "prompt_token_ids") + sampled
        assert sum(seg["loss_mask"]) == len(sampled)
    proc = fleet.gateways.pop(base)
    proc.send_signal(signal.SIGTERM)  # the metrics file is written at exit
    proc.wait(timeout=30)
    counted = _segments_counted(metrics.read_text())
    assert counted.get("template_rewrote_history") == 2


def _segments_counted(text: str) -> dict[str, int]:
    import json

    counts: dict[str, int] = {}
    for line in text.splitlines():
        for rm in json.loads(line).get("resource_metrics", []):
            for sm in rm.get("scope_metrics", []):
                for m in sm.get("metrics", []):
                    if m["name"] != "rlfabric.gateway.segments":
                        continue
                    for p in m["data"]["data_points"]:
                        counts[p["attributes"]["reason"]] = int(p["value"])
    return counts
