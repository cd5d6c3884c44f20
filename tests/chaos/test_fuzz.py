"""Fuzz: more than 10,000 hypothesis-generated payloads on every subject a worker or trainer
reads (control commands, rollout requests, acks, pings, events, results, weight chunks) and in
both KV buckets, with random, missing and unknown-major schema headers, msgpack that looks
like our messages with fields of the wrong type or range, and payloads near the server's
max_payload. Afterwards every worker is alive and serving, a new client connects and pushes an
update, and `rlfabric status` works.
"""

from __future__ import annotations

import subprocess
import sys
from collections import Counter

import anyio
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlfabric.bus import Bus
from rlfabric.bus.nats.server import DEFAULT_MAX_PAYLOAD
from rlfabric.bus.subjects import STATE_KEY
from rlfabric.schemas import (
    CMD_ID_HEADER,
    SCHEMA_HEADER,
    Ack,
    Command,
    Pause,
    RolloutRequest,
    RolloutResult,
    SamplingParams,
    SchemaError,
    Shutdown,
    Sleep,
    WorkerInfo,
    codec_for,
    encode,
)
from rlfabric.tensors.models import build_model

pytestmark = [pytest.mark.nats, pytest.mark.slow, pytest.mark.anyio, pytest.mark.timeout(400)]

TARGETS = ("control.pause", "control.update_weights", "control.shutdown", "control.zzz",
           "live.pause", "rollout.request", "ack", "ping", "events", "result", "weights",
           "kv:members", "kv:state")
PERSISTED = {"control.pause", "control.update_weights", "control.shutdown", "control.zzz",
             "rollout.request", "result", "weights"}

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=40),
                    st.binary(max_size=40))
json_like = st.recursive(scalars, lambda kids: st.one_of(
    st.lists(kids, max_size=5), st.dictionaries(st.text(max_size=10), kids, max_size=5)),
    max_leaves=12)
# real messages, as dicts, with fields replaced by anything
TEMPLATES = [msgspec.msgpack.decode(encode(m)) for m in (
    Pause(cmd_id="c1", mode="wait"),
    RolloutRequest(request_id="r", prompt_token_ids=[1, 2], sampling=SamplingParams()),
    Ack(cmd_id="c1", worker_id="w"),
    WorkerInfo(worker_id="w", host="h", pid=1, engine="torch", model="tiny"),
)]
mutated = st.builds(
    lambda t, changes: {**TEMPLATES[t], **changes},
    st.integers(0, len(TEMPLATES) - 1),
    st.dictionaries(st.sampled_from(sorted({k for t in TEMPLATES for k in t})), json_like,
                    max_size=4))
bodies = st.one_of(
    st.binary(max_size=512),
    json_like.map(msgspec.msgpack.encode),
    mutated.map(msgspec.msgpack.encode),
    mutated.map(msgspec.json.encode),
)
schema_versions = st.one_of(st.none(), st.sampled_from(["1.0", "1.9", "2.0", "99.1", "0.1",
                                                        "", "x.y"]),
                            st.text(max_size=8))
payloads = st.tuples(st.sampled_from(TARGETS), schema_versions,
                     st.one_of(st.none(), st.from_regex(r"[A-Za-z0-9]{1,12}", fullmatch=True)),
                     bodies)


