"""`rlfabric worker` as a process: how it ends."""

from __future__ import annotations

import subprocess
import sys
import time

import anyio
import pytest

from rlfabric.bus import new_cmd_id
from rlfabric.schemas import Shutdown

pytestmark = [pytest.mark.nats, pytest.mark.anyio]


async def test_shutdown_command_makes_the_worker_exit_0_and_leave(client, workers) -> None:
    (proc,) = workers(["sd0"], engine="null")
    async with client() as fabric:
        await fabric.wait_for_workers(1, timeout=60)
        rep = await fabric.broadcast(Shutdown(cmd_id=new_cmd_id()))
        assert rep.ok == ("sd0",)
        t0 = time.monotonic()
        snap = await fabric.watcher.wait_until(lambda s: s.worker_ids == (), timeout=10)
        left_after = time.monotonic() - t0
        # the process ends on its own: no signal is sent
        rc = await anyio.to_thread.run_sync(lambda: proc.wait(timeout=10))
    assert rc == 0
    assert snap.members == () and left_after < 5.0


def test_a_settled_process_freezes_its_startup_heap_and_collects_on_larger_thresholds() -> None:
    # in a child: freezing and new thresholds would outlive this test in the pytest process
    code = ("import gc; from rlfabric.cli._common import GC_THRESHOLDS, settle_heap; "
            "assert gc.get_threshold() == (700, 10, 10); settle_heap(); "
            "print(gc.get_threshold() == GC_THRESHOLDS, gc.get_freeze_count() > 1000)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout.split()
    assert out == ["True", "True"]
