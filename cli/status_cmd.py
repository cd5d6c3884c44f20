"""`rlfabric status`: members, their versions and states, stream depths, desired state."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import anyio
import msgspec

from rlfabric.bus import Bus, NatsUnavailable, fleet_view
from rlfabric.cli._common import add_bus_options, connect_options
from rlfabric.cli._fleet import (
    COLUMNS,
    command_text,
    desired_json,
    event_row,
    job_rows,
    member_row,
)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="show members, versions, states and queue depths",
                       description="Read the job's membership bucket, streams and desired "
                       "state (read-only: creates nothing).")
    add_bus_options(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.set_defaults(func=run)


async def gather(args: argparse.Namespace) -> dict[str, Any]:
    async with Bus.connect(connect_options(args, "rlfabric-status"), prefix=args.prefix,
                           provision_streams=False) as bus:
        view = await fleet_view(bus)
    return {
        "nats": args.nats,
        "prefix": args.prefix,
        "members": [member_row(m, view) for m in view.members],
        "streams": view.streams,
        "desired_state": desired_json(view),
        "jobs": job_rows(view),
        "checkpoint_claim": msgspec.to_builtins(view.checkpoint) if view.checkpoint else None,
        "commands": [event_row(c) for c in view.commands],
    }


def _table(rows: list[dict[str, Any]], cols: list[str]) -> str:
    widths = {c: max([len(c)] + [len(str(r[c])) for r in rows]) for c in cols}
    lines = ["  ".join(c.upper().ljust(widths[c]) for c in cols)]
    lines += ["  ".join(str(r[c]).ljust(widths[c]) for c in cols) for r in rows]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    try:
        info = anyio.run(gather, args)
    except NatsUnavailable as exc:
        print(f"rlfabric status: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    members = info["members"]
    print(f"job {info['prefix']!r} on {info['nats']}: {len(members)} member(s)")
    if members:
        print(_table(members, COLUMNS))
        for m in members:
            if m["note"]:
                print(f"  {m['worker_id']}: {m['note']}")
    print("\nstreams (messages held): " + ", ".join(
        f"{k}={'absent' if v is None else v}" for k, v in info["streams"].items()))
    print(info["desired_state"]["text"])
    if info["commands"]:
        print("\nlast commands (rlfabric events has every event):")
        for c in info["commands"]:
            print(f"  {command_text(c)}")
    if info["jobs"]:
        print(f"\njobs on the pool: {len(info['jobs'])}")
        print(_table(info["jobs"], ["job", "state", "adapters", "in_flight", "held_by",
                                    "weight", "quota", "tokens_1m", "share_1m",
                                    "weight_share"]))
    return 0
