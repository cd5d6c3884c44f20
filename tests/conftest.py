"""Shared fixtures: one real nats-server per test session, a fresh job prefix per test, and
responder processes that are always stopped.

Set RLFABRIC_TEST_NATS=nats://host:port to run the suite against an external server instead.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator

import pytest

from rlfabric.bus import EmbeddedNats


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def nats_url() -> Iterator[str]:
    external = os.environ.get("RLFABRIC_TEST_NATS")
    if external:
        yield external
        return
    with EmbeddedNats() as srv:
        yield srv.url


@pytest.fixture
def prefix() -> str:
    """A job prefix of its own, so tests sharing the server never see each other."""
    return "t" + uuid.uuid4().hex[:12]


@pytest.fixture
def spawn() -> Iterator[Callable[..., subprocess.Popen[str]]]:
    """Start a Python module as a child process; every one is killed at teardown."""
    procs: list[subprocess.Popen[str]] = []

    def _spawn(*args: str, module: str = "rlfabric.bench.sim") -> subprocess.Popen[str]:
        proc = subprocess.Popen([sys.executable, "-m", module, *args], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        procs.append(proc)
        return proc

    yield _spawn
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        if proc.stdout:
            proc.stdout.close()


@pytest.fixture
def fabric(nats_url: str, prefix: str):
    """Open the trainer side of a job: `async with fabric() as (bus, watcher, broadcaster, tg)`;
    `tg` is a task group for the test's own responders, cancelled when the block ends."""
    import contextlib

    import anyio

    from rlfabric.bus import Broadcaster, Bus, Limits, MembershipWatcher

    @contextlib.asynccontextmanager
    async def _open(member_ttl: float = 5.0):
        async with Bus.connect(nats_url, prefix=prefix,
                               limits=Limits(member_ttl=member_ttl)) as bus, \
                anyio.create_task_group() as tg:
            watcher = MembershipWatcher(bus)
            await tg.start(watcher.run)
            yield bus, watcher, Broadcaster(bus, watcher), tg
            tg.cancel_scope.cancel()

    return _open


def sim_args(nats_url: str, prefix: str, ids: list[str], *delays: str) -> list[str]:
    args = ["--nats", nats_url, "--prefix", prefix, "--ids", ",".join(ids)]
    for d in delays:
        args += ["--delay", d]
    return args


@pytest.fixture
def sims(spawn, nats_url: str, prefix: str):
    """Start simulated workers: `sims(ids, *delays, per_process=8)` -> their processes."""

    def _start(ids: list[str], *delays: str, per_process: int = 8) -> list[subprocess.Popen[str]]:
        return [
            spawn(*sim_args(nats_url, prefix, ids[i:i + per_process], *delays))
            for i in range(0, len(ids), per_process)
        ]

    return _start


@pytest.fixture
def workers(spawn, nats_url: str, prefix: str):
    """Start `rlfabric worker` processes: `workers(["w0", "w1"], "--capacity", "8")`."""

    def _start(ids: list[str], *extra: str, engine: str = "torch") -> list[subprocess.Popen[str]]:
        return [
            spawn("worker", "--nats", nats_url, "--prefix", prefix, "--worker-id", wid,
                  "--engine", engine, *extra, module="rlfabric")
            for wid in ids
        ]

    return _start


@pytest.fixture
def client(nats_url: str, prefix: str):
    """`async with client(**limits) as fabric`: a FabricClient on this test's job."""
    from rlfabric.bus import Limits
    from rlfabric.trainer import FabricClient

    def _open(**limits):
        return FabricClient.connect(nats_url, prefix=prefix, limits=Limits(**limits))

    return _open
