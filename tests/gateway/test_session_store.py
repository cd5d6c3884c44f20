"""A turn the gateway answered is stored: `SessionStore.record` returns (and the response goes
out) only once its record is, so a gateway killed right after answering has lost no turn."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import anyio

from rlfabric.bus import Bus
from rlfabric.bus.sessions.log import read_trajectory

# two turns recorded (the first write of a connection is stored another way than the next
# ones), then the process dies at once: no task of it runs after (as with a SIGKILL right
# after the response)
_RECORD_THEN_DIE = textwrap.dedent("""
    import os, sys
    import anyio
    from rlfabric.bus import Bus
    from rlfabric.gateway.sessions import SessionStore
    from rlfabric.schemas import SessionTurn, TurnChoice

    def turn(n, added, sampled, reason):
        return SessionTurn(session_id=sys.argv[3], turn=n, added=added, reason=reason,
                           branch=-1 if n == 0 else 0, choices=(TurnChoice(
                               completion_token_ids=sampled, logprobs=[-0.5] * len(sampled)),))

    async def main():
        async with Bus.connect(sys.argv[1], prefix=sys.argv[2]) as bus:
            async with anyio.create_task_group() as tg:
                store = SessionStore(bus, writer="gw-test")
                await tg.start(store.run)
                s = store.entry(sys.argv[3])
                await store.open(s)
                await store.record(s, turn(0, [1, 2, 3], [4, 5], "new_session"),
                                   planned_on=s.changes)
                await store.record(s, turn(1, [6], [7, 8], ""), planned_on=s.changes)
                os._exit(0)

    anyio.run(main)
""")


def test_a_recorded_turn_survives_the_gateway_dying_right_after(nats_url: str, prefix: str
                                                                ) -> None:
    sid = "killed-after-answering"
    subprocess.run([sys.executable, "-c", _RECORD_THEN_DIE, nats_url, prefix, sid],
                   check=True, timeout=60)

    async def read() -> object:
        async with Bus.connect(nats_url, prefix=prefix) as bus:
            with anyio.fail_after(10):
                return await read_trajectory(bus, sid)

    traj = anyio.run(read)
    assert traj is not None and len(traj.segments) == 1
    seg = traj.segments[0]
    assert seg.token_ids.tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    assert seg.loss_mask.tolist() == [0, 0, 0, 1, 1, 0, 1, 1]
