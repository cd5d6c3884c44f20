"""Shared helpers of the benchmarks: child processes, percentiles, tables."""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator

import anyio

from rlfabric.errors import LaunchError


@contextlib.contextmanager
def environ(env: dict[str, str]) -> Iterator[None]:
    """`env` in this process's environment (so children started meanwhile inherit it), the
    previous values back afterwards."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.asynccontextmanager
async def children(cmds: list[list[str]], ready: str | None = None,
                   timeout: float = 120.0) -> AsyncIterator[list[subprocess.Popen]]:
    """Start Python module processes; with `ready`, wait for that line on each one's output
    (in a thread: the event loop, and the caller's NATS connection, keep running). Their
    output is drained (a full pipe would block them) and shown if one fails to start. All are
    stopped (SIGTERM, then SIGKILL) on exit."""
    procs: list[subprocess.Popen[str]] = []
    logs: list[collections.deque[str]] = []
    readies: list[threading.Event] = []
    threads: list[threading.Thread] = []
    for c in cmds:
        p = subprocess.Popen([sys.executable, "-m", *c], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
        log: collections.deque[str] = collections.deque(maxlen=50)
        ev = threading.Event()
        t = threading.Thread(target=_drain, args=(p, log, ev, ready), daemon=True)
        t.start()
        procs.append(p)
        logs.append(log)
        readies.append(ev)
        threads.append(t)
    try:
        for c, p, log, ev in zip(cmds, procs, logs, readies, strict=True):
            deadline = time.monotonic() + timeout
            while ready and not await anyio.to_thread.run_sync(ev.wait, 0.5):
                if p.poll() is not None or time.monotonic() > deadline:
                    raise LaunchError(f"{' '.join(c[:2])} did not get ready "
                                       f"(exit code {p.poll()}): " + " | ".join(log))
        try:
            yield procs
        except BaseException:
            for c, log in zip(cmds, logs, strict=True):
                print(f"--- output of {' '.join(c)}:\n" + "\n".join(log),
                      file=sys.stderr)
            raise
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
        for t in threads:
            t.join(timeout=5)


@contextlib.contextmanager
def metrics_on(on: bool) -> Iterator[None]:
    """`--metrics`: Prometheus metrics on in this process and in every worker it starts (each
    on a free port), as an operator scraping the fleet runs it."""
    if not on:
        yield
        return
    from rlfabric.telemetry import configure
    from rlfabric.telemetry.export import METRICS_PORT_ENV

    with environ({METRICS_PORT_ENV: "0"}):
        tel = configure(role="trainer", prometheus_port=0)
        try:
            yield
        finally:
            tel.shutdown()


def _drain(p: subprocess.Popen, log: collections.deque, ev: threading.Event,
           ready: str | None) -> None:
    assert p.stdout is not None
    with p.stdout:
        for line in p.stdout:
            log.append(line.rstrip())
            if ready and ready in line:
                ev.set()


def child_pids() -> set[int]:
    """The pids of this process's children now (Linux /proc; none elsewhere)."""
    me, found = os.getpid(), set()
    with contextlib.suppress(OSError):
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                with contextlib.suppress(OSError, ValueError, IndexError), \
                        open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rpartition(")")[2].split()[1]) == me:
                        found.add(int(entry))
    return found


def named(pid: int, name: str) -> bool:
    """Whether process `pid` runs the executable `name` (Linux /proc)."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip() == name
    except OSError:
        return False


def cpu_seconds(pids: list[int], *, thread: bool = False) -> float:
    """User + system CPU seconds the processes `pids` have used so far, to the nanosecond on
    Linux (a process's CPU clock; `thread`: its main thread's scheduler count in /proc, a Python
    process's event loop without its engine's threads), else from /proc's clock ticks (10 ms
    steps: per-request figures over short rounds would be noise); NaN without /proc, or when
    one is gone."""
    total = 0.0
    for pid in pids:
        try:
            if thread:
                with open(f"/proc/{pid}/task/{pid}/schedstat") as f:
                    total += int(f.read().split()[0]) / 1e9
                continue
            total += time.clock_gettime(_process_clock(pid))
        except (OSError, ValueError, IndexError):
            ticks = _ticks(pid, thread)
            if ticks != ticks:  # NaN: no /proc, or the process is gone
                return ticks
            total += ticks
    return total


def _process_clock(pid: int) -> int:
    """The clock id of process `pid`'s CPU time (Linux: `clock_getcpuclockid`'s encoding,
    CPUCLOCK_SCHED of the process); `clock_gettime` fails on it elsewhere."""
    if sys.platform != "linux":
        raise OSError("no process CPU clocks here")
    return ((~pid) << 3) | 2


def _ticks(pid: int, thread: bool) -> float:
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    try:
        with open(f"/proc/{pid}/task/{pid}/stat" if thread else f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / tick  # utime, stime


def descendants(pids: list[int]) -> list[int]:
    """`pids` and every process below them (Linux /proc; `pids` alone elsewhere)."""
    try:
        parent = {}
        for d in os.listdir("/proc"):
            if d.isdigit():
                with contextlib.suppress(OSError), open(f"/proc/{d}/stat") as f:
                    parent[int(d)] = int(f.read().rpartition(")")[2].split()[1])
    except OSError:
        return list(pids)
    out, todo = [], list(pids)
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += [c for c, p in parent.items() if p == pid]
    return out


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
