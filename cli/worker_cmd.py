"""`rlfabric worker`: one engine replica on the bus."""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import socket
import sys

import anyio
from anyio.abc import TaskStatus

from rlfabric.bus import Bus, NatsUnavailable
from rlfabric.bus.control.receiver import POLL_MAX
from rlfabric.cli._common import (
    add_bus_options,
    add_telemetry_options,
    connect_options,
    limits_of,
    settle_heap,
    start_telemetry,
)
from rlfabric.concurrency.sync import beside
from rlfabric.engines import registry
from rlfabric.engines.errors import EngineDied
from rlfabric.engines.kinds import DTYPES, OPENMP_SPIN
from rlfabric.engines.protocol import Engine
from rlfabric.schemas import RLFabricError
from rlfabric.schemas.models import BUILTIN
from rlfabric.text.builtin import cache_dir
from rlfabric.worker.admission import MAX_REQUEST_TOKENS
from rlfabric.worker.runtime import CAPACITY, check_knobs

log = logging.getLogger("rlfabric.worker")


MODEL_HELP = (
    "a local Hugging Face checkpoint directory, or a built-in model (random weights, written "
    f"once under {cache_dir('checkpoints')} for engines that load from a directory): "
    f"{', '.join(BUILTIN)}. tiny: byte tokens; tiny64: the same with 64-wide heads (vLLM's CPU "
    "build needs them); tinychat: bytes with a chat template and a one-token tool call; "
    "tinylora: tinychat with a head a LoRA adapter can steer; tinyqwen: the Qwen2.5 tokenizer; "
    "small64: a 9.4M-parameter body; qwen05b: Qwen2.5-0.5B's shape (default %(default)s)")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "worker", help="run one inference worker (engine + bus runtime)",
        description="Join the job's membership, take rollout requests from the workers' queue "
        "group up to --capacity at a time, answer commands (pause, resume, update_weights, ...) "
        "in order. SIGTERM / Ctrl-C: stop taking requests, finish in-flight ones, leave, exit 0.")
    add_bus_options(p)
    p.add_argument("--engine", default="torch", choices=registry.names(),
                   help=registry.engine_help())
    p.add_argument("--model", default="tiny", help=MODEL_HELP)
    p.add_argument("--worker-id", default=None,
                   help="unique id on the bus (default: <host>-<pid>); letters, digits, _ -")
    p.add_argument("--capacity", type=int, default=CAPACITY,
                   help="requests in flight at most (default %(default)s)")
    p.add_argument("--max-request-tokens", type=int, default=MAX_REQUEST_TOKENS, metavar="N",
                   help="tokens one request may ask for, n x max_tokens (default %(default)s): "
                   "a request past it is refused at once (request_too_large), so no client "
                   "holds this worker's time and memory without bound")
    p.add_argument("--prefetch", type=int, default=0, metavar="N",
                   help="requests taken beyond --capacity and held until the engine has room, "
                   "so its next batch is in hand when one ends rather than one pull later "
                   "(default %(default)s: none). Worth it with one worker and a queue longer "
                   "than its capacity; in a fleet, held requests wait for this worker while "
                   "another may be free")
    p.add_argument("--poll-max", type=float, default=POLL_MAX, metavar="S",
                   help="longest wait between two reads of the control stream while no command "
                   "comes (they double from 1 s up to this; default %(default)s). A command's "
                   "live copy needs no poll: a larger value costs an idle server less in a "
                   "fleet of tens of thousands (docs/scaling.md), and a command whose live copy "
                   "was lost waits for the sender's ping or the next poll")
    p.add_argument("--threads", type=int, default=0,
                   help="torch CPU threads (default: torch's own choice; set it when several "
                   "workers share a machine). A torch worker's idle OpenMP threads spin "
                   f"GOMP_SPINCOUNT={OPENMP_SPIN} rounds before they sleep, not libgomp's "
                   "300,000 (milliseconds of a core after every batch), unless "
                   "GOMP_SPINCOUNT or OMP_WAIT_POLICY is set")
    p.add_argument("--max-batch", type=int, default=registry.MAX_BATCH,
                   help="sequences decoded together (torch engine; vLLM's max_num_seqs) "
                   "(default %(default)s)")
    p.add_argument("--dtype", default="float32", choices=DTYPES,
                   help="the engine's weights and compute dtype (default %(default)s: logprobs "
                   "equal to a float32 trainer's forward pass); pushes must carry it too "
                   "(a bfloat16 trainer: --dtype bfloat16)")
    p.add_argument("--max-adapters", type=int, default=None, metavar="N",
                   help=f"LoRA adapters (by name) held at once (default: {registry.MAX_ADAPTERS} "
                   "on torch; 0, LoRA off, on vllm); past it the least recently used is "
                   "unloaded and loaded again when a request names it")
    p.add_argument("--adapter-versions", type=int, default=registry.ADAPTER_VERSIONS,
                   metavar="K", help="versions of each adapter kept loaded, so requests running "
                   "under an older one finish on it; a request for a dropped one fails "
                   "version_unavailable (default %(default)s)")
    registry.add_worker_options(p)
    g = add_telemetry_options(p)
    g.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                   help="serve Prometheus metrics on http://0.0.0.0:PORT/metrics (0: any free "
                   "port, printed at start): state, weight version, requests in flight, tokens, "
                   "weight updates' bytes and seconds (docs/observability.md)")
    p.set_defaults(func=run)


