"""The `rlfabric` command line: one subcommand per role (see `rlfabric --help`)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from rlfabric import __version__
from rlfabric.cli import (
    bench_cmd,
    ctl_cmd,
    dashboard_cmd,
    events_cmd,
    gateway_cmd,
    job_cmd,
    nats_cmd,
    schema_cmd,
    status_cmd,
    up_cmd,
    worker_cmd,
)

_EPILOG = """\
examples:
  rlfabric up                                     the demo: NATS + 2 workers + GRPO, live
  rlfabric nats --port 4222                       run a NATS+JetStream server for a job
  rlfabric worker --nats nats://127.0.0.1:4222 --engine torch --model tiny
  rlfabric gateway --nats nats://127.0.0.1:4222 --model tinyqwen   the OpenAI API for agents
  rlfabric status --nats nats://127.0.0.1:4222    members, versions, queue depths
  rlfabric events --since 10m --follow            joins, leaves, states, commands and acks
  rlfabric dashboard --nats nats://127.0.0.1:4222 the fleet on a live web page (:8090)
  rlfabric ctl --nats nats://127.0.0.1:4222 pause --mode wait
  rlfabric schema > rlfabric-schema.json          JSON Schema of every wire message
  rlfabric bench rollout                          rlfabric vs aiohttp vs in-process
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rlfabric",
        description="rlfabric: a NATS message-bus rollout fabric for LLM RL post-training.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"rlfabric {__version__}")
    p.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv: debug)")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for mod in (up_cmd, nats_cmd, worker_cmd, gateway_cmd, status_cmd, events_cmd,
                dashboard_cmd, ctl_cmd, job_cmd, schema_cmd, bench_cmd):
        mod.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if rest and not getattr(args, "takes_rest", False):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.rest = rest
    logging.basicConfig(
        level=[logging.WARNING, logging.INFO, logging.DEBUG][min(args.verbose, 2)],
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()
    except BrokenPipeError:  # `rlfabric status | head`: the reader is gone, not an error
        # NOTE: stdout pointed at /dev/null, or the interpreter's own flush at exit raises
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    return code
