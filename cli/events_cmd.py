"""`rlfabric events`: the fleet's events read back from its events stream: joins and leaves,
state changes, commands with who acked them, errors."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import sys
import time
from typing import Any

import anyio

from rlfabric.bus import Bus, NatsUnavailable
from rlfabric.bus.control.events import NoEvents, read_events
from rlfabric.cli._common import add_bus_options, connect_options
from rlfabric.cli._fleet import command_text, event_row

KINDS = ("member", "state", "command", "error")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("events", help="the fleet's events: joins, leaves, states, commands",
                       description="Print the events the job's events stream keeps (the "
                       "newest 16 MiB, a week at most): workers joining and leaving, their "
                       "state changes, each command with the workers that acked it, refused "
                       "it or never answered, and errors. Read-only.")
    add_bus_options(p)
    p.add_argument("--since", default="1h", metavar="WHEN",
                   help="from this long ago (30s, 10m, 2h, 1d) or this time (ISO 8601, e.g. "
                   "2026-11-30T10:00); default %(default)s")
    p.add_argument("--follow", "-f", action="store_true",
                   help="keep printing events as they come (Ctrl-C to stop)")
    p.add_argument("--kind", action="append", choices=KINDS, default=None,
                   help="only these kinds (repeat for several; default: all)")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.set_defaults(func=run)


def since(text: str, now: float | None = None) -> float:
    """`--since` as a unix time: a duration back from `now`, or an ISO 8601 time (UTC where it
    names no zone)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd])\s*", text)
    if m:
        return (now if now is not None else time.time()) - float(m.group(1)) * _UNITS[m.group(2)]
    try:
        when = dt.datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--since {text!r}: a duration (30s, 10m, 2h, 1d) or an ISO 8601 time") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)
    return when.timestamp()


def line(event: dict[str, Any]) -> str:
    """One event as a line a person reads."""
    at = dt.datetime.fromtimestamp(event.get("at") or 0.0, dt.UTC)
    head = f"{at:%Y-%m-%d %H:%M:%S.%f}"[:-3] + f"  {event['kind']:<7}"
    kind = event["kind"]
    if kind == "member":
        engine = f" ({event['engine']})" if event.get("engine") else ""
        return f"{head}  {event['worker_id']} {event['change']}{engine}"
    if kind == "state":
        return f"{head}  {event['source']} {event['state']} (v{event['weight_version']})"
    if kind == "command":
        return f"{head}  {command_text(event)}"
    return f"{head}  {event['source']} {event['code']}: {event['message']}"


async def read(args: argparse.Namespace, out: Any) -> int:
    """Print the events since `--since` (and, with `--follow`, those after); how many."""
    kinds = set(args.kind or KINDS)
    printed = 0
    async with Bus.connect(connect_options(args, "rlfabric-events"), prefix=args.prefix,
                           provision_streams=False) as bus:
        async for _, event in read_events(bus, since=since(args.since), follow=args.follow):
            row = event_row(event)
            if row["kind"] in kinds:
                print(json.dumps(row) if args.json else line(row), file=out, flush=True)
                printed += 1
    return printed


def run(args: argparse.Namespace) -> int:
    try:
        since(args.since)
    except argparse.ArgumentTypeError as exc:
        print(f"rlfabric events: {exc}", file=sys.stderr)
        return 2
    try:
        anyio.run(read, args, sys.stdout)
    except (NatsUnavailable, NoEvents) as exc:
        print(f"rlfabric events: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
    return 0
