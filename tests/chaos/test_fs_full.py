"""The filesystem transport on a small disk (a tmpfs): a push that does not fit is refused before
anything is written, naming the sizes; the next push that fits lands, and the worker serves
throughout."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
import torch
from helpers import collect, req

from rlfabric.bus import Bus
from rlfabric.engines.null import NullEngine
from rlfabric.schemas import RolloutResult
from rlfabric.transports import TransportError
from rlfabric.transports.filesystem import FilesystemTransport
from rlfabric.worker import Worker

pytestmark = [pytest.mark.nats, pytest.mark.anyio, pytest.mark.timeout(120)]

MIB = 1024 * 1024


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


async def test_a_filesystem_push_that_does_not_fit_is_refused_and_the_next_lands(
        nats_url, prefix, client, tmp_path, monkeypatch) -> None:
    with small_disk(tmp_path / "disk", 8) as disk:
        monkeypatch.setattr(FilesystemTransport, "root", str(disk))
        async with Bus.connect(nats_url, prefix=prefix) as bus, \
                anyio.create_task_group() as tg:
            await tg.start(Worker(bus, NullEngine(), "d0", capacity=8).run)
            async with client() as fabric:
                await fabric.wait_for_workers(1, timeout=30)
                t0 = time.monotonic()
                with pytest.raises(TransportError, match=r"needs 12\.0 MiB.*MiB free") as exc:
                    await fabric.update_weights(1, state_dict={"w": torch.randn(3 * MIB)},
                                                transport="filesystem", verify="off")
                refused_s = time.monotonic() - t0
                left = list(os.walk(disk))
                ok = await fabric.update_weights(2, state_dict={"w": torch.randn(MIB // 2)},
                                                 transport="filesystem", verify="off")
                out = await collect(fabric, [req(f"r{i}", max_tokens=2) for i in range(8)])
            tg.cancel_scope.cancel()
    assert exc.value.code == "storage_full" and refused_s < 5.0
    assert all(not files for _, _, files in left)  # nothing written
    assert ok.ok == ("d0",) and ok.acks["d0"].weight_version == 2
    assert sorted(r.request_id for r in out) == [f"r{i}" for i in range(8)]
    assert all(isinstance(r, RolloutResult) for r in out)
