"""A NATS cluster on loopback: `rlfabric nats --cluster 3` starts and stops every node, a
job provisioned on it keeps three copies of every stream and bucket (one on a single
server), provisioning waits for a node still joining, and a lost compare-and-swap reads as
one on three copies as on one."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest

from rlfabric.bus import Bus, EmbeddedCluster
from rlfabric.bus.errors import TRANSIENT, ProvisioningError
from rlfabric.bus.nats.cluster import knows_meta_leader
from rlfabric.bus.nats.provision import Limits, provision
from rlfabric.bus.sessions.log import SessionConflict, SessionLog
from rlfabric.bus.subjects import CHECKPOINT_KEY
from rlfabric.schemas import CheckpointClaim, PackedI32, SessionTurn

pytestmark = [pytest.mark.nats, pytest.mark.anyio]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return not f.read().split(") ")[1].startswith("Z")
    except FileNotFoundError:
        return False


async def replicas_of(bus: Bus) -> dict[str, int]:
    s = bus.subjects
    names = [s.rollout_stream, s.results_stream, s.control_stream, s.weights_stream,
             f"KV_{s.members_bucket}", f"KV_{s.state_bucket}"]
    return {n: await _replicas(bus, n) for n in names}


async def _replicas(bus: Bus, stream: str) -> int:
    """A stream's copies, as its leader reports them. A stream created a moment ago may not
    have elected its leader yet, and its info request can time out meanwhile: asked again for
    up to 20 s."""
    with anyio.fail_after(20):
        while True:
            try:
                return (await bus.js.stream_info(stream)).config.num_replicas or 1
            except TRANSIENT:
                await anyio.sleep(0.2)


async def test_nats_cluster_cli_starts_three_nodes_and_a_job_on_them_keeps_three_copies(
        tmp_path: Path, prefix: str, nats_url: str) -> None:
    store = tmp_path / "store"
    proc = subprocess.Popen([sys.executable, "-m", "rlfabric", "nats", "--cluster", "3",
                             "--port", "0", "--json", "--store-dir", str(store)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        with anyio.fail_after(60):
            nodes = [json.loads(await anyio.to_thread.run_sync(proc.stdout.readline))
                     for _ in range(3)]
        assert [n["name"] for n in nodes] == ["n0", "n1", "n2"]
        assert len({n["url"] for n in nodes}) == 3 and all(alive(n["pid"]) for n in nodes)
        assert [Path(n["store"]).name for n in nodes] == ["n0", "n1", "n2"]
        # a client that knows one node finds the others: it provisions three copies
        async with Bus.connect(nodes[1]["url"], prefix=prefix) as bus:
            assert set((await replicas_of(bus)).values()) == {3}
            info = await bus.js.stream_info(bus.subjects.control_stream)
            assert info.cluster is not None and info.cluster.leader in {"n0", "n1", "n2"}
            assert len(info.cluster.replicas or []) == 2
        proc.send_signal(signal.SIGTERM)
        assert await anyio.to_thread.run_sync(lambda: proc.wait(timeout=30)) == 0
        assert [n["pid"] for n in nodes if alive(n["pid"])] == []
        assert sorted(os.listdir(store)) == ["n0", "n1", "n2"]  # kept: --store-dir was given
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for f in (proc.stdout, proc.stderr):
            if f:
                f.close()
    # the same job on one server: one copy
    async with Bus.connect(nats_url, prefix=prefix + "s") as bus:
        assert set((await replicas_of(bus)).values()) == {1}


@pytest.mark.parametrize("nodes", [1, 3])
async def test_racing_checkpoint_claims_and_session_turns_lose_as_such_on_any_copies(
        nodes: int, nats_url: str, tmp_path: Path, prefix: str) -> None:
    # a conditional write that loses is 10071 on one copy; on three, one sent while the
    # winner is still being replicated is 10164: both a lost race, neither a crash
    cluster = EmbeddedCluster(3, store_dir=str(tmp_path / "store")) if nodes == 3 else None
    try:
        if cluster is not None:
            await anyio.to_thread.run_sync(cluster.start)
        async with Bus.connect(cluster.url if cluster else nats_url, prefix=prefix) as bus:
            assert set((await replicas_of(bus)).values()) == {nodes}
            claims = [CheckpointClaim(model="tiny", checksum=f"c{i}", worker_id=f"w{i}")
                      for i in range(6)]
            # claimers on every node; a loser may read nothing yet (the winner not applied),
            # and rounds after a clear (`rlfabric ctl reset-state`) race over its delete marker
            async with contextlib.AsyncExitStack() as stack:
                states = [(await stack.enter_async_context(
                    Bus.connect(url, prefix=prefix, provision_streams=False))).state
                    for url in (cluster.urls if cluster else [nats_url])]

                async def claim(held: list[CheckpointClaim], i: int, c: CheckpointClaim) -> None:
                    held.append(await states[i % len(states)].claim_checkpoint(c))

                for _ in range(4):
                    held: list[CheckpointClaim] = []
                    with anyio.fail_after(30):
                        async with anyio.create_task_group() as tg:
                            for i, c in enumerate(claims):
                                tg.start_soon(claim, held, i, c)
                    winner = await bus.state.checkpoint_claim()
                    assert winner in claims and held == [winner] * len(claims)
                    await bus.buckets.state.delete(CHECKPOINT_KEY)

            # four gateways append turn 0 of one session at once: one is stored and the others
            # are refused (on three copies a record alike in all but its writer must not pass
            # as a duplicate of the first)
            logs = [SessionLog(bus, writer=f"g{i}") for i in range(4)]
            turns = [SessionTurn(session_id="s0", turn=0, added=PackedI32([i]))
                     for i in range(4)]
            sent = [await log.send(t, expect_last=0) for log, t in zip(logs, turns, strict=True)]
            stored: dict[int, int] = {}
            for i, stored_at in enumerate(sent):
                with contextlib.suppress(SessionConflict):
                    stored[i] = await stored_at()
            assert len(stored) == 1, stored
            [(i, seq)] = stored.items()
            assert [(s, list(r.added)) for s, r in await logs[0].read("s0")] == [(seq, [i])]
    finally:
        if cluster is not None:
            await anyio.to_thread.run_sync(cluster.stop)


def test_a_node_knows_its_metadata_leader_from_its_last_word_on_it() -> None:
    # nats-server's own lines (processLeaderChange); "no metadata leader" names none
    start = ["[INF] Starting JetStream cluster",
             "[WRN] JetStream has not established contact with a meta leader"]
    elected = "[INF] Self is new JetStream cluster metadata leader"
    learned = "[INF] JetStream cluster new metadata leader: n1/rlfabric"
    lost = "[INF] JetStream cluster no metadata leader"
    assert not knows_meta_leader(start)
    assert knows_meta_leader([*start, elected])
    assert knows_meta_leader([*start, learned, "[INF] Server is ready"])
    assert not knows_meta_leader([*start, lost])
    assert not knows_meta_leader([*start, learned, lost])
    assert knows_meta_leader([*start, lost, learned])


def test_a_cluster_needs_three_nodes() -> None:
    with pytest.raises(ValueError, match="at least 3 nodes"):
        EmbeddedCluster(2)


async def test_provisioning_waits_for_a_node_still_joining_and_says_when_one_is_missing(
        tmp_path: Path, prefix: str) -> None:
    cluster = EmbeddedCluster(3, store_dir=str(tmp_path / "store"))
    try:
        for node in cluster.nodes[:2]:  # two of three: a metadata leader, no room for 3 copies
            await anyio.to_thread.run_sync(node.start)

        def meta_leader() -> None:
            deadline = time.monotonic() + 30
            while not all(knows_meta_leader(n.log_lines) for n in cluster.nodes[:2]):
                assert time.monotonic() < deadline, "two nodes elected no metadata leader"
                time.sleep(0.05)  # the servers' logs are read by threads

        await anyio.to_thread.run_sync(meta_leader)
        limits = Limits(replicas=3)
        async with Bus.connect(cluster.urls[0], prefix=prefix, provision_streams=False) as bus:
            with pytest.raises(ProvisioningError, match=r"with 3 copies within 1s.*Start the "
                               r"missing nodes"):
                await provision(bus.js, bus.subjects, limits, within=1.0)

            async def third_node() -> None:
                await anyio.to_thread.run_sync(cluster.nodes[2].start)

            with anyio.fail_after(60):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(third_node)
                    buckets = await provision(bus.js, bus.subjects, limits, within=45)
            assert set((await replicas_of(bus)).values()) == {3}
            assert buckets.member_ttl == limits.member_ttl
    finally:
        await anyio.to_thread.run_sync(cluster.stop)


def test_a_port_taken_before_its_node_binds_it_starts_the_cluster_on_new_ports() -> None:
    # a chosen port can be taken by any process's connection before the node binds it
    cluster = EmbeddedCluster(3)
    taken = cluster.nodes[1].requested_port
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", taken))
        squatter.listen()
        with cluster:
            ports = [node.requested_port for node in cluster.nodes]
            assert taken not in ports and len(set(ports)) == 3
            assert all(knows_meta_leader(node.log_lines) for node in cluster.nodes)
    assert all(node.port is None for node in cluster.nodes)  # stopped
