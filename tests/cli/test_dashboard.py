"""`rlfabric dashboard` in a real headless browser (Debian's Chromium driven by Playwright):
a fleet of two workers on the page, a pushed version on it within 2 s, a killed worker gone
within its liveness window; a screenshot of the page written for a person to look at."""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import shutil
import signal
import time
import urllib.request
from pathlib import Path

import anyio
import pytest
import torch

from rlfabric.tensors.models import build_model
from rlfabric.trainer import FabricClient

CHROMIUM = shutil.which("chromium")
pytestmark = [
    pytest.mark.nats,
    pytest.mark.skipif(CHROMIUM is None, reason="no `chromium` here: apt-get install "
                       "chromium (.ci/run does)"),
]


def test_the_page_shows_the_fleet_a_push_and_a_kill(nats_url: str, prefix: str, spawn,
                                                   workers, tmp_path: Path) -> None:
    playwright = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
    (d0,) = workers(["d0"], engine="null")
    workers(["d1"], engine="null")
    dash = spawn("dashboard", "--nats", nats_url, "--prefix", prefix, "--port", "0",
                 module="rlfabric")
    url = dash.wait_for(r"at (http://\S+/)", timeout=60).group(1)

    def push(version: int) -> None:
        async def run() -> None:
            async with FabricClient.connect(nats_url, prefix=prefix) as fabric:
                await fabric.wait_for_workers(2, timeout=60)
                await fabric.update_weights(version, verify="off", transport="nats",
                                            module=build_model("tiny", dtype=torch.bfloat16))
        # its own thread: the browser's sync API holds an event loop in this one
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pool.submit(anyio.run, run).result(timeout=120)

    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 800})
            page.goto(url)
            page.wait_for_selector('tr[data-worker="d0"]', timeout=60_000)
            page.wait_for_selector('tr[data-worker="d1"]', timeout=60_000)
            push(1)
            shown = time.monotonic()
            page.wait_for_selector('tr[data-worker="d0"][data-version="1"]', timeout=10_000)
            page.wait_for_selector('tr[data-worker="d1"][data-version="1"]', timeout=10_000)
            assert time.monotonic() - shown <= 2.0
            page.wait_for_selector('tr[data-op="update_weights"][data-version="1"]',
                                   timeout=10_000)
            assert "d0, d1" in page.inner_text('tr[data-op="update_weights"]')
            d0.send_signal(signal.SIGKILL)
            gone = time.monotonic()
            # a killed worker's connection closes with it: found gone well within the 5 s
            # member_ttl a partition would take, plus a ping
            page.wait_for_selector('tr[data-worker="d0"]', state="detached", timeout=15_000)
            assert time.monotonic() - gone <= 5.0 + 2.0
            assert page.inner_text("#count") == "1"
            shot = tmp_path / "dashboard.png"
            page.screenshot(path=str(shot), full_page=True)
        finally:
            browser.close()
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if out := os.environ.get("RLFABRIC_SCREENSHOTS"):  # kept for a person to look at
        shutil.copy(shot, Path(out) / "dashboard.png")
    with urllib.request.urlopen(f"{url}api/fleet", timeout=10) as r:
        fleet = json.load(r)
    assert [w["worker_id"] for w in fleet["workers"]] == ["d1"]
    with urllib.request.urlopen(f"{url}metrics", timeout=10) as r:
        text = r.read().decode()
    assert re.search(r'rlfabric_fleet_workers\{[^}]*state="ready"[^}]*\} 1\.0', text), text
