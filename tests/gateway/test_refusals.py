"""What the gateway cannot serve well it refuses at once, before anything is sampled (the
worker's count of served requests does not move), with the official `openai` client: a
max_tokens larger than the context leaves, a request past the per-request budget (over all the
prompts of a completion; a worker's own budget, as a 400 too), a second turn
of a session while one is in flight (on any gateway replica); a request without max_tokens
takes the operator's default; `/ready` is 503 until a worker is a member, while `/health`
reports liveness."""

from __future__ import annotations

import time
from typing import Any

import anyio
import httpx
import pytest

from rlfabric.trainer import FabricClient

openai = pytest.importorskip("openai", reason="the tests drive the gateway with openai")
pytestmark = [pytest.mark.nats, pytest.mark.slow, pytest.mark.timeout(300)]
MODEL = "tinyqwen"
HI = [{"role": "user", "content": "hi"}]


def served(nats_url: str, prefix: str) -> dict[str, int]:
    """Each worker's count of requests served (its `describe`)."""
    async def ask() -> dict[str, int]:
        async with FabricClient.connect(nats_url, prefix=prefix) as fabric:
            rep = await fabric.describe()
            return {w: int(a.detail["served"]) for w, a in rep.acks.items()}
    return anyio.run(ask)


def refused(call: Any) -> tuple[Any, float]:
    t0 = time.monotonic()
    with pytest.raises(openai.BadRequestError) as err:
        call()
    return err.value, time.monotonic() - t0


def test_unbounded_or_oversized_requests_get_400_at_once_and_nothing_is_sampled(
        new_fleet, client, nats_url, prefix) -> None:
    fleet = new_fleet()
    fleet.workers(["w0"], "--max-request-tokens", "32")
    base = fleet.gateway("--default-max-tokens", "5", "--max-request-tokens", "64",
                         "--max-n", "4")
    c = client(base)
    ok = c.chat.completions.create(model=MODEL, messages=HI)  # no max_tokens: the default
    assert 1 <= ok.usage.completion_tokens <= 5
    before = served(nats_url, prefix)
    context = c.models.list().data[0].model_extra["max_model_len"]
    for kw, code, says in (
            ({"max_tokens": 1_000_000_000}, "context_length_exceeded",
             ["1000000000", str(context)]),
            ({"max_completion_tokens": context}, "context_length_exceeded",
             [f"max_completion_tokens={context}"]),
            ({"n": 4, "max_tokens": 17}, "request_too_large", ["4 x 17 = 68", "64"]),
            ({"n": 5, "max_tokens": 1}, "invalid_value", ["n=5", "--max-n"])):
        err, took = refused(lambda kw=kw: c.chat.completions.create(model=MODEL, messages=HI,
                                                                     **kw))
        assert took < 0.5, (kw, took)
        assert err.code == code and all(s in err.message for s in says), (kw, err.message)
    # 4 prompts of 20 tokens each are within the budget, together they are not
    err, took = refused(lambda: c.completions.create(model=MODEL, prompt=["a", "b", "c", "d"],
                                                     max_tokens=20))
    assert took < 0.5 and err.code == "request_too_large", err.message
    assert "4 prompts" in err.message and "80" in err.message, err.message
    assert served(nats_url, prefix) == before  # none of them reached a worker
    # within the gateway's budget, past the worker's own: the worker's refusal, as a 400
    err, _ = refused(lambda: c.chat.completions.create(model=MODEL, messages=HI, max_tokens=40))
    assert err.code == "request_too_large" and "--max-request-tokens" in err.message, \
        err.message


