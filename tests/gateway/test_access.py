"""Who may do what: on a server started with `rlfabric nats --auth`, the gateway's own role
serves agents and keeps sessions, and is refused any command to the fleet."""

from __future__ import annotations

import re

import anyio
import pytest

from rlfabric.bus import Bus, ConnectOptions, PermissionDenied
from rlfabric.schemas import Pause, encode

pytestmark = [pytest.mark.nats, pytest.mark.slow]


def test_the_gateway_role_serves_agents_and_may_not_pause_the_fleet(spawn, prefix, new_fleet,
                                                                     client, extra, tmp_path):
    keys = tmp_path / "keys"
    srv = spawn("nats", "--port", "0", "--auth", str(keys), "--prefix", prefix,
                module="rlfabric")
    url = srv.wait_for(r"ready at (nats://\S+)", timeout=30).group(1)
    fleet = new_fleet(url)
    fleet.workers(["a0"], "--nkey", str(keys / "worker.nk"))
    base = fleet.gateway("--nkey", str(keys / "gateway.nk"))
    c = client(base)
    r = c.chat.completions.create(model="tinyqwen", max_tokens=3,
                                  messages=[{"role": "user", "content": "hi"}],
                                  extra_headers={"X-Session-ID": "s1"})
    assert len(extra(r.choices[0], "token_ids")) == 3
    traj = c.with_options().get("/sessions/s1/trajectory", cast_to=object)
    assert traj["turns"] == 1

    async def as_gateway() -> None:
        from rlfabric.trainer import FabricClient

        opts = ConnectOptions.from_url(url, nkey_seed_file=str(keys / "gateway.nk"))
        async with Bus.connect(opts, prefix=prefix) as bus:
            pause = bus.subjects.control("pause")
            with pytest.raises(PermissionDenied, match=re.escape(pause)):
                await bus.persist(pause, encode(Pause(cmd_id="g1")),
                                  bus.headers({"Nats-Msg-Id": "g1"}))
        async with FabricClient.connect(opts, prefix=prefix) as fabric:
            with pytest.raises(PermissionDenied):
                await fabric.pause()

    anyio.run(as_gateway)
