"""Broadcast with quorum against real responder processes on a real nats-server."""

from __future__ import annotations

import signal
import time

import anyio
import pytest

from rlfabric.bus import (
    Bus,
    MembershipChanged,
    QuorumNotReached,
    QuorumPolicy,
    new_cmd_id,
    new_worker_info,
)
from rlfabric.schemas import Describe, Pause, Resume, encode

pytestmark = [pytest.mark.nats, pytest.mark.anyio]


@pytest.mark.parametrize("n", [1, 8, 32])
async def test_quorum_reached_with_n_responders(fabric, sims, n: int) -> None:
    ids = [f"w{i:03d}" for i in range(n)]
    sims(ids)
    async with fabric() as (_bus, watcher, bc, _tg):
        await watcher.wait_until(lambda s: set(s.worker_ids) == set(ids), timeout=60)
        rep = await bc.broadcast(Pause(cmd_id=new_cmd_id(), mode="wait"), QuorumPolicy(timeout=20))
        assert rep.ok == tuple(ids)
        assert rep.failed == () and rep.missing == () and rep.dead == ()
        assert rep.op == "pause" and set(rep.acks) == set(ids)
        assert all(a.status == "ok" and a.cmd_id == rep.cmd_id for a in rep.acks.values())
        # a second command goes through the same ordered path
        rep2 = await bc.broadcast(Resume(cmd_id=new_cmd_id()), QuorumPolicy(timeout=20))
        assert rep2.ok == tuple(ids)


async def _kill_during_pause(fabric, sims, policy: QuorumPolicy):
    fast = ["a0", "a1", "a2"]
    sims(fast)
    (victim,) = sims(["v0"], "pause=30")
    async with fabric() as (bus, watcher, bc, _tg):
        await watcher.wait_until(lambda s: set(s.worker_ids) == {*fast, "v0"}, timeout=60)
        handling = anyio.Event()

        async def on_state(msg) -> None:
            handling.set()

        await bus.nc.subscribe(bus.subjects.events("state", "v0"), cb=on_state)
        async with bc.open(Pause(cmd_id=new_cmd_id(), mode="wait")) as fo:
            with anyio.fail_after(20):
                await handling.wait()  # v0 is inside its pause handler now
            victim.send_signal(signal.SIGKILL)
            t_kill = time.monotonic()
            try:
                rep = await fo.wait("done", policy)
                return rep, None, time.monotonic() - t_kill, watcher.snapshot()
            except MembershipChanged as exc:
                return None, exc, time.monotonic() - t_kill, watcher.snapshot()


async def test_sigkilled_responder_is_missing_within_1s_and_fail_raises(fabric, sims) -> None:
    policy = QuorumPolicy(timeout=20, on_membership_change="fail")
    rep, exc, detect_s, after = await _kill_during_pause(fabric, sims, policy)
    assert rep is None and exc is not None
    assert detect_s < 1.0, f"found dead after {detect_s:.2f}s (member TTL is 5s)"
    assert exc.left == ("v0",) and exc.joined == ()
    assert "v0" in exc.report.missing and exc.report.dead == ("v0",)
    assert "v0" not in after.worker_ids  # the watcher dropped it without waiting for the TTL


async def test_sigkilled_responder_under_shrink_completes_with_the_rest(fabric, sims) -> None:
    policy = QuorumPolicy(timeout=20, on_membership_change="shrink")
    rep, exc, detect_s, _ = await _kill_during_pause(fabric, sims, policy)
    assert exc is None and rep is not None
    assert detect_s < 1.0
    assert rep.ok == ("a0", "a1", "a2")
    assert rep.missing == ("v0",) and rep.dead == ("v0",)


