"""The workers `rlfabric up` starts: worker processes (the default) or Ray actors
(`--launcher ray`). Both answer the same few calls: `start`, `dead`, `pids`, `stop`, `where`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from rlfabric.bus.server import die_with_parent
from rlfabric.engines import registry


class ProcessFleet:
    """`rlfabric worker` processes, each logging to run_dir/worker-<i>.log."""

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


class RayActorFleet:
    """Ray actors in one placement group (`rlfabric.launch.ray`). `address`: None starts a
    local Ray runtime for the run (shut down at the end); "auto" or an address joins a
    running cluster."""

    def __init__(self, address: str | None, gpus_per_worker: float = 0.0) -> None:
        self.address = address
        self.gpus_per_worker = gpus_per_worker
        self.fleet: Any = None
        self.started_ray = False
        self._pids: list[int] = []

    def start(self, n: int, url: str, prefix: str, engine: str, model: str,
              trace: str | None, metrics: str | None, extra: tuple[str, ...] = ()) -> None:
        from rlfabric.launch.ray import RayFleet, WorkerSpec

        if extra and engine != "torch":  # the spec carries no worker flags
            from rlfabric.errors import LaunchError

            raise LaunchError(f"--lora with --launcher ray runs on the torch engine only "
                              f"(not {engine}): its actors hold adapters by default")

        try:
            import ray
        except ImportError as exc:
            from rlfabric.errors import LaunchError

            raise LaunchError("--launcher ray needs Ray: pip install 'rlfabric[ray]'") from exc
        if not ray.is_initialized():
            # a local runtime gets a CPU per worker even on a smaller machine (Ray's CPUs are
            # a count for placement, not a limit)
            cpus = None if self.address else max(os.cpu_count() or 1, n)
            ray.init(address=self.address, num_cpus=cpus, include_dashboard=False,
                     log_to_driver=False)
            self.started_ray = True
        spec = WorkerSpec(engine=engine, model=model, capacity=64,
                          threads=1 if registry.kind(engine).torch_threads else 0, trace=trace,
                          metrics=metrics)
        self.fleet = RayFleet(n, url, prefix, spec, gpus_per_worker=self.gpus_per_worker)
        self.fleet.start()

    def where(self) -> str:
        return "Ray actors in one placement group (logs in Ray's session folder, e.g. " \
               "/tmp/ray/session_latest/logs)"

    def pids(self) -> list[int]:
        if self.fleet is not None and not self._pids:
            self._pids = [h.get("pid", 0) for h in self.fleet.health()]
        return self._pids

    def dead(self) -> list[str]:
        return self.fleet.dead() if self.fleet is not None else []

    def stop(self) -> None:
        if self.fleet is not None:
            self.fleet.stop()
            self.fleet = None
        if self.started_ray:
            import ray

            ray.shutdown()
            self.started_ray = False
