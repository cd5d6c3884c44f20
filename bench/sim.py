"""Simulated workers: membership + an ordered command receiver around a no-op engine.

Many per process, one connection. The tests use them as real responders on a real server, and
`rlfabric bench control` uses them to measure what a broadcast costs with the engine taken out.
Each handler can be slowed per op (`--delay pause=30`), and announces on
`<prefix>.events.state.<worker>` that it started (`state="handling:<op>"`), so a test can act
while a command is in flight.

    python -m rlfabric.bench.sim --nats URL --prefix rl --ids w0,w1 [--delay pause=2.5]
"""

from __future__ import annotations

import argparse
import logging
import signal
import time

import anyio
from anyio.abc import TaskStatus

from rlfabric.bus.control.acks import AckFields
from rlfabric.bus.control.membership import Registration, new_worker_info
from rlfabric.bus.control.receiver import CommandContext, CommandReceiver
from rlfabric.bus.nats.connect import ConnectOptions
from rlfabric.bus.session import Bus
from rlfabric.cli._common import settle_heap
from rlfabric.schemas import (
    Collective,
    Command,
    InitTransport,
    StateEvent,
    UpdateWeights,
    op_of,
)

TWO_PHASE = (InitTransport,)
#: the commands a simulated worker acts on (the others: no engine, nothing to do but ack)
ACTING = (UpdateWeights, *TWO_PHASE)
_ACTING_TYPES = frozenset(ACTING)  # a set lookup per command, not an isinstance over a tuple


class SimWorker:
    def __init__(self, bus: Bus, worker_id: str, delays: dict[str, float]) -> None:
        self.bus = bus
        self.worker_id = worker_id
        self.delays = delays
        self._state = (-1, "sim--1")  # what acks report: (weight version, checksum)
        self.reg = Registration(bus, new_worker_info(worker_id, engine="sim", model="none"))
        self.receiver = CommandReceiver(bus, worker_id, self.handle, state=self.state)

    def state(self) -> tuple[int, str]:
        return self._state

    async def handle(self, cmd: Command, ctx: CommandContext) -> AckFields | None:
        if self.delays or type(cmd) in _ACTING_TYPES:
            await self._handle(cmd, ctx)
        return None  # the ack reports `state()`

    async def _handle(self, cmd: Command, ctx: CommandContext) -> None:
        delay = self.delays.get(op_of(cmd))
        if delay is not None:
            await self.bus.emit(StateEvent(source=self.worker_id,
                                           state=f"handling:{op_of(cmd)}", at=time.time()))
            await self.bus.nc.flush()
        two_phase = isinstance(cmd, TWO_PHASE) or (
            isinstance(cmd, UpdateWeights) and isinstance(cmd.transport, Collective))
        if two_phase:
            await ctx.ready()
        if delay is not None:
            await anyio.sleep(delay)
        if isinstance(cmd, UpdateWeights):
            self._state = (cmd.version, f"sim-{cmd.version}")

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        await self.reg.refuse_if_taken()  # before the receiver takes the id's ping subject
        async with anyio.create_task_group() as tg:
            await tg.start(self.receiver.run)  # commands reach us before anyone sees us
            await tg.start(self.reg.run)
            task_status.started()


async def serve(opts: ConnectOptions, prefix: str, ids: list[str],
                delays: dict[str, float]) -> None:
    async with Bus.connect(opts, prefix=prefix) as bus, anyio.create_task_group() as tg:
        for wid in ids:
            await tg.start(SimWorker(bus, wid, delays).run)
        settle_heap()  # as `rlfabric worker` does
        print(f"sim: {len(ids)} worker(s) ready", flush=True)
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for _ in signals:
                tg.cancel_scope.cancel()
                break


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rlfabric.bench.sim", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nats", required=True)
    p.add_argument("--prefix", default="rl")
    p.add_argument("--ids", required=True, help="comma-separated worker ids")
    p.add_argument("--delay", action="append", default=[], metavar="OP=SECONDS",
                   help="make the handler of OP take SECONDS (repeatable)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    delays = {}
    for item in args.delay:
        op, _, secs = item.partition("=")
        delays[op] = float(secs)
    ids = [i for i in args.ids.split(",") if i]
    from rlfabric.telemetry import configure

    tel = configure(role="worker")  # metrics where RLFABRIC_METRICS_PORT asks (bench --metrics)
    try:
        anyio.run(serve, ConnectOptions.from_url(args.nats, name="rlfabric-sim"), args.prefix,
                  ids, delays)
    finally:
        tel.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
