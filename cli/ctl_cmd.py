"""`rlfabric ctl`: operator commands, broadcast with quorum like the trainer's."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from typing import Literal

import anyio
import msgspec
import nats.js.errors

from rlfabric.bus import (
    MembershipChanged,
    NatsUnavailable,
    QuorumNotReached,
    QuorumPolicy,
    fleet_view,
)
from rlfabric.bus.subjects import CHECKPOINT_KEY
from rlfabric.cli._common import add_bus_options, connect_options
from rlfabric.cli._fleet import desired_json, desired_line, note
from rlfabric.schemas import PAUSE_MODES, FanoutReport, FleetView


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "ctl", help="pause / resume / describe / drain workers, with a quorum report",
        description="Broadcast a control command to every worker of the job and print who "
        "acked ok, who failed (and why) and who never answered. Exit 0 when the quorum is "
        "met, 1 when not, 2 when the bus cannot be reached.")
    add_bus_options(p)
    p.add_argument("--timeout", type=float, default=30.0,
                   help="seconds to wait for the quorum (default %(default)s)")
    p.add_argument("--required", default="all",
                   help="'all', a count (e.g. 3) or a fraction (e.g. 0.5) of the members")
    p.add_argument("--shrink", action="store_true",
                   help="go on without workers that leave or die while waiting (default: fail)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    csub = p.add_subparsers(dest="op", metavar="OP", required=True)
    pause = csub.add_parser("pause", help="stop serving (in-flight work per --mode)")
    pause.add_argument("--mode", choices=PAUSE_MODES, default="wait",
                       help="wait: finish in-flight first; abort: cut it short (partial "
                       "results); keep: freeze it until resume (default %(default)s)")
    csub.add_parser("resume", help="serve again")
    csub.add_parser("describe", help="each worker's engine, model, version, load")
    drain = csub.add_parser(
        "drain", help="one worker leaves; its unfinished rollouts go on elsewhere",
        description="Worker WORKER takes no more requests and leaves. Its unfinished samples "
        "go back to their clients at once with the tokens sampled so far, and the clients "
        "continue them on other workers from there: nothing is sampled twice (a request sent "
        "with migration='restart' starts again from its prompt). The other workers ack and "
        "serve on.")
    drain.add_argument("worker", help="the worker's id (rlfabric status lists them)")
    drain.add_argument("--finish", action="store_true",
                       help="finish the unfinished samples first, then leave")
    csub.add_parser(
        "reset-state", help="repair: overwrite the job's desired state with an empty one",
        description="Overwrite the desired state (the <prefix>_state bucket's 'desired' key) "
        "with an empty one: no weight version, not paused, and delete the checkpoint claim "
        "(which checkpoint workers serve as version 0 when no trainer pushed weights). For a "
        "value nobody can read (rlfabric reads it as empty and says so in a warning), or a job "
        "whose workers now start from another checkpoint; the trainer's next update writes a "
        "real one.")
    drop = csub.add_parser(
        "drop-member", help="repair: delete one key of the membership bucket",
        description="Delete a key of the <prefix>_members bucket, e.g. an unreadable one named "
        "in a warning. A live worker of that id writes its key again at its next heartbeat.")
    drop.add_argument("key", help="the membership key (a worker id)")
    csub.add_parser(
        "delete-job", help="repair: delete every stream and bucket of the job",
        description="Delete the job's streams (requests, results, commands, sessions, weights) "
        "and its two KV buckets, and so the JetStream storage set aside for them. For a "
        "finished job: its results and trajectories go with it. Nothing of another --prefix "
        "is touched.")
    p.set_defaults(func=run)


def _required(text: str) -> Literal["all"] | int | float:
    if text == "all":
        return "all"
    return float(text) if "." in text else int(text)


async def _run(args: argparse.Namespace) -> tuple[FanoutReport, FleetView]:
    """The command's report, and the fleet as read after it (what `rlfabric status` reads)."""
    from rlfabric.trainer import FabricClient

    policy = QuorumPolicy(required=_required(args.required), timeout=args.timeout,
                          on_membership_change="shrink" if args.shrink else "fail")
    async with FabricClient.connect(connect_options(args, "rlfabric-ctl"), prefix=args.prefix,
                                    policy=policy) as fabric:
        if args.op == "pause":
            rep = await fabric.pause(mode=args.mode)
        elif args.op == "resume":
            rep = await fabric.resume()
        elif args.op == "drain":
            rep = await fabric.drain(args.worker, move=not args.finish)
        else:
            rep = await fabric.describe()
        return rep, await fleet_view(fabric.bus, streams=False)


async def _repair(args: argparse.Namespace) -> str:
    from rlfabric.bus import Bus
    from rlfabric.schemas import DesiredState

    async with Bus.connect(connect_options(args, "rlfabric-ctl"), prefix=args.prefix,
                           provision_streams=args.op != "delete-job") as bus:
        if args.op == "delete-job":
            gone = await bus.fleet.delete_job()
            return f"job {args.prefix!r}: deleted {', '.join(gone) or 'nothing (none found)'}"
        if args.op == "reset-state":
            await bus.state.put(DesiredState())
            with contextlib.suppress(nats.js.errors.KeyNotFoundError):
                await bus.buckets.state.delete(CHECKPOINT_KEY)
            return (f"desired state of job {args.prefix!r} reset to empty, checkpoint claim "
                    "cleared")
        await bus.buckets.members.delete(args.key)
        return f"membership key {args.key!r} of job {args.prefix!r} deleted"


def _print(rep: FanoutReport, args: argparse.Namespace, view: FleetView | None = None) -> None:
    if args.json:
        out = msgspec.to_builtins(rep)
        if view is not None:
            out["desired_state"] = desired_json(view)
        print(json.dumps(out, indent=2))
        return
    print(f"{rep.op} {rep.cmd_id}: {len(rep.ok)} ok, {len(rep.failed)} failed, "
          f"{len(rep.missing)} missing ({rep.elapsed_s * 1e3:.1f} ms)")
    for w in rep.ok:
        a = rep.acks[w]
        extra = "  ".join(f"{k}={v}" for k, v in sorted(a.detail.items()))
        print(f"  ok       {w}  v{a.weight_version}  {extra}".rstrip())
    for w in rep.failed:
        a = rep.acks[w]
        print(f"  FAILED   {w}  {a.error_code}: {a.error_message}")
    for w in rep.missing:
        print(f"  MISSING  {w}{'  (gone: no ping responder)' if w in rep.dead else ''}")
    if view is not None:
        for m in view.members:
            if why := note(m, view):
                print(f"  {m.worker_id}: {why}")
        print(desired_line(view))


def run(args: argparse.Namespace) -> int:
    if args.op in ("reset-state", "drop-member", "delete-job"):
        try:
            print(anyio.run(_repair, args))
        except NatsUnavailable as exc:
            print(f"rlfabric ctl: {exc}", file=sys.stderr)
            return 2
        return 0
    try:
        rep, view = anyio.run(_run, args)
    except NatsUnavailable as exc:
        print(f"rlfabric ctl: {exc}", file=sys.stderr)
        return 2
    except (QuorumNotReached, MembershipChanged) as exc:
        print(f"rlfabric ctl: {exc}", file=sys.stderr)
        _print(exc.report, args)
        return 1
    except ValueError as exc:
        print(f"rlfabric ctl: {exc}", file=sys.stderr)
        return 2
    _print(rep, args, view)
    return 0
