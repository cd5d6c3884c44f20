"""Failures fast and named: a dead worker's requests go to another as soon as membership says
it is gone (not at the stream's ack wait); with no worker left a call fails within seconds
saying so; every entry point exits after a connect error."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import anyio
import pytest
from helpers import collect, req

from rlfabric.bus.nats.cluster import free_ports
from rlfabric.schemas import RolloutError, RolloutResult

pytestmark = [pytest.mark.nats, pytest.mark.anyio]


async def test_a_killed_workers_requests_are_served_once_membership_says_it_is_gone(
        client, workers) -> None:
    """The worker holding a call's requests is SIGKILLed mid-generation: the other serves
    them within the liveness window (not after the 15 s ack wait), each once."""
    procs = dict(zip(["k0", "k1"], workers(["k0", "k1"], "--threads", "1"), strict=True))
    async with client() as fabric:
        await fabric.wait_for_workers(2, timeout=60)
        reqs = [req(f"r{i}", [256, i], max_tokens=900, seed=i, temperature=1.0)
                for i in range(8)]  # one message: one worker holds them all
        got: list[RolloutResult | RolloutError] = []
        t_kill = 0.0
        async with anyio.create_task_group() as tg:
            async def consume() -> None:
                got.extend(await collect(fabric, reqs, timeout=60))

            tg.start_soon(consume)
            # the worker serving them, as it reports its load
            snap = await fabric.watcher.wait_until(
                lambda s: any(m.in_flight for m in s.members), timeout=30)
            busy = [m.worker_id for m in snap.members if m.in_flight]
            procs[busy[0]].send_signal(signal.SIGKILL)
            t_kill = time.monotonic()
        took = time.monotonic() - t_kill
    (alive,) = {"k0", "k1"} - {busy[0]}
    print(f"\n{busy[0]} killed holding 8 requests: all answered by {alive} {took:.2f}s later")
    assert sorted(r.request_id for r in got) == sorted(r.request_id for r in reqs)
    assert {r.worker_id for r in got} == {alive}, got
    assert took < 12.0  # member_ttl 5 s + ping, then 900 tokens x 8: far below the 15 s wait


async def test_with_no_worker_left_a_call_fails_within_seconds_naming_it(client, workers
                                                                          ) -> None:
    (proc,) = workers(["n0"], "--threads", "1")
    async with client() as fabric:
        await fabric.wait_for_workers(1, timeout=60)
        reqs = [req(f"r{i}", [256, i], max_tokens=2000, seed=i) for i in range(4)]
        t_kill = 0.0
        got: list[RolloutResult | RolloutError] = []
        async with anyio.create_task_group() as tg:
            async def consume() -> None:
                got.extend(await collect(fabric, reqs, timeout=600))

            tg.start_soon(consume)
            await fabric.watcher.wait_until(lambda s: any(m.in_flight for m in s.members),
                                            timeout=30)
            proc.send_signal(signal.SIGKILL)
            t_kill = time.monotonic()
        took = time.monotonic() - t_kill
    print(f"\nthe last worker killed: {len(got)} errors {took:.2f}s later: {got[0]}")
    assert took <= 10.0
    assert [r.code for r in got] == ["no_workers"] * 4
    assert all(isinstance(r, RolloutError) and "no worker" in r.message for r in got)


@pytest.mark.parametrize("argv", [
    ("worker", "--model", "tiny", "--nats", "URL"), ("status", "--nats", "URL"),
    ("gateway", "--model", "tinychat", "--nats", "URL"), ("ctl", "--nats", "URL", "describe")],
    ids=lambda a: a[0])
def test_every_entry_point_exits_after_a_connect_error(argv: tuple[str, ...]) -> None:
    if argv[0] == "gateway":
        pytest.importorskip("starlette", reason="the gateway extra is not installed")
    (port,) = free_ports(1)
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "rlfabric",
                           *(f"nats://127.0.0.1:{port}" if a == "URL" else a for a in argv)],
                          capture_output=True, text=True, timeout=30)
    took = time.monotonic() - t0
    print(f"\nrlfabric {argv[0]} at a port nobody listens on: exit {done.returncode} after "
          f"{took:.1f}s (the first connect waits 5 s; the rest is imports)")
    assert done.returncode != 0 and took <= 20.0, (took, done.stderr[-2000:])
    assert "Traceback" not in done.stderr
    assert f"rlfabric nats --port {port}" in done.stderr  # the server to start: this one's
