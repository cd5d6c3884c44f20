"""`serve()`: a gateway on one bus connection, until cancelled or signalled.

The bus parts it runs, each in the one task group: the membership watcher (503 when no worker
is a member), the rollout plane (requests out, results and token deltas in), the idle-session
sweeper, and uvicorn serving the app.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
import uuid
from collections.abc import Iterator
from typing import Any

import anyio
from anyio.abc import TaskStatus

from rlfabric.bus import Bus, ConnectOptions, Limits, MembershipWatcher
from rlfabric.bus.rollouts.affinity import Affinity
from rlfabric.bus.rollouts.plane import RolloutPlane
from rlfabric.concurrency.sync import beside
from rlfabric.gateway.app import create_app
from rlfabric.gateway.config import GatewayConfig, ServeOptions
from rlfabric.gateway.service import Gateway
from rlfabric.gateway.sessions import SessionStore
from rlfabric.text import load_chat_format

log = logging.getLogger("rlfabric.gateway")


def _server(app: Any, ready: anyio.Event) -> Any:
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn, told when it listens; signals are the gateway's to handle."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets=sockets)
            if self.started:
                ready.set()

    return Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                 timeout_keep_alive=30, timeout_graceful_shutdown=10))


async def serve(url: str | ConnectOptions, config: GatewayConfig, opts: ServeOptions, *,
                prefix: str = "rl", handle_signals: bool = False, limits: Limits | None = None,
                task_status: TaskStatus[int] = anyio.TASK_STATUS_IGNORED) -> None:
    """Run the gateway; started (with the port it listens on) once it takes requests. With
    `handle_signals`, SIGINT / SIGTERM stop it: requests in flight finish (10 s at most)."""
    fmt = await anyio.to_thread.run_sync(
        lambda: load_chat_format(config.model, template=opts.chat_template))
    if not config.gateway_id:
        config.gateway_id = f"gw-{socket.gethostname()[:24]}-{uuid.uuid4().hex[:6]}"
    async with Bus.connect(url, prefix=prefix, limits=limits) as bus, \
            beside(cancel_at_exit=True) as tg:
        watcher = MembershipWatcher(bus)
        plane = RolloutPlane(bus, f"g{uuid.uuid4().hex[:12]}",
                             affinity=Affinity(bus, watcher) if config.affinity else None,
                             watcher=watcher)
        store = SessionStore(bus, writer=config.gateway_id,
                             idle_timeout=opts.session_idle_timeout,
                             max_cached=opts.max_cached_sessions,
                             max_bytes=opts.max_session_bytes,
                             wait_timeout=config.request_timeout)
        await tg.start(watcher.run)
        await tg.start(plane.listen)
        await tg.start(store.run)
        gateway = Gateway(bus, plane, watcher, store, fmt, config)
        if why := gateway.ready().get("why"):
            log.warning("%s: requests get 503 (no_workers) until one joins: start `rlfabric "
                        "worker --model %s --prefix %s`", why, config.model, prefix)
        app = create_app(gateway, api_keys=opts.api_keys, max_body_bytes=opts.max_body_bytes)
        sock = socket.socket(socket.AF_INET6 if ":" in opts.host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((opts.host, opts.port))
        ready = anyio.Event()
        server: Any = _server(app, ready)

        async def run_http() -> None:
            await server.serve(sockets=[sock])
            tg.cancel_scope.cancel()  # the HTTP server ended: so does the gateway

        async def stop_on_signal() -> None:
            with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for _ in signals:
                    server.should_exit = True

        tg.start_soon(run_http)
        if handle_signals:
            tg.start_soon(stop_on_signal)
        await ready.wait()
        task_status.started(int(sock.getsockname()[1]))
        await anyio.sleep_forever()