def test_fifty_turns_of_one_session_at_once_sample_one_on_any_replica(
        new_fleet, client, extra, nats_url, prefix) -> None:
    fleet = new_fleet()
    fleet.workers(["w0"])
    bases = [fleet.gateway(), fleet.gateway()]
    sid = "race-1"
    outcomes: list[tuple[int, float, Any]] = []

    async def race() -> None:
        async with FabricClient.connect(nats_url, prefix=prefix) as fabric:
            # the winner's request waits in the paused fleet: every other turn comes while it
            # is in flight, whatever the timing
            assert (await fabric.pause("keep")).ok == ("w0",)
            clients = [openai.AsyncOpenAI(base_url=b, api_key="-", max_retries=0, timeout=120)
                       for b in bases]

            async def turn(i: int) -> None:
                t0 = time.monotonic()
                try:
                    r = await clients[i % 2].chat.completions.create(
                        model=MODEL, messages=HI, max_tokens=8, seed=1,
                        extra_headers={"X-Session-ID": sid})
                    outcomes.append((200, time.monotonic() - t0, r))
                except openai.APIStatusError as exc:
                    outcomes.append((exc.status_code, time.monotonic() - t0, exc))
                    if len(outcomes) == 49:
                        await fabric.resume()

            async with anyio.create_task_group() as tg:
                for i in range(50):
                    tg.start_soon(turn, i)
            for cl in clients:
                await cl.close()

    anyio.run(race)
    ok = [o for o in outcomes if o[0] == 200]
    conflicts = [o for o in outcomes if o[0] == 409]
    assert len(ok) == 1 and len(conflicts) == 49, sorted(o[0] for o in outcomes)
    # the winner is paused until the 49th refusal: a refusal that waited for its turn
    # would never come; the bound only keeps a slow one from passing
    assert all(o[2].code == "session_conflict" and o[1] < 5 for o in conflicts), \
        max(o[1] for o in conflicts)
    assert served(nats_url, prefix) == {"w0": 1}  # one turn sampled
    first = ok[0][2]
    answer = first.choices[0].message
    nxt = client(bases[1]).chat.completions.create(
        model=MODEL, max_tokens=4, extra_headers={"X-Session-ID": sid},
        messages=[*HI, {"role": "assistant", "content": answer.content},
                  {"role": "user", "content": "and?"}])
    p1, c1 = extra(first, "prompt_token_ids"), extra(first.choices[0], "token_ids")
    assert extra(nxt, "prompt_token_ids")[:len(p1) + len(c1)] == p1 + c1  # it continues
    traj = httpx.get(f"{bases[0]}/sessions/{sid}/trajectory", timeout=30)
    assert traj.status_code == 200 and len(traj.json()["segments"]) == 1, traj.text


def test_ready_is_503_until_a_worker_joins_while_health_reports_liveness(
        new_fleet, nats_url, prefix) -> None:
    fleet = new_fleet()
    base = fleet.gateway().removesuffix("/v1")
    assert httpx.get(f"{base}/health", timeout=10).status_code == 200
    r = httpx.get(f"{base}/ready", timeout=10)
    assert r.status_code == 503 and not r.json()["ready"] and "no worker" in r.json()["why"]
    fleet.workers(["w0"])
    deadline = time.monotonic() + 30
    while (r := httpx.get(f"{base}/ready", timeout=10)).status_code != 200:
        assert time.monotonic() < deadline, r.text  # the gateway hears membership changes
        time.sleep(0.1)
    assert r.json() == {"ready": True, "workers": ["w0"]}
    # an engine that loads from a directory (vLLM) names the built-in model by its checkpoint
    from rlfabric.engines import checkpoint_dir

    fleet.workers(["w1"], model=checkpoint_dir(MODEL))
    while (r := httpx.get(f"{base}/ready", timeout=10)).json()["workers"] != ["w0", "w1"]:
        assert time.monotonic() < deadline + 30, r.text
        time.sleep(0.1)


def test_a_stream_cut_by_its_client_releases_the_sessions_turn_and_stops_its_sampling(
        new_fleet, client, nats_url, prefix) -> None:
    fleet = new_fleet()
    fleet.workers(["w0"])
    base = fleet.gateway()
    sid = "cut-1"
    body = {"model": MODEL, "messages": HI, "max_tokens": 2000, "stream": True}
    with httpx.stream("POST", f"{base}/chat/completions", json=body, timeout=60,
                      headers={"X-Session-ID": sid}) as r:
        assert r.status_code == 200
        next(r.iter_lines())  # the first chunk came: the turn is in flight; then hang up
    c = client(base)
    deadline = time.monotonic() + 10
    while True:  # the gateway lets the turn go once it sees the client gone
        try:
            nxt = c.chat.completions.create(model=MODEL, messages=HI, max_tokens=2,
                                            extra_headers={"X-Session-ID": sid})
            break
        except openai.ConflictError:
            assert time.monotonic() < deadline, "the cut stream kept its session's turn"
            time.sleep(0.1)
    assert nxt.choices[0].finish_reason in ("length", "stop")
    assert served(nats_url, prefix) == {"w0": 1}  # the next turn; the cut one stopped
