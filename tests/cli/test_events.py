"""`rlfabric events`, as a user runs it after a run: the joins, a push with its acks and a
worker killed, read back from the events stream."""

from __future__ import annotations

import json
import signal
import subprocess

import anyio
import pytest
import torch
from helpers import rlfabric_exe

from rlfabric.tensors.models import build_model
from rlfabric.trainer import FabricClient

pytestmark = [pytest.mark.nats]


def test_events_lists_the_joins_a_push_with_its_acks_and_a_kill(nats_url: str, prefix: str,
                                                                  workers) -> None:
    async def run() -> None:
        async with FabricClient.connect(nats_url, prefix=prefix) as fabric:
            (e0,) = workers(["e0"], engine="null")
            workers(["e1"], engine="null")
            await fabric.wait_for_workers(2, timeout=60)
            await fabric.update_weights(1, module=build_model("tiny", dtype=torch.bfloat16),
                                        transport="nats", verify="off")
            e0.send_signal(signal.SIGKILL)
            await fabric.watcher.wait_until(lambda s: "e0" not in s.worker_ids, timeout=30)

    anyio.run(run)
    args = ["--nats", nats_url, "--prefix", prefix, "--since", "10m"]
    out = subprocess.run([rlfabric_exe(), "events", *args, "--json"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    events = [json.loads(x) for x in out.stdout.splitlines()]
    members = [(e["worker_id"], e["change"]) for e in events if e["kind"] == "member"]
    # once each, though every client's watcher tells them
    assert sorted(members) == [("e0", "joined"), ("e0", "left"), ("e1", "joined")], members
    (push,) = [e for e in events if e["kind"] == "command" and e["op"] == "update_weights"]
    assert push["version"] == 1 and sorted(push["ok"]) == ["e0", "e1"]
    assert push["failed"] == {} and push["missing"] == [] and push["seconds"] > 0
    states = {(e["source"], e["state"]) for e in events if e["kind"] == "state"}
    assert {("e0", "updating"), ("e1", "updating"), ("e1", "ready")} <= states
    # in the order they happened: both joins, the push, the kill
    order = [(e.get("worker_id"), e.get("change") or e.get("op")) for e in events
             if e["kind"] in ("member", "command")]
    assert order.index(("e0", "left")) > order.index((None, "update_weights")) > max(
        order.index(("e0", "joined")), order.index(("e1", "joined"))), order

    text = subprocess.run([rlfabric_exe(), "events", *args, "--kind", "member"],
                          capture_output=True, text=True, timeout=60)
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    assert len(lines) == 3 and "e0 left" in lines[-1], lines
    old = subprocess.run([rlfabric_exe(), "events", "--nats", nats_url, "--prefix", prefix,
                          "--since", "2000-01-01T00:00", "--kind", "command"],
                         capture_output=True, text=True, timeout=60)
    assert "update_weights v1" in old.stdout, old.stdout


def test_events_says_what_is_wrong_with_since_and_a_job_without_events(nats_url: str) -> None:
    bad = subprocess.run([rlfabric_exe(), "events", "--nats", nats_url, "--since", "yesterday"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "a duration (30s, 10m, 2h, 1d)" in bad.stderr
    none = subprocess.run([rlfabric_exe(), "events", "--nats", nats_url, "--prefix", "nojob"],
                          capture_output=True, text=True, timeout=60)
    assert none.returncode == 2 and "no events stream" in none.stderr, none.stderr
