"""`RLFABRIC_METRICS_PORT`: a process started by one that serves on that port (a worker
`rlfabric up` starts) serves on a free one instead; a value that is not a port is refused."""

from __future__ import annotations

import socket
import urllib.request

import pytest

from rlfabric.telemetry import configure
from rlfabric.telemetry.export import METRICS_PORT_ENV


def test_an_inherited_port_taken_already_serves_on_a_free_one(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        monkeypatch.setenv(METRICS_PORT_ENV, str(port))
        tel = configure(role="worker", prometheus_host="127.0.0.1")
        try:
            assert tel.prometheus_port not in (None, port)
            with urllib.request.urlopen(f"http://127.0.0.1:{tel.prometheus_port}/metrics",
                                        timeout=10) as r:
                assert r.status == 200
            assert f"{METRICS_PORT_ENV}={port}" in caplog.text
            # asked for by the caller, the port is that port or an error
            with pytest.raises(OSError):
                configure(role="worker", prometheus_port=port,
                          prometheus_host="127.0.0.1").shutdown()
        finally:
            tel.shutdown()


def test_a_metrics_port_that_is_not_one_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(METRICS_PORT_ENV, "ninety")
    with pytest.raises(ValueError, match="RLFABRIC_METRICS_PORT='ninety': not a port"):
        configure(role="worker")
