"""A real Prometheus server (Debian's `prometheus`) scraping a worker (`--metrics-port`), the
gateway and the dashboard (`/metrics`), and the trainer (this process): after a push and a few
rollouts the metrics are there, read back through Prometheus' HTTP API, with the values the
fleet has."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest
from helpers import req

from rlfabric.bus.nats.cluster import free_ports
from rlfabric.telemetry import configure
from rlfabric.tensors import plan
from rlfabric.tensors.models import build_model
from rlfabric.trainer import FabricClient

PROMETHEUS = shutil.which("prometheus")
pytestmark = [
    pytest.mark.nats,
    pytest.mark.skipif(PROMETHEUS is None, reason="no `prometheus` binary here: "
                       "apt-get install prometheus (.ci/run does)"),
]


def _query(api: str, promql: str) -> list[dict]:
    url = f"{api}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    with urllib.request.urlopen(url, timeout=10) as r:
        out = json.load(r)
    assert out["status"] == "success", out
    return out["data"]["result"]


def _until(api: str, promql: str, ok: Callable[[float], bool], timeout: float = 60.0) -> None:
    """Until the query's one value is `ok` (Prometheus scrapes every second here)."""
    end = time.monotonic() + timeout
    seen: list[dict] = []
    while time.monotonic() < end:
        seen = _query(api, promql)
        assert len(seen) <= 1, seen
        if seen and ok(float(seen[0]["value"][1])):
            return
        time.sleep(0.5)
    raise AssertionError(f"{promql}: {seen or 'no value'} after {timeout}s")


def test_prometheus_scrapes_a_worker_and_the_gateway(nats_url: str, prefix: str, spawn,
                                                    tmp_path: Path) -> None:
    worker = spawn("worker", "--nats", nats_url, "--prefix", prefix, "--worker-id", "m0",
                   "--model", "tinyqwen", "--metrics-port", "0", module="rlfabric")
    metrics = worker.wait_for(r"Prometheus metrics on http://0.0.0.0:(\d+)/metrics", timeout=60)
    gateway = spawn("gateway", "--nats", nats_url, "--prefix", prefix, "--model", "tinyqwen",
                    "--port", "0", module="rlfabric")
    base = gateway.wait_for(r"serving \S+ at (http://\S+)/v1", timeout=60).group(1)
    dashboard = spawn("dashboard", "--nats", nats_url, "--prefix", prefix, "--port", "0",
                      module="rlfabric")
    board = dashboard.wait_for(r"at (http://\S+)/", timeout=60).group(1)
    (port,) = free_ports(1)
    tel = configure(role="trainer", prometheus_port=0, prometheus_host="127.0.0.1")
    targets = {"worker": f"127.0.0.1:{metrics.group(1)}", "gateway": base.split("//")[1],
               "dashboard": board.split("//")[1], "trainer": f"127.0.0.1:{tel.prometheus_port}"}
    (tmp_path / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s}\nscrape_configs:\n" + "".join(
            f"  - job_name: {job}\n    static_configs: [{{targets: ['{t}']}}]\n"
            for job, t in targets.items()))
    prom = subprocess.Popen([PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    api = f"http://127.0.0.1:{port}"
    try:
        async def run() -> None:
            async with FabricClient.connect(nats_url, prefix=prefix) as fabric:
                await fabric.wait_for_workers(1, timeout=60)
                await fabric.update_weights(1, module=build_model("tinyqwen"), transport="nats")
                reqs = [req(f"p{i}", [1, 2, 3 + i], max_tokens=8, temperature=0.0)
                        for i in range(4)]
                out = [r async for r in fabric.generate(reqs, timeout=60)]
                assert len(out) == 4

        anyio.run(run)
        with urllib.request.urlopen(f"{base}/v1/models", timeout=10) as r:
            assert r.status == 200
        full = plan(build_model("tinyqwen").state_dict())[1]
        w = '{job="worker", rlfabric_worker_id="m0"}'
        checks = {
            'up{job="worker"}': lambda v: v == 1,
            'up{job="gateway"}': lambda v: v == 1,
            'up{job="dashboard"}': lambda v: v == 1,
            f"rlfabric_weight_version{w}": lambda v: v == 1,
            'rlfabric_worker_state{job="worker", state="ready"}': lambda v: v == 1,
            'rlfabric_worker_state{job="worker", state="updating"}': lambda v: v == 0,
            f"sum(rlfabric_rollout_tokens_total{w})": lambda v: v == 4 * 8,
            'sum(rlfabric_weight_update_duration_seconds_count{job="worker"})': lambda v: v == 1,
            'sum(rlfabric_weight_update_size_bytes_sum{job="worker"})': lambda v: v == full,
            'sum(rlfabric_gateway_requests_total{job="gateway"})': lambda v: v >= 1,
            'rlfabric_fleet_workers{job="dashboard", state="ready"}': lambda v: v == 1,
            'sum(rlfabric_job_share{job="dashboard"})': lambda v: v == 1,
            f"rlfabric_rollout_queue_depth{w}": lambda v: v == 0,  # all answered
            'rlfabric_rollout_results_total{job="trainer", outcome="ok"}': lambda v: v == 4,
            'sum(rlfabric_weight_push_size_bytes_sum{job="trainer"})': lambda v: v == full,
            'sum(rlfabric_weight_push_duration_seconds_count{job="trainer"})': lambda v: v == 1,
            'rlfabric_control_command_duration_seconds_count{job="trainer", '
            'rlfabric_cmd_op="update_weights", outcome="ok"}': lambda v: v == 1,
            # every token of v1, pushed last: none behind
            'rlfabric_rollout_staleness_versions_bucket{job="trainer", le="0.0"}':
                lambda v: v == 4 * 8,
            'rlfabric_rollout_staleness_versions_count{job="trainer"}': lambda v: v == 4 * 8,
        }
        for promql, ok in checks.items():
            _until(api, promql, ok)
    finally:
        prom.terminate()
        prom.wait(timeout=30)
        tel.shutdown()