def default_worker_id() -> str:
    host = re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname())[:40]
    return f"{host}-{os.getpid()}"


async def serve(args: argparse.Namespace) -> None:
    registry.prepare_process(args.engine, args.threads)
    engine = registry.make_engine(args.engine, args.model, **registry.options_from(args))
    worker_id = args.worker_id or default_worker_id()
    telemetry = start_telemetry(args, "worker", worker_id, prometheus_port=args.metrics_port)
    if telemetry.prometheus_port is not None:
        print(f"rlfabric worker {worker_id}: Prometheus metrics on "
              f"http://0.0.0.0:{telemetry.prometheus_port}/metrics", flush=True)
    try:
        await _serve(args, engine, worker_id)
    finally:
        telemetry.shutdown()  # what is buffered is written


async def _serve(args: argparse.Namespace, engine: Engine, worker_id: str) -> None:
    from rlfabric.worker import Worker

    async with Bus.connect(connect_options(args, f"rlfabric-worker-{worker_id}"),
                           prefix=args.prefix, limits=limits_of(args)) as bus:
        worker = Worker(bus, engine, worker_id, capacity=args.capacity, prefetch=args.prefetch,
                        poll_max=args.poll_max, max_request_tokens=args.max_request_tokens)
        # NOTE: signals are caught before the worker joins: a SIGTERM that lands while it
        # takes its first requests still drains it
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with beside() as tg:  # a dead engine's error raised as itself
                async def serve_until_drained(*, task_status: TaskStatus[None]) -> None:
                    await worker.run(task_status=task_status)
                    # drained (a signal, or a Shutdown command): the process ends
                    tg.cancel_scope.cancel()

                await tg.start(serve_until_drained)
                settle_heap()
                print(f"rlfabric worker {worker_id}: ready ({engine.name} engine, model "
                      f"{engine.model}, capacity {args.capacity}) on {args.nats}", flush=True)
                async for _ in signals:
                    print(f"rlfabric worker {worker_id}: draining", flush=True)
                    worker.drain()


def run(args: argparse.Namespace) -> int:
    try:
        check_knobs(capacity=args.capacity, prefetch=args.prefetch, poll_max=args.poll_max)
    except ValueError:
        print("rlfabric worker: --capacity must be >= 1, --prefetch >= 0 and --poll-max >= 1 "
              f"(got {args.capacity}, {args.prefetch}, {args.poll_max})", file=sys.stderr)
        return 2
    try:
        anyio.run(serve, args)
    except NatsUnavailable as exc:
        print(f"rlfabric worker: {exc}", file=sys.stderr)
        return 2
    except EngineDied as exc:
        print(f"rlfabric worker: {exc}", file=sys.stderr)
        return 3
    except (RLFabricError, ValueError) as exc:
        print(f"rlfabric worker: {exc}", file=sys.stderr)
        return 2
    return 0
