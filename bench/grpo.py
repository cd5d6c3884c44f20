"""Sync vs async GRPO, end to end: `rlfabric up` twice in one command, the same workload,
steps/s and tokens/s side by side (tokens/s = completion tokens over the steps' wall time).

    rlfabric bench grpo [--workers 2] [--steps 20] [--json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile

from rlfabric.bench._util import table


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--json", action="store_true")


def main(args: argparse.Namespace) -> int:
    rows = []
    for mode in ("sync", "async"):
        with tempfile.TemporaryDirectory() as out:
            cmd = [sys.executable, "-m", "rlfabric", "up", "--workers", str(args.workers),
                   "--steps", str(args.steps), "--no-live", "--json", "--threshold", "0",
                   "--out", out] + (["--async"] if mode == "async" else [])
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
            if done.returncode not in (0, 1):
                print(done.stdout[-2000:], done.stderr[-2000:], file=sys.stderr)
                return 1
            s = json.loads(done.stdout.strip().splitlines()[-1])
        rows.append({"mode": mode, "workers": args.workers, "steps": args.steps,
                     "steps_s": s["steps_per_s"], "tokens_s": s["tokens_per_s"],
                     "reward_final": s["reward_final"], "mismatch_mean": s["mismatch_mean"]})
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(table(rows, [("mode", "mode", ""), ("workers", "workers", ""), ("steps", "steps", ""),
                       ("steps_s", "steps/s", ".2f"), ("tokens_s", "tokens/s", ".0f"),
                       ("reward_final", "final reward", ".3f"),
                       ("mismatch_mean", "mismatch", ".1e")]))
    return 0
