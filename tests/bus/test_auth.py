"""`rlfabric nats --auth DIR`: a key per role and subject permissions, as the server enforces
them. The permission matrix, with a real worker process and the real CLI server:

| role     | connects | control commands | writes rl_state | full update | status |
| trainer  | yes      | yes              | yes             | yes         | -      |
| worker   | yes      | refused          | refused         | serves it   | -      |
| observer | yes      | refused          | refused         | -           | works  |
| no key / a wrong key: cannot connect, "authentication failed"                      |
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import nkeys
import pytest

from rlfabric.bus import (
    Bus,
    ConnectOptions,
    NatsAuthFailed,
    PermissionDenied,
    connect,
)
from rlfabric.bus.nats.auth import ROLES, write_auth
from rlfabric.schemas import (
    DesiredState,
    Pause,
    RolloutRequest,
    RolloutResult,
    SamplingParams,
    encode,
)
from rlfabric.tensors.models import build_model
from rlfabric.trainer import FabricClient

pytestmark = [pytest.mark.nats, pytest.mark.anyio, pytest.mark.timeout(180)]


@pytest.fixture
def auth_server(tmp_path, prefix, spawn):
    """`rlfabric nats --auth DIR` on a free port: (url, key dir)."""
    keys = tmp_path / "keys"
    proc = spawn("nats", "--port", "0", "--auth", str(keys), "--prefix", prefix,
                 module="rlfabric")
    return proc.wait_for(r"ready at (nats://\S+)", timeout=30).group(1), keys


def test_write_auth_writes_private_seeds_and_keeps_them(tmp_path) -> None:
    first = write_auth(tmp_path / "k", prefix="job1")
    assert sorted(first.seed_files) == sorted(ROLES)
    for path in first.seed_files.values():
        assert os.stat(path).st_mode & 0o777 == 0o600
        assert path.read_bytes().startswith(b"SU")  # a user seed
    again = write_auth(tmp_path / "k", prefix="job1")  # a restarted server keeps its clients
    assert again.public_keys == first.public_keys
    assert '"job1.control.>"' in first.config and first.config.count("nkey:") == len(ROLES)


async def test_role_permissions_as_the_server_enforces_them(auth_server, prefix, spawn,
                                                           tmp_path) -> None:
    url, keys = auth_server

    def opts(role: str) -> ConnectOptions:
        return ConnectOptions.from_url(url, nkey_seed_file=str(keys / f"{role}.nk"),
                                       connect_wait=3)

    # a worker process with the worker key joins and serves
    worker = spawn("worker", "--nats", url, "--prefix", prefix, "--worker-id", "a0",
                   "--engine", "torch", "--threads", "1", "--nkey", str(keys / "worker.nk"),
                   module="rlfabric")
    # the trainer role: a full update, rollouts, pause and resume
    async with FabricClient.connect(opts("trainer"), prefix=prefix) as fabric:
        await fabric.wait_for_workers(1, timeout=60)
        rep = await fabric.update_weights(0, module=build_model("tiny"), transport="nats")
        assert rep.ok == ("a0",) and rep.acks["a0"].weight_version == 0
        got = [r async for r in fabric.generate(
            [RolloutRequest(request_id=f"r{i}", prompt_token_ids=[256, 3, 4],
                            sampling=SamplingParams(max_tokens=4)) for i in range(4)],
            timeout=60)]
        assert all(isinstance(r, RolloutResult) and r.version_spans[0].version == 0
                   for r in got), got
        assert (await fabric.pause()).ok == ("a0",)
        assert (await fabric.resume()).ok == ("a0",)
    assert worker.poll() is None

    # the worker and observer roles: no control command, no desired-state write
    for role in ("worker", "observer"):
        async with Bus.connect(opts(role), prefix=prefix, provision_streams=False) as bus:
            pause = bus.subjects.control("pause")
            t0 = time.monotonic()
            with pytest.raises(PermissionDenied, match=re.escape(pause)) as refused:
                await bus.persist(pause, encode(Pause(cmd_id="x1")),
                                  bus.headers({"Nats-Msg-Id": "x1"}))
            assert "permissions violation" in str(refused.value).lower()
            assert time.monotonic() - t0 < 3  # at once, not at a timeout
            with pytest.raises(PermissionDenied, match=re.escape(f"{prefix}_state")):
                await bus.state.put(DesiredState(weight_version=99))
            assert (await bus.state.read()).weight_version == 0  # read, unchanged

    # the observer role: status works
    status = subprocess.run(
        [sys.executable, "-m", "rlfabric", "status", "--nats", url, "--prefix", prefix,
         "--nkey", str(keys / "observer.nk")], capture_output=True, text=True, timeout=60)
    assert status.returncode == 0, status.stderr
    assert "a0" in status.stdout

    # no key, a wrong key: refused, and the error says authentication failed
    stranger = tmp_path / "stranger.nk"
    stranger.write_bytes(nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER))
    for o in (ConnectOptions.from_url(url, connect_wait=1),
              ConnectOptions.from_url(url, nkey_seed_file=str(stranger), connect_wait=1)):
        with pytest.raises(NatsAuthFailed, match="authentication failed"):
            await connect(o)
    cli = subprocess.run(
        [sys.executable, "-m", "rlfabric", "status", "--nats", url, "--prefix", prefix,
         "--wait", "1"], capture_output=True, text=True, timeout=60)
    assert cli.returncode != 0 and "authentication failed" in cli.stderr, cli.stderr

