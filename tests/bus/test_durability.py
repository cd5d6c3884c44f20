"""Durability as a visible choice: `rlfabric nats --sync always|DURATION` sets JetStream's
`sync_interval`, read back from the server's own monitoring; a value it would not take is
refused before it starts."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request

import anyio
import pytest

from rlfabric.bus import EmbeddedNats
from rlfabric.bus.nats.cluster import free_ports


def jetstream_config(sync: str) -> dict:
    async def main() -> dict:
        (port,) = free_ports(1, "127.0.0.1")
        async with EmbeddedNats(sync=sync, extra_config=f"http_port: {port}"):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/varz", timeout=10) as r:
                return dict(json.load(r)["jetstream"]["config"])
    return anyio.run(main)


@pytest.mark.parametrize(("sync", "always", "interval_s"),
                         [("always", True, None), ("10s", False, 10), ("", False, 120)])
def test_the_server_flushes_as_sync_says(sync: str, always: bool, interval_s: int | None
                                         ) -> None:
    cfg = jetstream_config(sync)
    assert bool(cfg.get("sync_always")) is always
    if interval_s is not None:
        assert cfg["sync_interval"] == interval_s * 10**9


def test_a_sync_the_server_would_not_take_is_refused_at_once() -> None:
    out = subprocess.run([sys.executable, "-m", "rlfabric", "nats", "--port", "0", "--sync",
                          "soon"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 2
    assert "sync 'soon': use always, or a duration" in out.stderr
