"""Workers as Ray actors: `RayFleet` places N of them in one placement group, a bundle per
worker (its CPUs, and GPUs when asked), the way verl, SkyRL, OpenRLHF and NeMo-RL place their
engines.

Each actor runs the worker runtime on the event loop of its concurrency group `serve`; its
`health`, `describe` and `drain` calls live in the group `probe`, which Ray gives its own
event loop and thread, so a busy engine never blocks them. The actors join over NATS like any
worker: the trainer talks to them through `FabricClient` and needs nothing from Ray.

    import ray
    from rlfabric.launch.ray import RayFleet, WorkerSpec

    ray.init()                      # or ray.init(address="auto") on a cluster
    with RayFleet(8, "nats://head:4222", prefix="job1",
                  spec=WorkerSpec(engine="vllm", model="/ckpt"), gpus_per_worker=1) as fleet:
        ...                         # FabricClient.connect("nats://head:4222", prefix="job1")

Ray is the optional extra `ray` (`pip install 'rlfabric[ray]'`); this module imports it when
a fleet starts and says so when it is missing.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import socket
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rlfabric.bus import Bus, ConnectOptions
from rlfabric.bus.control.receiver import POLL_MAX
from rlfabric.errors import LaunchError
from rlfabric.worker.runtime import CAPACITY, check_knobs

if TYPE_CHECKING:
    from rlfabric.worker import Worker

SERVE_GROUP = "serve"  # the worker runtime: one call, for the actor's life
PROBE_GROUP = "probe"  # health, describe, drain: never queued behind the engine


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """What every actor serves: the knobs of `rlfabric worker`.

    `engine_options` go to the engine's factory (`rlfabric.engines.registry`), e.g.
    `{"max_batch": 64}` for torch or `{"options": VllmOptions(...)}` for vLLM. `threads`: torch
    CPU threads (0: torch's own choice). `prefetch` / `poll_max`: as `--prefetch` /
    `--poll-max`. `trace` / `metrics`: the spans and metrics files of `--trace` / `--metrics`
    (paths every node can write, e.g. a shared folder). Out-of-range knobs raise ValueError
    here, before any actor is placed."""

    engine: str = "torch"
    model: str = "tiny"
    capacity: int = CAPACITY
    threads: int = 1
    prefetch: int = 0
    poll_max: float = POLL_MAX
    engine_options: dict[str, Any] = field(default_factory=dict)
    trace: str | None = None
    metrics: str | None = None

    def __post_init__(self) -> None:
        check_knobs(capacity=self.capacity, prefetch=self.prefetch, poll_max=self.poll_max)


class WorkerActor:
    """One worker: built and joined by `serve()`, which returns once it has drained."""

    def __init__(self, worker_id: str, connect: ConnectOptions, prefix: str,
                 spec: WorkerSpec) -> None:
        self.worker_id = worker_id
        self.connect = connect
        self.prefix = prefix
        self.spec = spec
        self.state = "starting"
        self.error = ""
        self.worker: Worker | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.drain_asked = False

    async def serve(self) -> str:
        from rlfabric.engines import registry
        from rlfabric.telemetry import configure
        from rlfabric.worker import Worker

        self.loop = asyncio.get_running_loop()
        spec = self.spec
        registry.prepare_process(spec.engine, spec.threads)
        telemetry = configure(role="worker", worker_id=self.worker_id, trace_path=spec.trace,
                              metrics_path=spec.metrics)
        try:
            engine = registry.make_engine(spec.engine, spec.model, **spec.engine_options)
            async with Bus.connect(self.connect, prefix=self.prefix) as bus:
                self.worker = Worker(bus, engine, self.worker_id, capacity=spec.capacity,
                                     prefetch=spec.prefetch, poll_max=spec.poll_max)
                if self.drain_asked:
                    self.worker.drain()
                await self.worker.run()
        except BaseException as exc:
            self.state, self.error = "failed", f"{type(exc).__name__}: {exc}"
            raise
        finally:
            telemetry.shutdown()
        self.state = "stopped"
        return self.worker_id

    async def health(self) -> dict[str, Any]:
        """Where the worker stands, from the probe group's own loop."""
        w = self.worker
        state = self.state
        if state == "starting" and w is not None:
            state = w.reg.info.state  # starting, ready, paused, draining, ...
        return {"worker_id": self.worker_id, "state": state, "error": self.error,
                "pid": os.getpid(), "host": socket.gethostname(),
                "weight_version": w.engine.version if w else None,
                "in_flight": w.rollouts.in_flight if w else 0,
                "prefetch": w.rollouts.prefetch if w else self.spec.prefetch,
                "parked": w.rollouts.parked if w else 0,
                "served": w.rollouts.served if w else 0}

    async def describe(self) -> dict[str, str]:
        """The engine's own description (model, version, checksum, ...)."""
        return self.worker.engine.describe() if self.worker else {}

    async def drain(self) -> None:
        """Stop taking requests, finish in-flight ones, leave; `serve()` then returns."""
        self.drain_asked = True
        if self.worker is not None and self.loop is not None:
            self.loop.call_soon_threadsafe(self.worker.drain)


def _ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise LaunchError("the Ray launcher needs Ray: pip install 'rlfabric[ray]'") from exc
    if not ray.is_initialized():
        raise LaunchError("Ray is not initialized in this process: call ray.init() (a local "
                          "runtime) or ray.init(address='auto') (a running cluster) first")
    return ray


class RayFleet:
    """N workers as Ray actors in one placement group; `start()` places and starts them,
    `stop()` drains them and removes the group. The worker ids are `<id_prefix><i>`."""

    def __init__(self, n: int, nats: ConnectOptions | str, prefix: str,
                 spec: WorkerSpec | None = None, *, cpus_per_worker: float = 1.0,
                 gpus_per_worker: float = 0.0, strategy: str = "PACK",
                 id_prefix: str = "w") -> None:
        if n < 1:
            raise ValueError(f"RayFleet: n must be >= 1, got {n}")
        self.n = n
        self.connect = (ConnectOptions.from_url(nats, name="rlfabric-ray-worker")
                        if isinstance(nats, str) else nats)
        self.prefix = prefix
        self.spec = spec or WorkerSpec()
        self.bundle: dict[str, float] = {"CPU": cpus_per_worker}
        if gpus_per_worker:
            self.bundle["GPU"] = gpus_per_worker
        self.strategy = strategy
        self.worker_ids = [f"{id_prefix}{i}" for i in range(n)]
        self.actors: list[Any] = []
        self.serving: list[Any] = []  # each actor's serve() call
        self.pg: Any = None

    def start(self, timeout: float = 120.0) -> RayFleet:
        """Place the group (all bundles or none) and start every actor; return at once: the
        workers announce themselves on the bus when they are ready."""
        ray = _ray()
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.pg = placement_group([dict(self.bundle) for _ in range(self.n)],
                                  strategy=self.strategy)
        ready, _ = ray.wait([self.pg.ready()], timeout=timeout)
        if not ready:
            remove_placement_group(self.pg)
            self.pg = None
            raise LaunchError(
                f"Ray could not place {self.n} bundles of {self.bundle} ({self.strategy}) "
                f"within {timeout}s; the cluster has {ray.available_resources()} free: ask for "
                "fewer workers or resources, or add nodes")
        remote = ray.remote(concurrency_groups={SERVE_GROUP: 1, PROBE_GROUP: 4})(WorkerActor)
        for i, wid in enumerate(self.worker_ids):
            actor = remote.options(
                num_cpus=self.bundle["CPU"], num_gpus=self.bundle.get("GPU", 0),
                max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.pg, placement_group_bundle_index=i),
            ).remote(wid, self.connect, self.prefix, self.spec)
            self.actors.append(actor)
            self.serving.append(actor.serve.options(concurrency_group=SERVE_GROUP).remote())
        return self

    def _probe(self, method: str, i: int) -> Any:
        return getattr(self.actors[i], method).options(concurrency_group=PROBE_GROUP).remote()

    def health(self, timeout: float = 5.0) -> list[dict[str, Any]]:
        """Every actor's `health()`; an actor that is gone reads `{"state": "dead", ...}`."""
        ray = _ray()
        out = []
        for i, wid in enumerate(self.worker_ids):
            try:
                out.append(ray.get(self._probe("health", i), timeout=timeout))
            except Exception as exc:  # RayActorError, GetTimeoutError: say which and why
                out.append({"worker_id": wid, "state": "dead", "error": str(exc)[:300]})
        return out

    def describe(self, i: int, timeout: float = 5.0) -> dict[str, str]:
        return _ray().get(self._probe("describe", i), timeout=timeout)

    def dead(self) -> list[str]:
        """'<id> ended: <why>' for every actor whose worker is no longer serving."""
        ray = _ray()
        done, _ = ray.wait(self.serving, num_returns=len(self.serving), timeout=0)
        out = []
        for ref in done:
            wid = self.worker_ids[self.serving.index(ref)]
            try:
                ray.get(ref)
                out.append(f"{wid} ended: drained")
            except Exception as exc:
                out.append(f"{wid} ended: {str(exc).strip().splitlines()[-1][:300]}")
        return out

    def kill(self, i: int, timeout: float = 30.0) -> None:
        """End actor i at once (its process is killed, as on a node loss); returns once its
        process is gone (an actor on this host) or Ray reports it dead (elsewhere): `ray.kill`
        itself only asks, and the process may answer a command for a while after."""
        ray = _ray()
        try:
            where: dict[str, Any] = ray.get(self._probe("health", i), timeout=min(5.0, timeout))
        except Exception:  # gone or stuck already: Ray's word below is all there is
            where = {}
        ray.kill(self.actors[i], no_restart=True)
        ray.wait([self.serving[i]], timeout=timeout)
        if where.get("host") == socket.gethostname() and where.get("pid"):
            _wait_gone(int(where["pid"]), timeout)

    def stop(self, grace: float = 15.0) -> None:
        """Drain every worker (at most `grace` seconds), then kill what is left and remove
        the placement group."""
        if not self.actors:
            return
        import ray
        from ray.util.placement_group import remove_placement_group

        for i in range(len(self.actors)):
            with contextlib.suppress(Exception):  # an actor already gone has nothing to drain
                self._probe("drain", i)
        deadline = time.monotonic() + grace
        ray.wait(self.serving, num_returns=len(self.serving),
                 timeout=max(0.0, deadline - time.monotonic()))
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        if self.pg is not None:
            remove_placement_group(self.pg)
        self.actors, self.serving, self.pg = [], [], None

    def __enter__(self) -> RayFleet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _wait_gone(pid: int, timeout: float) -> None:
    """Block until process `pid` has exited (at most `timeout` seconds), on its pidfd."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return  # gone already
    except (AttributeError, OSError):  # no pidfd here (not Linux): Ray's word is all there is
        return
    try:
        select.select([fd], [], [], timeout)
    finally:
        os.close(fd)
