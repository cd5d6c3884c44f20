"""Small storage under the filesystem and shm transports (an 8 MiB tmpfs: mounted as the
filesystem transport's root, or as /dev/shm in a mount namespace of its own): a 12 MiB push is
refused before anything is written, naming the sizes; the worker stays a member and acks a
pause meanwhile; the next push that fits lands, and every request is answered once."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from small_storage import scenario

from rlfabric.transports.filesystem import FilesystemTransport

pytestmark = [pytest.mark.nats, pytest.mark.anyio, pytest.mark.timeout(120)]

TESTS = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def small_disk(path: Path, mib: int) -> Iterator[Path]:
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mib}m", "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a {mib} MiB tmpfs here ({mounted.stderr.strip()}): "
                    "the full-disk test needs one")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=False)


def held(got: dict[str, Any]) -> None:
    print(f"\n{got['message'][:40]}...: refused in {got['refused_s']:.3f} s")
    assert got["code"] == "storage_full" and got["refused_s"] < 5.0, got
    assert "needs 12.0 MiB" in got["message"] and "MiB free" in got["message"], got
    assert got["left"] == []  # nothing written
    assert got["paused"] == ["d0"] and got["same_members"]
    assert got["loaded"] == 2 and got["served"] == sorted(f"r{i}" for i in range(8))


async def test_a_filesystem_push_that_does_not_fit_is_refused_and_the_next_lands(
        nats_url, prefix, tmp_path, monkeypatch) -> None:
    with small_disk(tmp_path / "disk", 8) as disk:
        monkeypatch.setattr(FilesystemTransport, "root", str(disk))
        held(await scenario(nats_url, prefix, "filesystem", str(disk)))


async def test_an_shm_push_that_does_not_fit_is_refused_and_the_next_lands(
        nats_url, prefix) -> None:
    script = ("mount -t tmpfs -o size=8m tmpfs /dev/shm && exec "
              f"{sys.executable} {TESTS / 'small_storage.py'} {nats_url} {prefix}")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(TESTS), os.environ.get("PYTHONPATH", "")])}
    try:
        run = await anyio.run_process(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
            env=env, check=False)
    except FileNotFoundError:
        pytest.skip("no `unshare` here: the small-/dev/shm test needs a mount namespace")
    if run.returncode != 0 and b"mount" in run.stderr and not run.stdout:
        pytest.skip(f"cannot mount a small /dev/shm here ({run.stderr.decode()[-300:]})")
    assert run.returncode == 0, run.stderr.decode()[-3000:]
    held(json.loads(run.stdout.decode().strip().splitlines()[-1]))
