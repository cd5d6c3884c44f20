"""`rlfabric dashboard`: the fleet on a web page, live (`rlfabric.cli.dashboard`)."""

from __future__ import annotations

import argparse
import sys

import anyio

from rlfabric.bus import Bus, NatsUnavailable
from rlfabric.bus.errors import BusError
from rlfabric.cli._common import add_bus_options, connect_options, start_telemetry

#: seconds between two looks for a job that does not exist yet
JOB_POLL_S = 1.0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("dashboard", help="the fleet on a live web page (read-only)",
                       description="Serve a web page that shows the fleet as it changes: each "
                       "worker with its state, version and load, the jobs and their shares, "
                       "what the fleet is to serve, the last commands with the workers that "
                       "acked, refused or missed them, and tokens served per minute. It reads "
                       "the bus with these credentials (the observer role is enough) and "
                       "changes nothing; it also serves Prometheus metrics on /metrics. Needs "
                       "the gateway extra (pip install 'rlfabric[gateway]').")
    add_bus_options(p)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default %(default)s: this machine only)")
    p.add_argument("--port", type=int, default=8090,
                   help="port to listen on (0: any free one; default %(default)s)")
    p.set_defaults(func=run, trace=None, metrics=None)


async def _run(args: argparse.Namespace) -> None:
    from rlfabric.cli.dashboard import serve

    said = False
    while True:  # read-only: it waits for the job's first process to create it
        async with Bus.connect(connect_options(args, "rlfabric-dashboard"), prefix=args.prefix,
                               provision_streams=False) as bus:
            try:
                _ = bus.buckets  # raises where the job does not exist yet
            except BusError as exc:
                if not said:
                    print(f"rlfabric dashboard: {exc}; waiting for it", flush=True)
                    said = True
                await anyio.sleep(JOB_POLL_S)
                continue
            async with anyio.create_task_group() as tg:
                port = await tg.start(serve, bus, args.host, args.port)
                print(f"rlfabric dashboard: the fleet {args.prefix!r} at "
                      f"http://{args.host}:{port}/", flush=True)
            return


def run(args: argparse.Namespace) -> int:
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        print(f"rlfabric dashboard needs the gateway extra ({exc}): pip install "
              "'rlfabric[gateway]'", file=sys.stderr)
        return 2
    telemetry = start_telemetry(args, "dashboard", prometheus=True)
    try:
        anyio.run(_run, args)
    except NatsUnavailable as exc:
        print(f"rlfabric dashboard: {exc}", file=sys.stderr)
        return 2
    finally:
        telemetry.shutdown()
    return 0
