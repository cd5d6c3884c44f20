"""Every node of the cluster killed at once (SIGKILL) and restarted on its store, a coordinated
crash: what JetStream acknowledged before it (1,000 queued rollout requests, a weight push,
the desired state) is there after it, and every request is answered exactly once. Run with
durability `always` (flushed before each acknowledgement) and with the server's default (every
two minutes). A SIGKILL leaves what the server wrote in the kernel's page cache, which reaches
the disk anyway: what `always` adds, surviving the machine itself losing power, no test here
can show. The counts and recovery times are printed (-s)."""

from __future__ import annotations

import time
from collections import Counter

import anyio
import pytest
from helpers import req
from tally import Commands

from rlfabric.bus import QuorumPolicy
from rlfabric.schemas import RolloutError, RolloutReply
from rlfabric.tensors.models import build_model
from rlfabric.trainer import FabricClient

pytestmark = [pytest.mark.nats, pytest.mark.slow, pytest.mark.anyio, pytest.mark.timeout(240)]

N_QUEUED = 1000


@pytest.mark.parametrize("sync", ["always", ""], ids=["sync-always", "sync-default"])
async def test_a_coordinated_crash_loses_nothing_acknowledged(site, prefix, sync) -> None:
    s = await anyio.to_thread.run_sync(lambda: site(sync=sync))
    with s.net.hosts["tr"].entered():
        async with FabricClient.connect(s.cluster.url, prefix=prefix,
                                        policy=QuorumPolicy(timeout=10)) as fabric:
            await fabric.wait_for_workers(3, timeout=120)
            await fabric.update_weights(1, module=build_model("tiny"), transport="nats",
                                        verify="off")
            await fabric.pause("keep")  # the requests wait, stored, in the rollout stream
            reqs = [req(f"q{i}", max_tokens=3, seed=i, min_version=1) for i in range(N_QUEUED)]
            cmds = Commands()
            send, results = anyio.create_memory_object_stream[RolloutReply](2 * N_QUEUED)
            with send, results:
                got, errors, row = await _crash_between(s, fabric, reqs, send, results, cmds)
            desired = await fabric.bus.state.read()
    print(f"\ncoordinated crash (sync {sync or 'default'}): {N_QUEUED} requests acknowledged "
          f"before it; {sum(got.values())} answered after it, {len(got)} distinct, duplicates "
          f"dropped {row['dropped']:.0f}, errors {len(errors)}; nodes serving "
          f"{row['up']:.2f}s after the kill, workers resumed {row['resumed']:.2f}s after it, "
          f"the last answer {row['done']:.2f}s after it; desired version after it: "
          f"{desired.weight_version}\n{cmds.table()}")
    assert not errors, errors[:3]
    assert len(got) == N_QUEUED and set(got.values()) == {1}
    assert desired.weight_version == 1


async def _crash_between(s, fabric: FabricClient, reqs: list, send, results, cmds: Commands
                         ) -> tuple[Counter[str], list[RolloutError], dict[str, float]]:
    """Submit `reqs` (returns once JetStream acknowledged each), kill every node, restart
    them, resume the workers; each request's answers counted."""
    dropped = fabric.duplicates_dropped
    await fabric.rollouts.submit(reqs, send, timeout=120)
    for node in s.cluster.nodes:
        node.kill()
    t_crash = time.monotonic()
    await anyio.to_thread.run_sync(s.cluster.start)
    t_up = time.monotonic()
    await cmds.until_ok("resume", fabric.resume)
    t_resumed = time.monotonic()
    got: Counter[str] = Counter()
    errors: list[RolloutError] = []
    with anyio.move_on_after(90):
        async for res in results:
            got[res.request_id] += 1
            if isinstance(res, RolloutError):
                errors.append(res)
            if len(got) == len(reqs):
                break
    return got, errors, {"up": t_up - t_crash, "resumed": t_resumed - t_crash,
                         "done": time.monotonic() - t_crash,
                         "dropped": fabric.duplicates_dropped - dropped}
