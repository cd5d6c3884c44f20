"""1,000 simulated workers on a loaded machine: the broker, the workers and the trainer share
the two cores with busy loops, and pause/resume calls go out while a quarter of the workers is
stalled for most of `member_ttl` (their process stopped, as a starved host or a long pause of
the interpreter would). A worker that is alive is never counted as left or joined again: every
call is acked by all 1,000, and the member set the trainer sees never changes once they have
joined."""

from __future__ import annotations

import signal
import subprocess
import sys

import anyio
import pytest

from rlfabric.bus import QuorumPolicy
from rlfabric.schemas import FanoutReport

pytestmark = [pytest.mark.nats, pytest.mark.slow, pytest.mark.anyio, pytest.mark.timeout(400)]

N = 1000
BUSY = 4  # busy loops: the two cores are never idle
CALLS = 6
STALL_S = 4.5  # under member_ttl (5 s), over what the last beat or key write leaves of it


async def test_a_thousand_workers_under_load_neither_leave_nor_join(client, sims) -> None:
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(BUSY)]
    try:
        procs = sims([f"m{i:04d}" for i in range(N)], per_process=250)
        # default TTLs: what a user's fleet runs with
        async with client() as fabric:
            await fabric.wait_for_workers(N, timeout=240)
            joined = fabric.watcher.snapshot()
            # "fail": a join or leave while a call waits raises MembershipChanged
            policy = QuorumPolicy(on_membership_change="fail", timeout=60)
            for i in range(CALLS):
                stalled = procs[i % len(procs)]
                stalled.send_signal(signal.SIGSTOP)
                reps: list[FanoutReport] = []

                async def call(i: int, reps: list[FanoutReport]) -> None:
                    reps.append(await (fabric.pause(mode="wait", policy=policy)
                                       if i % 2 == 0 else fabric.resume(policy=policy)))
                try:
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(call, i, reps)
                        await anyio.sleep(STALL_S)  # the stall itself
                        stalled.send_signal(signal.SIGCONT)
                finally:
                    stalled.send_signal(signal.SIGCONT)
                [rep] = reps
                assert len(rep.ok) == N and not rep.failed and not rep.missing, rep
            after = fabric.watcher.snapshot()
            assert (after.epoch, after.fingerprint) == (joined.epoch, joined.fingerprint)
            assert len(after.members) == N
    finally:
        for p in busy:
            p.kill()
            p.wait(timeout=10)
