"""A minority node cut off with a worker attached to it (the worker keeps its connection: the
node still accepts it): the worker leaves membership within the liveness bound, takes no
rollout while cut off, and rejoins at the version pushed meanwhile once healed. The times are
printed (-s)."""

from __future__ import annotations

import time

import anyio
import pytest
from helpers import req
from tally import Tally

from rlfabric.bus import QuorumPolicy
from rlfabric.tensors.models import build_model
from rlfabric.trainer import FabricClient

pytestmark = [pytest.mark.nats, pytest.mark.slow, pytest.mark.anyio, pytest.mark.timeout(240)]

CUT_S = 15.0


def push(fabric: FabricClient, version: int):
    return fabric.update_weights(version, module=build_model("tiny"), transport="nats",
                                 verify="off")


async def test_a_cut_off_minority_worker_leaves_serves_nothing_and_rejoins(site, prefix) -> None:
    s = await anyio.to_thread.run_sync(site)
    with s.net.hosts["tr"].entered():
        async with FabricClient.connect(s.cluster.url, prefix=prefix,
                                        policy=QuorumPolicy(timeout=10)) as fabric:
            await fabric.wait_for_workers(3, timeout=120)
            await push(fabric, 0)
            mine = s.cluster.urls.index(fabric.bus.nc.connected_url.geturl())
            m = (mine + 1) % 3  # a node the trainer does not talk to
            gone = f"w{m}"
            ttl = fabric.bus.limits.member_ttl
            s.net.split([f"n{m}", gone])
            t_cut = time.monotonic()
            await fabric.watcher.wait_until(lambda sn: gone not in sn.worker_ids,
                                            timeout=2 * ttl + 10)
            left = time.monotonic() - t_cut
            rep = await push(fabric, 1)
            reqs = [req(f"cut{i}", max_tokens=3, seed=i, min_version=1) for i in range(300)]
            t = Tally(fabric, reqs, timeout=60)
            await t.consume()
            t_served = time.monotonic()
            assert t_served < t_cut + CUT_S, "the cut must outlast the rollouts sent during it"
            await anyio.sleep(t_cut + CUT_S - time.monotonic())
            s.net.heal()
            t_heal = time.monotonic()
            snap = await fabric.watcher.wait_until(
                lambda sn: gone in sn.worker_ids and all(mb.weight_version == 1
                                                         for mb in sn.members), timeout=60)
            rejoined = time.monotonic() - t_heal
            after = [r async for r in fabric.generate(
                [req(f"after{i}", max_tokens=3, seed=i, min_version=1) for i in range(60)],
                timeout=60)]
    print(f"\nminority node n{m} and {gone} cut off {CUT_S:.0f}s: {gone} left membership "
          f"{left:.2f}s after the cut (member_ttl {ttl:g}s); v1 pushed during the cut, acked "
          f"by {', '.join(rep.ok)}; {len(reqs)} rollouts sent during it, {t.results} answered "
          f"(by {', '.join(sorted({w for _, w in t.served_by}))}); {gone} back at v1 "
          f"{rejoined:.2f}s after the heal")
    assert left <= 2 * ttl + 3, left  # unheard for member_ttl, then no answer to a ping
    assert set(rep.ok) == {"w0", "w1", "w2"} - {gone}
    t.assert_each_once()
    assert gone not in {w for _, w in t.served_by}
    assert len(snap.members) == 3
    assert len(after) == 60
    assert {sp.version for r in after for sp in r.version_spans} == {1}
