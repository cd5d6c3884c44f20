"""`rlfabric up --task tools`: the gateway the episodes' agents talk to (an `rlfabric gateway`
process over the run's workers, logging to run_dir/gateway.log) and the agent rollouts that
drive it."""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import IO, TYPE_CHECKING

import anyio

from rlfabric.bus.nats.server import die_with_parent
from rlfabric.errors import LaunchError

if TYPE_CHECKING:
    from rlfabric.trainer import FabricClient
    from rlfabric.trainer.tools import AgentRollouts

_SERVING = re.compile(r"serving \S+ at (http://\S+/v1)")


@contextlib.asynccontextmanager
async def gateway(url: str, prefix: str, run_dir: Path, *, connect: list[str] | None = None,
                  timeout: float = 120.0) -> AsyncIterator[str]:
    """An `rlfabric gateway` serving `tinychat` on a free port (`connect`: its key and TLS
    options); its base URL."""
    log = run_dir / "gateway.log"
    proc, reader, found, ready = _spawn(url, prefix, log, connect or [])
    try:
        if not await anyio.to_thread.run_sync(ready.wait, timeout) or not found:
            tail = log.read_text(errors="replace").strip().splitlines()[-5:]
            raise LaunchError(f"the gateway did not start within {timeout:.0f}s (exit code "
                              f"{proc.poll()}): {' | '.join(tail)}")
        yield found[0]
    finally:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(_stop, proc, reader)


def _spawn(url: str, prefix: str, log: Path, connect: list[str],
           ) -> tuple[subprocess.Popen[str], threading.Thread, list[str], threading.Event]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlfabric", "gateway", "--nats", url, "--prefix", prefix,
         "--model", "tinychat", "--tool-call-parser", "tinychat", "--port", "0", *connect],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
        preexec_fn=die_with_parent)
    found: list[str] = []
    ready = threading.Event()
    assert proc.stdout is not None
    reader = threading.Thread(target=_copy, args=(proc.stdout, log, found, ready), daemon=True)
    reader.start()
    return proc, reader, found, ready


def _stop(proc: subprocess.Popen[str], reader: threading.Thread) -> None:
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
    reader.join(timeout=5)


def _copy(out: IO[str], log: Path, found: list[str], ready: threading.Event) -> None:
    """The gateway's output into its log; `ready` once it serves (or it ended)."""
    with open(log, "w") as f:
        for line in out:
            f.write(line)
            f.flush()
            if not found and (m := _SERVING.search(line)):
                found.append(m.group(1))
                ready.set()
    ready.set()


@contextlib.asynccontextmanager
async def agent_rollouts(fabric: FabricClient, url: str, prefix: str, run_dir: Path, *,
                         turn_tokens: int, connect: list[str] | None = None
                         ) -> AsyncIterator[AgentRollouts]:
    try:
        import openai  # noqa: F401  # the agents' client
    except ImportError:
        raise LaunchError("--task tools drives its agents with the openai client: "
                          "pip install 'rlfabric[gateway]'") from None
    from rlfabric.trainer.tools import AgentRollouts, ToolTask

    async with gateway(url, prefix, run_dir, connect=connect) as base:
        agents = AgentRollouts(fabric.bus, base, task=ToolTask(turn_tokens=turn_tokens),
                               check=fabric.pushed.check_spans)
        try:
            yield agents
        finally:
            with anyio.CancelScope(shield=True):
                await agents.close()
