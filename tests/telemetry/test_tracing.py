"""Traces across processes: a `generate` call and an `update_weights` on a real worker process,
each one trace with spans from the trainer (this process) and the worker, the trace context
carried in NATS headers; a message combining items of two traced calls keeps each one's; and
a traced call refused as too large ends its send span with the error."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import anyio
import pytest

from rlfabric.bus import Bus, EmbeddedNats, PayloadTooLarge
from rlfabric.bus.nats.outbox import Outbox
from rlfabric.bus.subjects import Subjects
from rlfabric.schemas import TRACEPARENTS_HEADER, RolloutRequest, RolloutRequests, SamplingParams
from rlfabric.telemetry import configure, spans
from rlfabric.telemetry.report import process_of, read_spans
from rlfabric.tensors.models import build_model
from rlfabric.trainer import FabricClient

pytestmark = [pytest.mark.nats, pytest.mark.anyio]


def last_points(path: Path, name: str) -> list[dict[str, Any]]:
    """The data points of metric `name` in the last export of a `--metrics` file (cumulative:
    the totals)."""
    last = json.loads(path.read_text().strip().splitlines()[-1])
    return [p for rm in last["resource_metrics"] for sm in rm["scope_metrics"]
            for m in sm["metrics"] if m["name"] == name for p in m["data"]["data_points"]]


def one(found: list[dict[str, Any]], **where: Any) -> dict[str, Any]:
    """The single span matching `where` (name, kind, parent, or an attribute)."""
    hits = [s for s in found if all(
        (s.get(k) if k in ("name", "kind", "parent", "trace_id") else s["attributes"].get(k)) == v
        for k, v in where.items())]
    assert len(hits) == 1, (where, [(s["name"], s["parent"]) for s in found])
    return hits[0]


def messaging(s: dict[str, Any], subject: str, operation: str) -> None:
    a = s["attributes"]
    assert (a["messaging.system"], a["messaging.destination.name"],
            a["messaging.operation.type"]) == ("nats", subject, operation), a


async def test_generate_and_update_weights_are_each_one_trace_across_both_processes(
        client, workers, prefix: str, tmp_path: Path) -> None:
    worker_file, trainer_file = tmp_path / "worker.jsonl", tmp_path / "trainer.jsonl"
    worker_metrics, trainer_metrics = tmp_path / "wm.jsonl", tmp_path / "tm.jsonl"
    (proc,) = workers(["t0"], "--threads", "1", "--trace", str(worker_file),
                      "--metrics", str(worker_metrics))
    tel = configure(role="trainer", trace_path=str(trainer_file),
                    metrics_path=str(trainer_metrics))
    try:
        async with client() as fabric:
            await fabric.wait_for_workers(1, timeout=60)
            await fabric.update_weights(1, module=build_model("tiny"))
            req = RolloutRequest(request_id="r0", prompt_token_ids=[256, 40], min_weight_version=1,
                                 sampling=SamplingParams(max_tokens=4, seed=1))
            out = [r async for r in fabric.generate([req], timeout=60)]
    finally:
        tel.shutdown()
    assert [r.request_id for r in out] == ["r0"]
    proc.send_signal(signal.SIGTERM)  # the worker writes what it buffered as it exits
    assert await anyio.to_thread.run_sync(lambda: proc.wait(timeout=60)) == 0
    trainer, worker = read_spans(str(trainer_file)), read_spans(str(worker_file))
    assert {process_of(s) for s in trainer} == {"trainer"}
    assert {process_of(s) for s in worker} == {"worker t0"}
    assert trainer[0]["resource"]["process.pid"] != worker[0]["resource"]["process.pid"]
    every = trainer + worker
    s = Subjects(prefix)

    # generate -> requests stored -> the worker's process -> engine generate -> result stored
    gen = one(trainer, name="generate", parent=None)
    send = one(trainer, parent=gen["span_id"], kind="PRODUCER")
    messaging(send, s.rollout_request, "send")
    process = one(worker, parent=send["span_id"])
    assert process["trace_id"] == send["trace_id"] == gen["trace_id"]
    assert process["kind"] == "CONSUMER"
    messaging(process, s.rollout_request, "process")
    a = process["attributes"]
    assert a["messaging.consumer.group.name"] == s.rollout_consumer
    assert (a["messaging.message.id"], a["rlfabric.worker.id"],
            a["rlfabric.weight.version"]) == ("r0", "t0", 1)
    engine = one(worker, parent=process["span_id"], name="torch generate")
    result = one(worker, parent=engine["span_id"], kind="PRODUCER")
    messaging(result, s.rollout_result(fabric.client_id), "send")
    # (the worker's send ends at its PubAck, which may come after the result reached us)
    assert gen["start"] <= send["start"] <= process["start"] <= result["start"] <= gen["end"]

    # update_weights -> the command's send (acks as events) -> the worker's handling -> ack
    upd = one(trainer, name="update_weights", parent=None)
    assert upd["attributes"]["rlfabric.weight.version"] == 1
    cmd = one(trainer, parent=upd["span_id"], kind="PRODUCER")
    messaging(cmd, s.control("update_weights"), "send")
    assert cmd["attributes"]["rlfabric.cmd.op"] == "update_weights"
    assert [e["attributes"]["rlfabric.worker.id"] for e in cmd["events"] if e["name"] == "ack"
            ] == ["t0"]
    handled = one(worker, parent=cmd["span_id"])
    assert handled["trace_id"] == upd["trace_id"] and handled["kind"] == "CONSUMER"
    # received as the live copy (one hop), or read from the control stream
    path = handled["attributes"]["rlfabric.cmd.path"]
    messaging(handled, s.live("update_weights") if path == "live"
              else s.control("update_weights"), "process")
    assert handled["attributes"]["messaging.message.id"] == cmd["attributes"]["rlfabric.cmd.id"]
    assert handled["attributes"]["rlfabric.weight.version"] == 1
    inside = {x["name"] for x in worker if x["parent"] == handled["span_id"]}
    assert {"fetch weights", "verify digest", "load weights",
            f"send {s.ack(cmd['attributes']['rlfabric.cmd.id'])}"} <= inside
    # every span's parent is in the files (no link points nowhere), but the two roots
    ids = {x["span_id"] for x in every}
    assert [x["name"] for x in every if x["parent"] not in ids and x["parent"] is not None] == []

    # metrics, as each process exported them at exit
    [results] = last_points(trainer_metrics, "rlfabric.rollout.results")
    assert (results["attributes"], results["value"]) == ({"outcome": "ok"}, 1)
    cmds = {p["attributes"]["rlfabric.cmd.op"]: p for p in
            last_points(trainer_metrics, "rlfabric.control.command.duration")}
    assert cmds["update_weights"]["count"] == 1 and cmds["update_weights"]["sum"] > 0
    assert cmds["update_weights"]["attributes"]["outcome"] == "ok"
    [tokens] = last_points(worker_metrics, "rlfabric.rollout.tokens")
    assert tokens["value"] == len(out[0].completion_token_ids) > 0
    [version] = last_points(worker_metrics, "rlfabric.weight.version")
    assert (version["attributes"], version["value"]) == ({"rlfabric.worker.id": "t0"}, 1)


async def test_a_message_combining_two_traced_calls_carries_each_calls_context(
        nats_url: str, prefix: str, tmp_path: Path) -> None:
    tel = configure(role="trainer", trace_path=str(tmp_path / "spans.jsonl"))
    try:
        async with Bus.connect(nats_url, prefix=prefix) as bus:
            s = bus.subjects
            outbox = Outbox(bus, combine=lambda reqs: RolloutRequests(requests=reqs))
            parents: dict[str, str] = {}

            async def call(rid: str) -> None:
                with spans.span(f"call {rid}") as span:
                    parents[rid] = f"{span.get_span_context().span_id:016x}"
                    r = RolloutRequest(request_id=rid, prompt_token_ids=[1])
                    await outbox.send(s.rollout_request, [(r, rid)])

            async with anyio.create_task_group() as tg:
                await tg.start(outbox.run)
                async with anyio.create_task_group() as calls:  # queued together: one message
                    calls.start_soon(call, "a")
                    calls.start_soon(call, "b")
                tg.cancel_scope.cancel()
            raw = await bus.js.get_msg(s.rollout_stream, 1)
    finally:
        tel.shutdown()
    assert outbox.messages == 1 and outbox.items == 2
    listed = raw.headers[TRACEPARENTS_HEADER].split(",")
    # W3C traceparent: version-trace_id-span_id-flags; each item names its own call's span
    assert [tp.split("-")[2] for tp in listed] == [parents["a"], parents["b"]]
    assert raw.headers["traceparent"] == listed[0]


async def test_a_traced_call_too_large_to_send_ends_its_span_with_the_error(
        tmp_path: Path) -> None:
    path = tmp_path / "spans.jsonl"
    tel = configure(role="trainer", trace_path=str(path))
    try:
        async with EmbeddedNats(max_payload=1 << 20) as srv, \
                FabricClient.connect(srv.url, prefix="big") as fabric:
            huge = RolloutRequest(request_id="huge", prompt_token_ids=list(range(1, 300_001)))
            with pytest.raises(PayloadTooLarge):
                await anext(fabric.generate([huge]))
            assert fabric.rollouts.outstanding == 0
    finally:
        tel.shutdown()
    sent = one(read_spans(str(path)), name="send big.rollout.request")
    assert sent["status"] == "ERROR" and sent["kind"] == "PRODUCER"