def corpus(n_examples: int) -> list[tuple[str, str | None, str | None, bytes]]:
    out: list[tuple[str, str | None, str | None, bytes]] = []

    @settings(max_examples=n_examples, database=None, deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(st.lists(payloads, min_size=5, max_size=5))
    def collect(batch: list) -> None:
        out.extend(batch)

    collect()
    # near the server's max_payload, on the subjects that persist them, with and without a
    # valid header
    big = DEFAULT_MAX_PAYLOAD - 4096
    for target in ("control.pause", "rollout.request", "kv:members"):
        for version in ("1.0", None):
            out.append((target, version, "big", b"\x81\xa1a" + b"\xff" * big))
    return out


def _stops_workers(body: bytes, headers: dict[str, str]) -> bool:
    try:
        cmd = codec_for(Command).decode(body, headers)
    except SchemaError:
        return False
    return isinstance(cmd, (Shutdown, Sleep))


async def test_fuzz_every_subject_and_bucket_then_serve(nats_url, prefix, workers,
                                                        client) -> None:
    payload_list = corpus(2_200)  # 5 per example: 11,000 + the big ones
    assert len(payload_list) >= 10_000
    procs = workers(["z0"], "--threads", "1") + workers(["z1"], engine="null")
    sent: Counter[str] = Counter()
    async with client() as fabric:
        await fabric.wait_for_workers(2, timeout=60)
        await fabric.update_weights(0, module=build_model("tiny"), transport="nats",
                                    verify="off")
        bus = fabric.bus
        s = bus.subjects
        members, state = bus.buckets.members, bus.buckets.state
        for i, (target, version, token, body) in enumerate(payload_list):
            headers = {}
            if version is not None:
                headers[SCHEMA_HEADER] = version
            if token:
                headers[CMD_ID_HEADER] = token
            subject = {
                "rollout.request": s.rollout_request, "ack": f"{prefix}.ack.{token or 'a'}",
                "ping": s.ping("z0"), "events": s.events("error", token or "x"),
                "result": s.rollout_result(fabric.client_id), "weights": f"{s.weights(0)}.{i}",
            }.get(target) or (f"{prefix}.{target}" if target.startswith(("control.", "live."))
                              else "")
            if subject.startswith(f"{prefix}.control.") and _stops_workers(body, headers):
                sent["skipped: a well-formed shutdown/sleep"] += 1  # obeying it is right
                continue
            if target == "kv:members":
                await members.put(token or f"k{i % 50}", body)
            elif target == "kv:state":
                await state.put(STATE_KEY, body)
            elif target in PERSISTED:
                await bus.js.publish_async(subject, body, headers=headers or None)
            else:
                await bus.nc.publish(subject, body, headers=headers or None)
            sent[target] += 1
            if i % 500 == 499:
                await bus.js.publish_async_completed()
        await bus.js.publish_async_completed()
        await bus.nc.flush()
        print(f"\nfuzz: {len(payload_list)} payloads: {dict(sorted(sent.items()))}")

    dead = {i: p.communicate(timeout=10)[0][-3000:] for i, p in enumerate(procs)
            if p.poll() is not None}
    assert not dead, dead  # every worker alive (else: its last output)
    async with client() as fresh:  # a new client connects despite the garbage in the buckets
        # fake but well-formed member entries (nobody heartbeats them) expire with the TTL
        await fresh.watcher.wait_until(lambda s: set(s.worker_ids) == {"z0", "z1"},
                                       timeout=60)
        await fresh.resume()  # a well-formed pause among the payloads was obeyed
        with anyio.fail_after(180):
            rep = await fresh.update_weights(1, module=build_model("tiny"), transport="nats",
                                             verify="off")
        assert rep.ok == ("z0", "z1")
        got = [r async for r in fresh.generate(
            [RolloutRequest(request_id=f"after{i}", prompt_token_ids=[256, 9],
                            sampling=SamplingParams(max_tokens=4)) for i in range(20)],
            timeout=120)]
        assert len(got) == 20 and all(isinstance(r, RolloutResult) for r in got), got[:3]
        assert {r.worker_id for r in got} <= {"z0", "z1"}
    status = subprocess.run([sys.executable, "-m", "rlfabric", "status", "--nats", nats_url,
                             "--prefix", prefix], capture_output=True, text=True, timeout=60)
    assert status.returncode == 0, status.stderr
    assert "z0" in status.stdout and "z1" in status.stdout, status.stdout
    async with Bus.connect(nats_url, prefix=prefix) as bus:
        assert {"z0", "z1"} <= set(await bus.fleet.members())
