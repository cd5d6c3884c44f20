"""`rlfabric status`: members, their versions and states, stream depths, desired state."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import anyio
import msgspec

from rlfabric.bus import Bus, NatsUnavailable
from rlfabric.cli._common import add_bus_options, connect_options
from rlfabric.schemas import CheckpointClaim, WorkerInfo


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
        members = await bus.fleet.members()
        depths = await bus.fleet.stream_depths()
        desired = await bus.state.read()
        claim = await bus.state.checkpoint_claim()
    now = time.time()
    return {
        "nats": args.nats,
        "prefix": args.prefix,
        "members": [
            {
                "worker_id": m.worker_id,
                "engine": m.engine,
                "model": m.model,
                "weight_version": m.weight_version,
                "state": m.state,
                "age_s": round(now - m.started_at, 1),
                "key_age_s": round(now - m.heartbeat_at, 1),  # its last key write
                "host": m.host,
                "pid": m.pid,
                "capacity": m.capacity,
                "in_flight": m.in_flight,
                "checkpoint": m.checkpoint[:12],
                "policy": m.policy,
                "adapters": " ".join(f"{n}@{','.join(f'v{v}' for v in vs)}"
                                     for n, vs in sorted(m.adapters.items())) or "-",
                "note": _note(m, claim),
            }
            for m in sorted(members.values(), key=lambda m: m.worker_id)
        ],
        "streams": depths,
        "desired_state": {
            "weight_version": desired.weight_version,
            "policy": desired.policy,
            "paused": desired.paused,
            "pause_mode": desired.pause_mode,
            "group_epoch": desired.group_epoch,
            "transport": msgspec.to_builtins(desired.locator.transport)["kind"]
            if desired.locator else None,
            "adapters": {n: u.version for n, u in sorted(desired.adapters.items())},
        },
        "checkpoint_claim": msgspec.to_builtins(claim) if claim else None,
    }


def _note(m: WorkerInfo, claim: CheckpointClaim | None) -> str:
    if m.behind:
        return f"takes no requests: {m.behind}"
    if claim is not None and m.weight_version < 0 and m.checkpoint and \
            m.checkpoint != claim.checksum:
        return (f"checkpoint differs from version 0 (claimed by {claim.worker_id}): not "
                "serving until a weight push")
    return ""


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
        print(_table(members, ["worker_id", "engine", "model", "weight_version", "state",
                               "age_s", "in_flight", "capacity", "checkpoint", "adapters"]))
        for m in members:
            if m["note"]:
                print(f"  {m['worker_id']}: {m['note']}")
    print("\nstreams (messages held): " + ", ".join(
        f"{k}={'absent' if v is None else v}" for k, v in info["streams"].items()))
    d = info["desired_state"]
    print(f"desired: version {d['weight_version']}"
          + (f" (policy {d['policy']})" if d["policy"] else "") + ", "
          f"{'paused (' + d['pause_mode'] + ')' if d['paused'] else 'running'}, "
          f"transport {d['transport'] or '-'}, group epoch {d['group_epoch']}"
          + "".join(f", adapter {n} v{v}" for n, v in d["adapters"].items()))
    if (c := info["checkpoint_claim"]) is not None:
        print(f"version 0 with no push: checkpoint {c['checksum'][:12]} of {c['model']} "
              f"(first loaded by {c['worker_id']})")
    return 0
