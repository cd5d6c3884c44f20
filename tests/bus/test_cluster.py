"""A NATS cluster on loopback: `rlfabric nats --cluster 3` starts and stops every node, and a
job provisioned on it keeps three copies of every stream and bucket (one on a single
server)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from rlfabric.bus import Bus, EmbeddedCluster

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
    return {n: (await bus.js.stream_info(n)).config.num_replicas or 1 for n in names}


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


def test_a_cluster_needs_three_nodes() -> None:
    with pytest.raises(ValueError, match="at least 3 nodes"):
        EmbeddedCluster(2)
