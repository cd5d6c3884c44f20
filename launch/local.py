"""A fleet on this machine: `rlfabric worker` processes (`WorkerProcesses`, what `rlfabric up`
starts), and with an embedded NATS server beside them (`LocalFleet`, what a script that has no
server yet starts: examples/trl_grpo.py).

    with LocalFleet("tinychat", workers=2, logs=run_dir) as fleet:
        with TrlFabric(fleet.url) as fabric:
            ...

Every process it starts dies with the process that started it, and stops when the block ends.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path
from types import TracebackType

from rlfabric.bus.nats.server import EmbeddedNats, die_with_parent
from rlfabric.engines import checkpoint_dir, registry
from rlfabric.errors import LaunchError


class WorkerProcesses:
    """`rlfabric worker` processes, each logging to `run_dir/worker-<i>.log`."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs: list[Path] = []

    def start(self, n: int, url: str, prefix: str, engine: str, model: str,
              trace: str | None, metrics: str | None, extra: tuple[str, ...] = ()) -> None:
        per_engine = (*registry.kind(engine).up_worker_args, *extra)
        to_files = [f"--{k}={v}" for k, v in (("trace", trace), ("metrics", metrics)) if v]
        for i in range(n):
            log = self.run_dir / f"worker-{i}.log"
            self.logs.append(log)
            with open(log, "wb") as out:
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-m", "rlfabric", "worker", "--nats", url, "--prefix", prefix,
                     "--worker-id", f"w{i}", "--capacity", "64", "--engine", engine,
                     "--model", model, *per_engine, *to_files],
                    stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    preexec_fn=die_with_parent))

    def where(self) -> str:
        return f"logs in {self.run_dir}"

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def dead(self) -> list[str]:
        out = []
        for i, p in enumerate(self.procs):
            if p.poll() is not None:
                tail = self.logs[i].read_text(errors="replace").strip().splitlines()[-3:]
                out.append(f"w{i} exited with {p.returncode}: {' | '.join(tail)}")
        return out

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)


class LocalFleet:
    """An embedded NATS server on a free loopback port and `workers` torch workers serving
    `model` (a built-in name is written once as a checkpoint under the user's cache; `path`
    is that checkpoint, for the trainer to load the same weights). `url` once entered."""

    def __init__(self, model: str, *, workers: int = 2, logs: Path, prefix: str = "rl",
                 engine: str = "torch", extra: tuple[str, ...] = ()) -> None:
        self.extra = extra  # more `rlfabric worker` options
        self.model = model
        self.path = checkpoint_dir(model)
        self.n = workers
        self.prefix = prefix
        self.engine = engine
        self.logs = logs
        self.server = EmbeddedNats()
        self.workers = WorkerProcesses(logs)
        self.url = ""

    def __enter__(self) -> LocalFleet:
        self.logs.mkdir(parents=True, exist_ok=True)
        self.server.start()
        self.url = self.server.url
        try:
            self.workers.start(self.n, self.url, self.prefix, self.engine, self.path, None, None,
                               self.extra)
        except BaseException:
            self.server.stop()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            self.workers.stop()
        finally:
            self.server.stop()

    def check(self) -> None:
        """`LaunchError` with the tail of its log if a worker exited."""
        if dead := self.workers.dead():
            raise LaunchError("a worker of the local fleet exited: " + "; ".join(dead))
