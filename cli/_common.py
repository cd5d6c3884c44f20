"""Options shared by the subcommands that talk to a bus."""

from __future__ import annotations

import argparse
import gc
import os
import re
from typing import TYPE_CHECKING

from rlfabric.bus import ConnectOptions, Limits

if TYPE_CHECKING:
    from rlfabric.telemetry import Telemetry


def add_bus_options(p: argparse.ArgumentParser, *,
                    nats: tuple[str | None, str] | None = None,
                    prefix_default: str | None = None, title: str = "bus",
                    description: str | None = None) -> argparse._ArgumentGroup:
    """The bus flags every command takes (`--nats`, `--prefix`, auth, TLS); the group, for a
    command's own flags beside them. `nats`: (default, help) of a command whose `--nats`
    means something else (`rlfabric up`: none, an embedded server)."""
    g = p.add_argument_group(title, description)
    default, what = nats or (os.environ.get("RLFABRIC_NATS", "nats://127.0.0.1:4222"),
                             "NATS URL(s), comma-separated (env RLFABRIC_NATS; default "
                             "%(default)s)")
    g.add_argument("--nats", metavar="URL", default=default, help=what)
    g.add_argument("--prefix", default=prefix_default or os.environ.get("RLFABRIC_PREFIX", "rl"),
                   help="job prefix of subjects, streams and buckets (default %(default)s)")
    g.add_argument("--user", help="NATS user (with --password)")
    g.add_argument("--password", default=os.environ.get("RLFABRIC_NATS_PASSWORD"),
                   help="NATS password (env RLFABRIC_NATS_PASSWORD)")
    g.add_argument("--token", default=os.environ.get("RLFABRIC_NATS_TOKEN"),
                   help="NATS auth token (env RLFABRIC_NATS_TOKEN)")
    g.add_argument("--creds", help="NATS .creds file (JWT + nkey)")
    g.add_argument("--nkey", help="nkey seed file")
    g.add_argument("--tls-ca", help="CA bundle to verify the server")
    g.add_argument("--tls-cert", help="client certificate (with --tls-key)")
    g.add_argument("--tls-key", help="client certificate key")
    g.add_argument("--wait", type=float, default=5.0, metavar="S",
                   help="seconds to keep trying to reach the server (default %(default)s)")
    g.add_argument("--store-budget", type=size, default=None, metavar="SIZE",
                   help="a job this process creates fits a JetStream store of SIZE (e.g. "
                   "64MB): half split across its streams and buckets, half for weight pushes "
                   "(default: about 1 GiB of caps, plus the pushes). Joining an existing job "
                   "takes that job's sizes whatever this says")
    return g


def size(text: str) -> int:
    """`64MB`, `64MiB`, `1G`, `1048576` as bytes (MB and MiB alike: binary)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r}: a size such as 64MB, 1GiB or 1048576")
    scale = 1024 ** " KMGT".index(m.group(2).upper() or " ")
    return int(float(m.group(1)) * scale)


def limits_of(args: argparse.Namespace) -> Limits | None:
    """The job sizes these flags ask for (None: the defaults)."""
    budget = getattr(args, "store_budget", None)
    return None if budget is None else Limits.for_store(budget)


def connect_options(args: argparse.Namespace, name: str, *,
                    url: str | None = None) -> ConnectOptions:
    """`args`' bus flags as connect options (`url`: instead of `--nats`)."""
    return ConnectOptions.from_url(
        url or args.nats, name=name, user=args.user, password=args.password, token=args.token,
        creds_file=args.creds, nkey_seed_file=args.nkey, tls_ca=args.tls_ca,
        tls_cert=args.tls_cert, tls_key=args.tls_key, connect_wait=args.wait,
    )


def add_telemetry_options(p: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    g = p.add_argument_group(
        "telemetry", "off unless asked; OTLP export too when the OTLP exporter package is "
        "installed and OTEL_EXPORTER_OTLP_ENDPOINT (or OTEL_TRACES_EXPORTER=otlp) is set")
    g.add_argument("--trace", metavar="PATH", default=None,
                   help="append OpenTelemetry spans to PATH as JSON lines (trace_id, span_id, "
                   "parent, name, start, end, attributes, resource); several processes may "
                   "share one file")
    g.add_argument("--metrics", metavar="PATH", default=None,
                   help="append OpenTelemetry metrics to PATH as JSON lines, every 5 s and at "
                   "exit")
    return g


def start_telemetry(args: argparse.Namespace, role: str, worker_id: str = "", *,
                    prometheus: bool = False, prometheus_port: int | None = None) -> Telemetry:
    from rlfabric.telemetry import configure

    return configure(role=role, worker_id=worker_id, trace_path=args.trace,
                     metrics_path=args.metrics, prometheus=prometheus,
                     prometheus_port=prometheus_port)


#: the collector's thresholds in a long-lived process (Python's default: 700, 10, 10)
GC_THRESHOLDS = (10_000, 20, 20)


def settle_heap() -> None:
    """Call once a long-lived process is up: what is alive then (modules, the engine and its
    model, the tokenizer) lives as long as the process, so it leaves the collector's sight and
    a full collection walks only what serving allocates (a pause of a millisecond, not one
    over every object the startup made). The collector then runs on `GC_THRESHOLDS`, not
    Python's default: serving allocates a few tracked objects a message (coroutines, futures,
    decoded messages), nearly all freed by reference count before the message is done, so a
    young collection every 700 of them finds little to free, and fewer, larger ones cost less."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
