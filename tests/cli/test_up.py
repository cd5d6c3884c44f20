"""`rlfabric up` end to end, as a user runs it."""

from __future__ import annotations

import json
import signal
import subprocess
import sysconfig
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.nats, pytest.mark.slow]

EXE = str(Path(sysconfig.get_path("scripts")) / "rlfabric")


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1].startswith("Z")  # a zombie has exited
    except FileNotFoundError:
        return True


def test_short_run_learns_with_exact_logprobs_and_every_worker_on_the_last_version(
        tmp_path: Path) -> None:
    out = subprocess.run([EXE, "up", "--workers", "2", "--steps", "12", "--threshold", "0.3",
                          "--no-live", "--json", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    rewards = [s["reward"] for s in summary["steps"]]
    assert len(rewards) == 12
    assert summary["reward_first"] < 0.05  # the random policy
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.2  # it learned
    assert summary["mismatch_mean"] is not None and summary["mismatch_mean"] <= 1e-4
    assert summary["all_workers_on_final"] and summary["final_version"] == 12
    assert set(summary["workers_on_final"].values()) == {12}
    assert Path(summary["plot"]).stat().st_size > 10_000  # a real PNG was written


def test_sigint_during_a_run_leaves_no_process_behind(tmp_path: Path) -> None:
    proc = subprocess.Popen([EXE, "up", "--workers", "2", "--steps", "500", "--no-live",
                             "--out", str(tmp_path)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # bounded by the test timeout
            if line.startswith("step 2/"):
                break
        else:
            pytest.fail("rlfabric up ended before training started")
        (pids_file,) = tmp_path.glob("*/pids.json")
        pids = json.loads(pids_file.read_text())
        children = [pids["nats"], *pids["workers"]]
        assert all(not gone(p) for p in children)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130
        deadline = time.monotonic() + 10
        while not all(gone(p) for p in children) and time.monotonic() < deadline:
            time.sleep(0.1)  # reaping is not an event we can await from here
        assert [p for p in children if not gone(p)] == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout:
            proc.stdout.close()
    assert not any(Path(f"/proc/{pid}").exists() and not gone(pid) for pid in [proc.pid])
