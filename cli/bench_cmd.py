"""`rlfabric bench`: the benchmarks, side by side with the HTTP way, in one run each."""

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
    "weights": ("rlfabric.bench.weights",
                "weight update MB/s per transport beside memcpy and /dev/shm"),
}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="run a benchmark and print its table",
                       description="Benchmarks start their own nats-server and processes; "
                       "they need the `bench` extra (pip install 'rlfabric[bench]').")
    bsub = p.add_subparsers(dest="bench", metavar="BENCH", required=True)
    for name, (module, help_) in BENCHES.items():
        bp = bsub.add_parser(name, help=help_, description=help_)
        bp.set_defaults(func=run, module=module)
        _add_arguments(name, module, bp)


def _add_arguments(name: str, module: str, bp: argparse.ArgumentParser) -> None:
    try:
        importlib.import_module(module).add_arguments(bp)
    except ImportError as exc:
        bp.set_defaults(import_error=exc)


def run(args: argparse.Namespace) -> int:
    if getattr(args, "import_error", None) is not None:
        print(f"rlfabric bench {args.bench}: {args.import_error}; install the bench extra: "
              "pip install 'rlfabric[bench]'", file=sys.stderr)
        return 2
    return int(importlib.import_module(args.module).main(args) or 0)
