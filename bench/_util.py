"""Shared helpers of the benchmarks: child processes, percentiles, tables."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def children(cmds: list[list[str]], ready: str | None = None) -> Iterator[list[subprocess.Popen]]:
    """Start Python module processes; with `ready`, wait for that line on each one's stdout.
    All are stopped (SIGTERM, then SIGKILL) on exit."""
    procs = [subprocess.Popen([sys.executable, "-m", *c], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for c in cmds]
    try:
        if ready:
            for p in procs:
                for line in p.stdout:
                    if ready in line:
                        break
                else:
                    raise RuntimeError(f"{' '.join(p.args)} exited before it was ready")
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
            if p.stdout:
                p.stdout.close()


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def table(rows: list[dict], cols: list[tuple[str, str, str]]) -> str:
    """`cols`: (key, header, format)."""
    cells = [[format(r[k], f) if f else str(r[k]) for k, _, f in cols] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, (_, h, _) in enumerate(cols)]
    out = ["  ".join(h.rjust(w) for (_, h, _), w in zip(cols, widths, strict=True))]
    out += ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(out)
