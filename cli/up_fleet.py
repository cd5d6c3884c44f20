"""The workers `rlfabric up` starts: worker processes (the default) or Ray actors
(`--launcher ray`). Both answer the same few calls: `start`, `dead`, `pids`, `stop`, `where`."""

from __future__ import annotations

import os
from typing import Any

from rlfabric.engines import registry
from rlfabric.launch.local import WorkerProcesses

#: `rlfabric worker` processes, each logging to run_dir/worker-<i>.log
ProcessFleet = WorkerProcesses


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