async def test_a_worker_that_dies_with_a_ping_unanswered_is_found_by_the_next_ping(
        fabric, sims, nats_url: str, prefix: str) -> None:
    """A hung worker (its event loop stuck in a long load) holds the probe's ping; when it is
    then killed, the next ping finds it gone, `probe_interval` later, not `ping_timeout`."""
    sims(["h0", "h1"])
    # its key outlives the test (no expiry to find it by): only a ping can tell it is gone
    async with fabric(member_ttl=60) as (_bus, watcher, bc, tg), \
            Bus.connect(nats_url, prefix=prefix) as hung:
        pinged = anyio.Event()

        async def swallow(msg) -> None:  # never answers, as a stuck worker does not
            pinged.set()

        await hung.nc.subscribe(hung.subjects.ping("stuck"), cb=swallow)
        await hung.nc.flush()
        await hung.buckets.members.put("stuck", encode(new_worker_info(
            "stuck", engine="sim", model="none")))
        await watcher.wait_until(lambda s: set(s.worker_ids) == {"h0", "h1", "stuck"},
                                 timeout=60)
        policy = QuorumPolicy(timeout=20, on_membership_change="fail", probe_interval=0.2,
                              ping_timeout=5.0)
        outcome: list[object] = []
        finished = anyio.Event()
        async with bc.open(Pause(cmd_id=new_cmd_id(), mode="wait")) as fo:

            async def wait_done() -> None:
                try:
                    outcome.append(await fo.wait("done", policy))
                except MembershipChanged as exc:
                    outcome.append(exc)
                finished.set()

            tg.start_soon(wait_done)
            with anyio.fail_after(10):
                await pinged.wait()  # the first ping is in flight, unanswered
            await hung.nc.close()  # the process is gone, its subscriptions with it
            t_kill = time.monotonic()
            with anyio.fail_after(20):
                await finished.wait()
            detect = time.monotonic() - t_kill
    (exc,) = outcome
    assert isinstance(exc, MembershipChanged), exc
    assert exc.left == ("stuck",) and exc.report.dead == ("stuck",)
    assert detect < 2.0, f"found dead after {detect:.2f}s; its first ping times out after 5s"


async def test_count_and_fraction_policies(fabric, sims) -> None:
    ids = ["f0", "f1", "f2", "s0"]
    sims(["f0", "f1", "f2"])
    sims(["s0"], "describe=30")
    async with fabric() as (_bus, watcher, bc, _tg):
        await watcher.wait_until(lambda s: set(s.worker_ids) == set(ids), timeout=60)
        rep = await bc.broadcast(Describe(cmd_id=new_cmd_id()),
                                 QuorumPolicy(required=3, timeout=10))
        assert rep.ok == ("f0", "f1", "f2") and rep.missing == ("s0",) and rep.dead == ()
        rep = await bc.broadcast(Describe(cmd_id=new_cmd_id()),
                                 QuorumPolicy(required=0.75, timeout=10))
        assert len(rep.ok) == 3
        # all four can not be had in 0.8 s: s0 is alive (answers pings) but slow
        t0 = time.monotonic()
        with pytest.raises(QuorumNotReached, match=r"timed out.*missing: s0") as ei:
            await bc.broadcast(Describe(cmd_id=new_cmd_id()), QuorumPolicy(timeout=0.8))
        assert 0.7 < time.monotonic() - t0 < 5
        assert ei.value.report.missing == ("s0",) and ei.value.report.dead == ()
        # more than there are members: lost from the start, said at the timeout with what each
        # member did (s0 is still busy)
        with pytest.raises(QuorumNotReached, match=r"quorum of 5 done acks cannot be met: "
                                                   r"3 ok; missing: s0") as ei:
            await bc.broadcast(Describe(cmd_id=new_cmd_id()),
                               QuorumPolicy(required=5, timeout=1.0))
        assert ei.value.report.ok == ("f0", "f1", "f2") and ei.value.report.failed == ()


async def test_no_members_raises(fabric) -> None:
    async with fabric() as (_bus, _watcher, bc, _tg):
        with pytest.raises(QuorumNotReached, match="no workers were members"):
            await bc.broadcast(Pause(cmd_id=new_cmd_id()), QuorumPolicy(timeout=2))


def test_policy_validation_names_the_field() -> None:
    with pytest.raises(ValueError, match=r"QuorumPolicy.required=1.5"):
        QuorumPolicy(required=1.5)
    with pytest.raises(ValueError, match=r"QuorumPolicy.timeout"):
        QuorumPolicy(timeout=0)
    with pytest.raises(ValueError, match=r"on_membership_change"):
        QuorumPolicy(on_membership_change="ignore")  # type: ignore[arg-type]
    assert QuorumPolicy(required=0.5).needed(5) == 3
