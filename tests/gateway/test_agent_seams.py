"""Agents as real harnesses drive them, where trajectories went wrong before: an agent that
repeats a tool call (two equal assistant messages in one history), a streamed forced tool call,
and the official client's own retries of a refused turn. `tinychat` (a one-token tool call)
with `tool_choice` "required": every turn is a call, whatever the random-init model samples."""

from __future__ import annotations

import concurrent.futures
from typing import Any

import anyio
import pytest

from rlfabric.bus import Bus
from rlfabric.bus.sessions.log import read_trajectory

pytestmark = [pytest.mark.nats, pytest.mark.slow]
MODEL = "tinychat"
TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "adds the numbers", "parameters": {
        "type": "object", "properties": {}}}}]


@pytest.fixture
def agents(new_fleet) -> Any:
    f = new_fleet()
    f.workers(["s0", "s1"], model=MODEL)
    f.base = f.gateway("--tool-call-parser", "tinychat", model=MODEL)
    return f


def segments(f: Any, sid: str) -> list[tuple[str, int]]:
    """The session's segments as (reason, length), read off the bus as a trainer reads them."""
    async def read() -> Any:
        async with Bus.connect(f.nats, prefix=f.prefix) as bus:
            return await read_trajectory(bus, sid)

    traj = anyio.run(read)
    return [(s.reason, len(s.token_ids)) for s in traj.segments]


def test_a_repeated_tool_call_keeps_each_turns_own_tokens(agents, client, extra) -> None:
    """Two identical calls (same tool and arguments, no content), then the answer: each call
    in the history is rendered from the tokens of its own turn, the trajectory is one
    segment, and every turn's prompt extends the last one exactly."""
    c = client(agents.base)

    def episode(i: int) -> tuple[str, list[Any]]:
        sid = f"repeat-{agents.prefix}-{i}"
        msgs: list[dict[str, Any]] = [{"role": "user", "content": f"{i}+1="}]
        out = []
        for choice, n in (("required", 4), ("required", 4), ("none", 3)):
            r = c.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS,
                                          tool_choice=choice, max_tokens=n, seed=100 * i + n,
                                          extra_headers={"X-Session-ID": sid})
            m = r.choices[0].message
            out.append(r)
            msgs.append(m.model_dump(exclude_none=True))
            msgs += [{"role": "tool", "tool_call_id": tc.id, "content": "2"}
                     for tc in m.tool_calls or ()]
        return sid, out

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        done = list(pool.map(episode, range(16)))
    for sid, (r1, r2, r3) in done:
        calls = [r.choices[0].message.tool_calls for r in (r1, r2)]
        assert all(cs and len(cs) == 1 for cs in calls)
        assert r1.choices[0].message.content == r2.choices[0].message.content is None
        for prev, nxt in ((r1, r2), (r2, r3)):
            head = extra(prev, "prompt_token_ids") + extra(prev.choices[0], "token_ids")
            assert extra(nxt, "prompt_token_ids")[:len(head)] == head, sid
        assert [reason for reason, _ in segments(agents, sid)] == ["new_session"], sid


def test_a_streamed_forced_call_is_the_non_streamed_message(agents, client, extra) -> None:
    """`stream: true` with `tool_choice` "required": the chunks add up to the message the
    same request gets unstreamed (no content, the call, the same token ids), and the next
    turn, sent with the message as streamed, continues the trajectory."""
    c = client(agents.base)
    for i in range(5):
        sid = f"stream-{agents.prefix}-{i}"
        msgs: list[dict[str, Any]] = [{"role": "user", "content": f"{i}+2="}]
        kw = dict(model=MODEL, messages=msgs, tools=TOOLS, tool_choice="required",
                  max_tokens=6, seed=i)
        whole = c.chat.completions.create(**kw)  # a one-turn request: no session
        content, calls, ids = "", {}, []
        for chunk in c.chat.completions.create(**kw, stream=True,
                                               extra_headers={"X-Session-ID": sid}):
            for ch in chunk.choices:
                content += ch.delta.content or ""
                ids += (ch.model_extra or {}).get("token_ids") or []
                for tc in ch.delta.tool_calls or ():
                    calls[tc.index] = (tc.id, tc.function.name, tc.function.arguments)
        m = whole.choices[0].message
        assert content == (m.content or "")
        assert [(n, a) for _, n, a in calls.values()] == \
            [(t.function.name, t.function.arguments) for t in m.tool_calls]
        assert ids == extra(whole.choices[0], "token_ids")
        streamed = {"role": "assistant", "content": content or None, "tool_calls": [
            {"id": cid, "type": "function", "function": {"name": n, "arguments": a}}
            for cid, n, a in calls.values()]}
        nxt = [*msgs, streamed, *({"role": "tool", "tool_call_id": cid, "content": "3"}
                                  for cid, _, _ in calls.values())]
        c.chat.completions.create(model=MODEL, messages=nxt, tools=TOOLS, tool_choice="none",
                                  max_tokens=3, extra_headers={"X-Session-ID": sid})
        assert [reason for reason, _ in segments(agents, sid)] == ["new_session"], sid


def test_a_refused_turn_is_not_retried_into_a_branch(agents) -> None:
    """While a turn of a session streams, 19 more of it from the official client with its
    default retries: each is refused (409, `x-should-retry: false`) and none is sent again
    (a retry landing after the first turn would sample a branch); the session holds one
    turn."""
    import httpx
    import openai

    sent: list[str] = []
    http = httpx.Client(timeout=120.0, event_hooks={"request": [lambda r: sent.append(
        r.url.path)]})
    # the client's defaults: 2 retries of a 409
    retrying = openai.OpenAI(base_url=agents.base, api_key="-", http_client=http)
    sid = f"burst-{agents.prefix}"
    msgs = [{"role": "user", "content": "count"}]
    head = {"X-Session-ID": sid}
    first = retrying.chat.completions.create(model=MODEL, messages=msgs, max_tokens=400,
                                             stream=True, extra_headers=head)
    chunks = iter(first)
    next(chunks)  # the turn is in flight

    def again(_: int) -> int:
        try:
            retrying.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4,
                                             extra_headers=head)
        except openai.ConflictError as exc:
            assert exc.response.headers.get("x-should-retry") == "false"
            return 409
        return 200

    with concurrent.futures.ThreadPoolExecutor(19) as pool:
        statuses = list(pool.map(again, range(19)))
    for _ in chunks:
        pass
    http.close()
    assert statuses == [409] * 19
    assert len(sent) == 20  # the first turn and each refused one, once
    assert [reason for reason, _ in segments(agents, sid)] == ["new_session"]
