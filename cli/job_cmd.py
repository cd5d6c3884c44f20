"""`rlfabric job create|list|show|delete`: the jobs sharing one pool, and their keys.

A job's key (`DIR/jobs/<job>.nk`, in the key folder `rlfabric nats --auth DIR` serves from)
lets a client act for that job only (`rlfabric.bus.nats.auth.job_permissions`): it connects with
`FabricClient.connect(ConnectOptions.from_url(URL, nkey_seed_file=DIR/jobs/NAME.nk),
job=NAME)`.
Creating or deleting a key has that server read its config again at once; another
nats-server that includes `DIR/auth.conf` is told to with `nats-server --signal reload`.

A job's share of the pool (`create` or `set`, with --nats and the operator's key): workers
share their tokens between the jobs that have work in proportion to their `--weight`s (a job
alone gets every worker), and hold at most `--max-in-flight` of a job's requests at once
(the rest wait in the queue, they are not refused). Both can change while the job runs;
workers read them within a second. `rlfabric status` shows each job's share of the tokens
served in the last minute beside its weight's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import anyio
import msgspec

from rlfabric.bus import Bus, InvalidName, NatsUnavailable, fleet_view
from rlfabric.bus.nats.auth import add_job, job_keys, job_permissions, reload_server, remove_job
from rlfabric.bus.subjects import Subjects
from rlfabric.cli._common import add_bus_options, connect_options
from rlfabric.cli._fleet import job_rows
from rlfabric.schemas import JobShare
from rlfabric.text.builtin import cache_dir
from rlfabric.trainer import FabricClient, PoolOnly


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("job", help="create, list, show or delete the jobs sharing a pool",
                       description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    jsub = p.add_subparsers(dest="job_op", metavar="OP", required=True)
    for op, help_ in (("create", "give a job a key of its own and let it in (and its share)"),
                      ("set", "change a job's weight or quota while it runs"),
                      ("list", "the jobs with a key, and what the pool holds of each"),
                      ("show", "one job: its key, what it may do, its adapters and pause"),
                      ("delete", "take a job's key away (its clients are disconnected)")):
        jp = jsub.add_parser(op, help=help_, description=help_)
        if op != "list":
            jp.add_argument("name", help="the job's name (1-64 of A-Z a-z 0-9 _ -)")
        g = add_bus_options(jp, title="the pool",
                            description="--nats (with the trainer's --nkey) to read what the "
                            "pool holds of the job; --prefix names the pool")
        g.add_argument("--auth", metavar="DIR", default=None,
                       help="the key folder of `rlfabric nats --auth DIR` (default: "
                       f"{cache_dir('keys', '<prefix>')})")
        g.add_argument("--json", action="store_true", help="print one JSON object")
        if op in ("create", "set"):
            sg = jp.add_argument_group("its share of the pool (set on the pool through --nats)")
            sg.add_argument("--weight", type=float, default=None,
                           help="its part of the workers' tokens while jobs compete, against "
                           "the other jobs' weights (default 1; set keeps the current)")
            sg.add_argument("--max-in-flight", type=int, default=None, metavar="N",
                           help="its requests held by the workers at once, at most (default 0: "
                           "no quota; set keeps the current); the rest wait their turn")
        jp.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    keys = Path(args.auth or cache_dir("keys", args.prefix))
    try:
        out = _do(args, keys)
    except (InvalidName, OSError, ValueError, NatsUnavailable, PoolOnly) as exc:
        print(f"rlfabric job {args.job_op}: {exc}", file=sys.stderr)
        return 2
    if args.job_op in ("list", "show"):
        try:
            out["pool"] = anyio.run(_pool, args)
        except NatsUnavailable as exc:
            out["pool"] = None
            out["pool_error"] = str(exc)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        _print(args, out)
    return 0


def _do(args: argparse.Namespace, keys: Path) -> dict[str, Any]:
    op = args.job_op
    out: dict[str, Any] = {"keys": str(keys)}
    if op == "set" or (op == "create" and (args.weight, args.max_in_flight) != (None, None)):
        out["share"] = msgspec.to_builtins(anyio.run(_set_share, args))
        if op == "set":
            out["jobs"] = {}
            return out
    if op == "create":
        add_job(keys, args.name, prefix=args.prefix)
    if op == "delete":
        try:  # its requests answered `job_deleted`, its adapters dropped
            rep = anyio.run(_end, args)
            out["ended"] = {"ok": list(rep.ok), "failed": list(rep.failed),
                            "missing": list(rep.missing)}
        except Exception as exc:  # the key is taken away all the same; said how it failed
            out["ended"] = None
            out["end_error"] = f"{type(exc).__name__}: {exc}"
        if args.name in job_keys(keys):
            remove_job(keys, args.name, prefix=args.prefix)
    if op in ("create", "delete"):
        pid = reload_server(keys)
        out["reloaded"] = pid
    names = [args.name] if op != "list" else list(job_keys(keys))
    out["jobs"] = {n: {"key": str(p)} for n, p in job_keys(keys).items() if n in names}
    if op == "show":
        out["jobs"].setdefault(args.name, {"key": None})
        out["jobs"][args.name]["permissions"] = job_permissions(
            args.name, Subjects(args.prefix)).as_config()
    return out


async def _set_share(args: argparse.Namespace) -> JobShare:
    async with FabricClient.connect(connect_options(args, "rlfabric-job"),
                                    prefix=args.prefix) as operator:
        now = await operator.bus.state.share(args.name)
        share = JobShare(weight=now.weight if args.weight is None else args.weight,
                         max_in_flight=now.max_in_flight if args.max_in_flight is None
                         else args.max_in_flight)
        await operator.set_share(args.name, share)
        return share


async def _end(args: argparse.Namespace) -> Any:
    async with FabricClient.connect(connect_options(args, "rlfabric-job"),
                                    prefix=args.prefix) as operator:
        return await operator.end_job(args.name)


async def _pool(args: argparse.Namespace) -> list[dict[str, Any]]:
    async with Bus.connect(connect_options(args, "rlfabric-job"), prefix=args.prefix,
                           provision_streams=False) as bus:
        rows = job_rows(await fleet_view(bus, streams=False))
    return [r for r in rows if args.job_op == "list" or r["job"] == args.name]


def _print(args: argparse.Namespace, out: dict[str, Any]) -> None:
    op = args.job_op
    if "share" in out:
        sh = out["share"]
        print(f"rlfabric job {op}: job {args.name!r}: weight {sh.get('weight', 1.0):g}, "
              f"quota {sh.get('max_in_flight') or 'none'} (the workers take it within a "
              "second)")
        if op == "set":
            return
    if op in ("create", "delete"):
        what = "key written" if op == "create" else "key removed"
        where = (f"the server (pid {out['reloaded']}) reloaded its users" if out["reloaded"]
                 else "no `rlfabric nats --auth` server runs from this folder: have yours "
                 "reload its config (nats-server --signal reload)")
        key = out["jobs"].get(args.name, {}).get("key") if op == "create" else None
        print(f"rlfabric job {op}: job {args.name!r}: {what}{f' ({key})' if key else ''}; "
              f"{where}")
        if op == "delete":
            ended = out["ended"]
            print(f"  ended on the pool: {len(ended['ok'])} worker(s) acked" if ended else
                  f"  not ended on the pool ({out['end_error']}): pass --nats and the "
                  "trainer's --nkey to answer its requests job_deleted")
        if key:
            print(f"  connect as the job: FabricClient.connect(ConnectOptions.from_url(URL, "
                  f"nkey_seed_file={key!r}), prefix={args.prefix!r}, job={args.name!r})")
        return
    for name, info in out["jobs"].items():
        print(f"job {name}: key {info['key'] or '(none)'}")
        if op == "show":
            perms = info["permissions"]
            print("  may publish: " + ", ".join(perms["publish"]["allow"]))
            print("  may subscribe: " + ", ".join(perms["subscribe"]["allow"]))
    pool = out.get("pool")
    if pool is None:
        print(f"(the pool was not read: {out.get('pool_error', '')})")
    elif pool:
        print("on the pool:")
        for r in pool:
            print(f"  {r['job'] or '(pool)'}: {r['state']}, adapters {r['adapters']}, "
                  f"{r['in_flight']} in flight, held by {r['held_by']}; weight "
                  f"{r['weight']:g}, quota {r['quota']}, {r['tokens_1m']} tokens in the last "
                  f"minute (share {r['share_1m']}, its weight's {r['weight_share']})")
    elif op == "list" and not out["jobs"]:
        print("no job has a key or a state on the pool yet: `rlfabric job create NAME`")
