"""Tracing adds spans around the same calls: the same workload run untraced and traced, on a
real in-process worker (null engine: the many-requests path), a real client and a real
nats-server, calls the same functions of the worker and the bus, but for the few that only
make spans. Checked with a profile hook that records every function of rlfabric's worker/ and
bus/ folders that ran."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

import anyio
import pytest
from helpers import collect, req
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import rlfabric.bus
import rlfabric.worker
from rlfabric.bus import Bus
from rlfabric.engines.null import NullEngine
from rlfabric.telemetry import spans
from rlfabric.trainer import FabricClient
from rlfabric.worker import Worker

pytestmark = [pytest.mark.nats, pytest.mark.anyio, pytest.mark.timeout(120)]

ROOTS = tuple(str(Path(m.__file__).parent) for m in (rlfabric.bus, rlfabric.worker))
#: functions whose only job is a span: called when tracing is on, and only then
SPAN_ONLY = {"receiver.py:_apply_traced", "acks.py:_send_traced", "serving.py:_span_attributes",
             "delivery.py:traces", "plane.py:stored", "outbox.py:_trace_headers",
             "outbox.py:<genexpr>"}

#: functions of timers (heartbeats): whether a run calls them depends on how long it took
TIMED = {"membership.py:beat", "membership.py:_on_beat", "membership.py:on_beat",
         "subjects.py:beat"}


@contextmanager
def calls() -> Iterator[set[str]]:
    """The `file:function` of every worker/ and bus/ function called in the block."""
    seen: set[str] = set()

    def hook(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call":
            code = frame.f_code
            if code.co_filename.startswith(ROOTS):
                seen.add(f"{Path(code.co_filename).name}:{code.co_name}")

    sys.setprofile(hook)
    threading.setprofile(hook)
    try:
        yield seen
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]


async def workload(nats_url: str, prefix: str) -> set[str]:
    """A worker joins, serves 2 messages of requests, is paused and resumed."""
    with calls() as seen:
        async with Bus.connect(nats_url, prefix=prefix) as bus, anyio.create_task_group() as tg:
            await tg.start(Worker(bus, NullEngine(), "one", capacity=8).run)
            async with FabricClient.connect(nats_url, prefix=prefix) as fabric:
                await fabric.wait_for_workers(1, timeout=30)
                out = await collect(fabric, [req(f"a{i}", max_tokens=4) for i in range(4)])
                out += await collect(fabric, [req("b", max_tokens=4, n=2)])
                assert (await fabric.pause("wait")).ok == ("one",)
                assert (await fabric.resume()).ok == ("one",)
            tg.cancel_scope.cancel()
    assert sorted((r.request_id, r.sample_index) for r in out) == [
        ("a0", 0), ("a1", 0), ("a2", 0), ("a3", 0), ("b", 0), ("b", 1)]
    return seen


async def test_a_traced_run_calls_the_same_functions_as_an_untraced_one(
        nats_url: str, prefix: str) -> None:
    untraced = await workload(nats_url, prefix + "u")
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    spans.set_tracer(provider.get_tracer("test"))
    try:
        traced = await workload(nats_url, prefix + "t")
    finally:
        spans.set_tracer(None)
        provider.shutdown()
    names = {s.name for s in exporter.get_finished_spans()}
    # the spans were made: the worker's process and engine spans, the acks' sends
    assert {"null generate", "generate"} <= names
    assert any(n.startswith("process ") for n in names)
    untraced, traced = untraced - TIMED, traced - TIMED
    assert untraced - traced == set()
    assert traced - untraced <= SPAN_ONLY, sorted(traced - untraced)
