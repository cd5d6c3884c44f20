"""`rlfabric dashboard`'s server: the fleet's read model (`FleetView`) kept fresh and served to a
web page, live (server-sent events), read-only.

    GET /             the page (`dashboard_page.PAGE`: plain HTML and a little JavaScript)
    GET /api/fleet    the fleet now, as JSON
    GET /api/stream   server-sent events: the fleet as JSON at once, then at every change
    GET /metrics      Prometheus' text format: workers by state, each job's share

The fleet is read again at every join, leave or member update the dashboard's membership
watcher sees, and every second (commands, jobs, the desired state), so the page shows a change
within a second or so of it.
"""

from __future__ import annotations

import collections
import json
import signal
import socket
from collections.abc import AsyncIterator
from typing import Any, get_args

import anyio
import msgspec
from anyio.abc import TaskStatus

from rlfabric.bus import Bus, MembershipWatcher, fleet_view
from rlfabric.bus.control.view import recent_commands
from rlfabric.cli._fleet import command_text, desired_line, event_row, job_rows, member_row
from rlfabric.concurrency.sync import Signal, beside, wait_any
from rlfabric.schemas import CommandEvent, Event, FleetView, SchemaError, codec_for
from rlfabric.schemas.fleet import WorkerState
from rlfabric.telemetry import instruments

#: seconds between two reads of the fleet when nothing moved in membership
REFRESH_S = 1.0
#: tokens/min samples kept for the throughput chart (one per refresh: about 5 minutes)
HISTORY = 300
_EVENT = codec_for(Event)
#: the last commands shown
COMMANDS = 10
#: seconds between keep-alive comments on an idle event stream (proxies drop silent ones)
KEEPALIVE_S = 15.0


class FleetFeed:
    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.watcher = MembershipWatcher(bus)
        #: the fleet now, as the page reads it (JSON)
        self.data = b"{}"
        self.changed = Signal()
        self._told = Signal()  # a command's outcome came
        self._tokens: collections.deque[tuple[float, int]] = collections.deque(maxlen=HISTORY)
        self._commands: collections.deque[CommandEvent] = collections.deque(maxlen=COMMANDS)

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        async with beside(cancel_at_exit=True) as tg:
            await tg.start(self.watcher.run)
            # the last commands read back once, then each as its sender tells it
            self._commands.extend(await recent_commands(self.bus, COMMANDS))
            sub = await self.bus.nc.subscribe(self.bus.subjects.events("command", "*"),
                                              cb=self._on_command)
            try:
                await self._refresh()
                task_status.started()
                while True:
                    await wait_any(self.watcher.changed(), self._told.event(),
                                   timeout=REFRESH_S)
                    await self._refresh()
            finally:
                with anyio.CancelScope(shield=True):
                    await sub.unsubscribe()

    async def _on_command(self, msg: Any) -> None:
        try:
            event = _EVENT.decode(msg.data, msg.headers)
        except SchemaError:
            return
        if isinstance(event, CommandEvent):
            self._commands.append(event)
            self._told.fire()  # shown at once, not at the next refresh

    async def _refresh(self) -> None:
        # members as the watcher sees them: a worker that died is gone once it is found
        # gone, not when its key expires
        view = await fleet_view(self.bus, streams=False, commands=0,
                                members=self.watcher.members)
        view = msgspec.structs.replace(view, commands=tuple(self._commands))
        self._tokens.append((view.at, sum(sum(m.job_tokens.values()) for m in view.members)))
        _gauges(view)
        data = json.dumps(page_model(view, list(self._tokens)), sort_keys=True).encode()
        if data != self.data:
            self.data = data
            self.changed.fire()

    async def stream(self) -> AsyncIterator[bytes]:
        """Server-sent events: the fleet now, then each new one (a keep-alive between)."""
        sent = b""
        while True:
            changed = self.changed.event()
            if self.data != sent:
                sent = self.data
                yield b"data: " + sent + b"\n\n"
            with anyio.move_on_after(KEEPALIVE_S) as idle:
                await changed.wait()
            if idle.cancelled_caught:
                yield b": idle\n\n"


def page_model(view: FleetView, tokens: list[tuple[float, int]]) -> dict[str, Any]:
    """What the page shows: each worker, each job, what the fleet is to serve, the last
    commands with their acks, and tokens served per minute over the last minutes."""
    return {
        "prefix": view.prefix,
        "at": view.at,
        "desired": desired_line(view),
        "workers": [member_row(m, view) for m in view.members],
        "jobs": job_rows(view),
        "commands": [{**row, "text": command_text(row)}
                     for row in map(event_row, reversed(view.commands))],
        "tokens_per_min": [[round(t, 1), n] for t, n in tokens],
    }


def _gauges(view: FleetView) -> None:
    """The dashboard's own metrics: workers by state, and each job's share of the tokens
    served in the last minute."""
    m = instruments.current
    states = collections.Counter(w.state for w in view.members)
    for state in get_args(WorkerState):
        m.fleet_workers.set(states.get(state, 0), {"state": state})
    tokens: collections.Counter[str] = collections.Counter()
    for w in view.members:
        tokens.update(w.job_tokens)
    served = sum(tokens.values())
    for job, n in tokens.items():
        m.job_share.set(n / served if served else 0.0, {"rlfabric.job": job or "(pool)"})


def create_app(feed: FleetFeed) -> Any:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import HTMLResponse, Response, StreamingResponse
    from starlette.routing import Route

    from rlfabric.cli.dashboard_page import PAGE
    from rlfabric.telemetry import prometheus_text

    async def page(request: Request) -> Response:
        return HTMLResponse(PAGE)

    async def fleet(request: Request) -> Response:
        return Response(feed.data, media_type="application/json")

    async def stream(request: Request) -> Response:
        return StreamingResponse(feed.stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store"})

    async def metrics(request: Request) -> Response:
        body, kind = prometheus_text()
        return Response(body, media_type=kind)

    return Starlette(routes=[Route("/", page), Route("/api/fleet", fleet),
                             Route("/api/stream", stream), Route("/metrics", metrics)])


async def serve(bus: Bus, host: str, port: int, *,
                task_status: TaskStatus[int] = anyio.TASK_STATUS_IGNORED) -> None:
    """The dashboard on `host:port` (0: any free port) until cancelled or signalled; started
    with the port it listens on."""
    from rlfabric.gateway.server import _server

    feed = FleetFeed(bus)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    async with beside(cancel_at_exit=True) as tg:
        await tg.start(feed.run)
        ready = anyio.Event()
        server: Any = _server(create_app(feed), ready)

        async def stop_on_signal() -> None:
            with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for _ in signals:
                    server.should_exit = True

        async def run_http() -> None:
            await server.serve(sockets=[sock])
            tg.cancel_scope.cancel()  # the HTTP server ended (a signal): so does the rest

        tg.start_soon(run_http)
        tg.start_soon(stop_on_signal)
        await ready.wait()
        task_status.started(int(sock.getsockname()[1]))
        await anyio.sleep_forever()
