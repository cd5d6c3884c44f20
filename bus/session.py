"""`Bus`: one NATS connection with JetStream, the job's subjects and its KV buckets.

    async with Bus.connect("nats://127.0.0.1:4222", prefix="rl") as bus:
        ...

A `Bus` publishes (`Publisher`: core messages, JetStream publishes stored for sure, refusals
at once); `bus.state` reads and writes the job's desired state (`StateStore`); `bus.fleet`
reads who is a member, whether a worker answers and how deep the streams are (`FleetReads`).
Entering provisions the streams and buckets (idempotent) unless `provision_streams=False`;
leaving drains the connection. The bus runs no tasks of its own: whoever starts a watcher,
receiver or registration runs it in a task group of their own.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

import anyio
import nats.errors
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from rlfabric.bus.control.fleet import FleetReads
from rlfabric.bus.control.state import StateStore
from rlfabric.bus.errors import BusError
from rlfabric.bus.nats.connect import ConnectOptions, Link, connect
from rlfabric.bus.nats.provision import Buckets, Limits, bind_buckets, cluster_size, provision
from rlfabric.bus.nats.publish import Publisher
from rlfabric.bus.subjects import Subjects

log = logging.getLogger("rlfabric.bus")


class Bus(Publisher):
    def __init__(self, nc: NATS, js: JetStreamContext, subjects: Subjects,
                 buckets: Buckets | None, limits: Limits, link: Link | None = None) -> None:
        super().__init__(nc, subjects, link or Link())
        self.js = js
        self.limits = limits
        self._buckets = buckets
        self.state = StateStore(self, js, buckets)
        self.fleet = FleetReads(nc, js, subjects, buckets)

    @classmethod
    @contextlib.asynccontextmanager
    async def connect(cls, opts: ConnectOptions | str, *, prefix: str = "rl",
                      limits: Limits | None = None, provision_streams: bool = True,
                      ) -> AsyncIterator[Bus]:
        subjects = Subjects(prefix)
        limits = limits or Limits()
        link = Link()
        nc = await connect(opts, link=link)
        try:
            js = nc.jetstream(timeout=10.0)
            if provision_streams:
                # NOTE: nats-py keeps the server's INFO private; `connect_urls` in it is the
                # one place that says how many servers the cluster has
                buckets: Buckets | None = await provision(
                    js, subjects, limits, servers=cluster_size(getattr(nc, "_server_info", {})))
            else:
                buckets = await bind_buckets(js, subjects)
            yield cls(nc, js, subjects, buckets, limits, link)
        finally:
            with anyio.CancelScope(shield=True):
                await _close(nc)

    @property
    def buckets(self) -> Buckets:
        if self._buckets is None:
            raise BusError(
                f"the job's KV buckets ({self.subjects.members_bucket}, "
                f"{self.subjects.state_bucket}) do not exist on this server: no worker or "
                "trainer of this --prefix has started yet"
            )
        return self._buckets


async def _close(nc: NATS) -> None:
    """Drain, or close if draining fails. A connection already lost (the broker or its node
    gone) is no error here: a process stopping then must not die of it, nor hide behind it
    the error it is stopping for."""
    if nc.is_closed:
        return
    try:
        with anyio.fail_after(5):
            await nc.drain()
    except Exception:
        try:
            await nc.close()
        except (OSError, nats.errors.Error) as exc:
            log.info("closing a connection already lost (%s: %s): what it still held for the "
                     "server is dropped", type(exc).__name__, exc)
