"""The command line, as a user runs it: real processes, real server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import rlfabric_exe

from rlfabric.bus.nats.cluster import free_ports

pytestmark = pytest.mark.nats




def test_nats_then_status_json_from_a_shell() -> None:
    port = free_ports(1)[0]
    script = (
        f'"{rlfabric_exe()}" nats --port {port} > nats.log 2>&1 & NATS_PID=$!\n'
        f'"{rlfabric_exe()}" status --nats nats://127.0.0.1:{port} --json --wait 15; rc=$?\n'
        'kill -TERM $NATS_PID; wait $NATS_PID; echo "nats-exit=$?" >&2; exit $rc\n'
    )
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60,
                         cwd=os.environ.get("TMPDIR", "/tmp"))
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["prefix"] == "rl" and info["members"] == []
    assert set(info["streams"]) >= {"RL_ROLLOUT", "RL_CONTROL", "RL_RESULTS", "RL_WEIGHTS"}
    assert info["desired_state"]["weight_version"] == -1
    assert "nats-exit=0" in out.stderr


def test_status_lists_members(nats_url: str, prefix: str, spawn) -> None:
    spawn("--nats", nats_url, "--prefix", prefix, "--ids", "s1,s2").wait_for("ready")
    out = subprocess.run([rlfabric_exe(), "status", "--nats", nats_url, "--prefix", prefix,
                          "--json"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert [m["worker_id"] for m in info["members"]] == ["s1", "s2"]
    assert info["members"][0]["engine"] == "sim"
    assert info["streams"]["RL_ROLLOUT".replace("RL", info["prefix"].upper())] == 0
    table = subprocess.run([rlfabric_exe(), "status", "--nats", nats_url, "--prefix", prefix],
                           capture_output=True, text=True, timeout=30)
    assert "2 member(s)" in table.stdout and "s2" in table.stdout


def test_status_without_server_says_so() -> None:
    out = subprocess.run([rlfabric_exe(), "status", "--nats",
                          f"nats://127.0.0.1:{free_ports(1)[0]}", "--wait", "0.5"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2
    assert "no NATS server answered" in out.stderr


def test_nats_stops_on_sigint_and_leaves_nothing() -> None:
    proc = subprocess.Popen([rlfabric_exe(), "nats", "--port", "0"], stdout=subprocess.PIPE,
                            text=True)
    try:
        line = proc.stdout.readline()
        assert "ready at nats://127.0.0.1:" in line
        store = line.split("JetStream store ")[1].split(")")[0]
        assert os.path.isdir(store)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=15) == 0
        assert not os.path.exists(store)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()


def test_schema_prints_every_message() -> None:
    out = subprocess.run([sys.executable, "-m", "rlfabric", "schema"], capture_output=True,
                         text=True, timeout=30)
    doc = json.loads(out.stdout)
    assert {"RolloutRequest", "RolloutResult", "Pause", "UpdateWeights", "Ack",
            "WorkerInfo"} <= set(doc["messages"])


def test_help_explains_each_command() -> None:
    out = subprocess.run([rlfabric_exe(), "--help"], capture_output=True, text=True, timeout=30)
    for cmd in ("up", "nats", "worker", "status", "ctl", "schema", "bench"):
        assert cmd in out.stdout
    out = subprocess.run([rlfabric_exe(), "nats", "--help"], capture_output=True, text=True,
                         timeout=30)
    assert "--store-dir" in out.stdout and "--port" in out.stdout
    out = subprocess.run([rlfabric_exe(), "bench", "--help"], capture_output=True, text=True,
                         timeout=30)
    for bench in ("rollout", "control", "weights", "grpo"):
        assert bench in out.stdout


def test_worker_refuses_out_of_range_flags_before_it_starts() -> None:
    for flag, value in (("--capacity", "0"), ("--prefetch", "-1"), ("--poll-max", "0.5"),
                        ("--poll-max", "nan")):
        out = subprocess.run([rlfabric_exe(), "worker", "--nats", "nats://127.0.0.1:1",
                              "--engine", "null", flag, value],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 2, (flag, value, out.stderr)
        assert "--poll-max >= 1" in out.stderr and value in out.stderr


def test_ctl_pause_describe_resume_report_every_worker(nats_url: str, prefix: str, spawn) -> None:
    spawn("--nats", nats_url, "--prefix", prefix, "--ids", "o1,o2").wait_for("ready")
    base = [rlfabric_exe(), "ctl", "--nats", nats_url, "--prefix", prefix, "--timeout", "10"]
    out = subprocess.run([*base, "pause", "--mode", "keep"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert "2 ok, 0 failed, 0 missing" in out.stdout and "ok       o2" in out.stdout
    out = subprocess.run([*base, "--json", "describe"], capture_output=True, text=True,
                         timeout=60)
    rep = json.loads(out.stdout)
    assert rep["op"] == "describe" and rep["ok"] == ["o1", "o2"]
    out = subprocess.run([*base, "resume"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "2 ok" in out.stdout


def test_ctl_without_workers_fails_with_a_reason(nats_url: str, prefix: str) -> None:
    out = subprocess.run([rlfabric_exe(), "ctl", "--nats", nats_url, "--prefix", prefix,
                          "--timeout", "2", "pause"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert "no workers were members" in out.stderr


def test_status_and_describe_agree_before_and_after_a_push(nats_url: str, prefix: str,
                                                           workers) -> None:
    """What `status` and `ctl describe` say of each worker's version, and of what the fleet
    serves, is the same: with nothing pushed (the checkpoint, as version 0), then at v1."""
    import anyio

    from rlfabric.tensors.models import build_model
    from rlfabric.trainer import FabricClient

    workers(["a0", "a1"], "--threads", "1")

    def read() -> tuple[dict, dict]:
        args = ["--nats", nats_url, "--prefix", prefix, "--json"]
        status = subprocess.run([rlfabric_exe(), "status", *args], capture_output=True,
                                text=True, timeout=60)
        describe = subprocess.run([rlfabric_exe(), "ctl", *args, "describe"],
                                  capture_output=True, text=True, timeout=60)
        assert status.returncode == describe.returncode == 0, (status.stderr, describe.stderr)
        return json.loads(status.stdout), json.loads(describe.stdout)

    async def push() -> None:
        async with FabricClient.connect(nats_url, prefix=prefix) as fabric:
            await fabric.wait_for_workers(2, timeout=60)
            await fabric.update_weights(1, module=build_model("tiny"))
            await fabric.watcher.wait_until(
                lambda s: all(m.weight_version == 1 for m in s.members), timeout=10)

    async def joined() -> None:
        async with FabricClient.connect(nats_url, prefix=prefix) as fabric:
            await fabric.watcher.wait_until(
                lambda s: len(s.members) == 2 and all(m.weight_version == 0
                                                      for m in s.members), timeout=60)

    anyio.run(joined)
    for version in (0, 1):
        if version:
            anyio.run(push)
        status, describe = read()
        listed = {m["worker_id"]: m["weight_version"] for m in status["members"]}
        acked = {w: a["weight_version"] for w, a in describe["acks"].items()}
        assert listed == acked == {"a0": version, "a1": version}
        assert status["desired_state"] == describe["desired_state"]
        assert status["desired_state"]["serving"] == version
        text = status["desired_state"]["text"]
        assert ("nothing pushed yet" in text) == (version == 0), text


def test_status_into_a_closed_pipe_exits_quietly(nats_url: str) -> None:
    """`rlfabric status | head` with the reader gone before status writes: no traceback."""
    read, write = os.pipe()
    os.close(read)  # nobody will read: the first write meets a broken pipe
    try:
        out = subprocess.run([rlfabric_exe(), "status", "--nats", nats_url], stdout=write,
                             stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(write)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr


def test_up_and_nats_write_nothing_into_the_working_directory(tmp_path: Path) -> None:
    """`up` (its run folder) and `nats --tls --auth` with their default paths write under the
    user's cache ($XDG_CACHE_HOME), not where they were started; keys are mode 0600."""
    cwd, cache = tmp_path / "work", tmp_path / "cache"
    cwd.mkdir()
    env = {**os.environ, "XDG_CACHE_HOME": str(cache)}
    up = subprocess.run([rlfabric_exe(), "up", "--steps", "2", "--threshold", "-1",
                         "--no-live"], cwd=cwd, env=env, capture_output=True, text=True,
                        timeout=300)
    assert up.returncode == 0, up.stdout[-2000:] + up.stderr[-2000:]
    assert f"plot: {cache}/rlfabric/runs/" in up.stdout
    port = free_ports(1)[0]
    with subprocess.Popen([rlfabric_exe(), "nats", "--port", str(port), "--tls", "--auth"],
                          cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True) as nats:
        try:
            assert nats.stdout is not None
            lines = [nats.stdout.readline() for _ in range(6)]
            assert any("ready at tls://" in line for line in lines), lines
        finally:
            nats.send_signal(signal.SIGTERM)
            nats.wait(timeout=30)
    assert list(cwd.iterdir()) == []
    keys, tls = cache / "rlfabric" / "keys" / "rl", cache / "rlfabric" / "tls"
    for secret in (keys / "worker.nk", keys / "gateway.nk", tls / "client-key.pem"):
        assert secret.stat().st_mode & 0o777 == 0o600, secret
    assert (tls / "ca.pem").exists()
