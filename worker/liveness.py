"""What keeps the rollout server's work alive and visible: in-progress acks for messages
generating longer than a third of `ack_wait` (else the stream redelivers them), and the
in-flight count reported to the fleet's members key soon after it changes."""

from __future__ import annotations

import logging
import time

import anyio
import nats.errors

from rlfabric.bus import Registration
from rlfabric.telemetry import instruments, spans
from rlfabric.worker.credits import Credits
from rlfabric.worker.delivery import Delivery

log = logging.getLogger("rlfabric.worker.rollouts")
#: the in-flight count reaches the membership bucket once it held this long (shorter than a
#: batch, longer than the hand-over between two), or this long after a change when it keeps
#: changing; and at most this often
LOAD_SETTLE_S = 0.02
LOAD_REPORT_S = 0.1


class KeepAlive:
    """The messages being served, and their in-progress acks."""

    def __init__(self, ack_wait: float) -> None:
        self.ack_wait = ack_wait
        self._working: dict[int, Delivery] = {}

    def add(self, d: Delivery) -> None:
        self._working[id(d)] = d

    def remove(self, d: Delivery) -> None:
        del self._working[id(d)]

    async def run(self) -> None:
        while True:
            await anyio.sleep(self.ack_wait / 3)
            cutoff = time.monotonic() - self.ack_wait / 3
            for d in list(self._working.values()):
                if d.t0 < cutoff:
                    try:
                        await d.msg.in_progress()
                    except nats.errors.Error as exc:  # a reconnect: the next round sends it
                        log.debug("in-progress ack not sent: %s", exc)


class LoadReport:
    """Tell the fleet soon that we took work or went idle (heartbeats carry it later
    anyway): once the in-flight count held for `LOAD_SETTLE_S`, or `LOAD_REPORT_S` after a
    change if it keeps changing, and at most every `LOAD_REPORT_S`. What the members key
    already holds is not written again: a worker busy batch after batch (idle only while one
    batch's results go out and the next requests come in) writes nothing."""

    def __init__(self, credits: Credits, reg: Registration, worker_id: str) -> None:
        self.credits = credits
        self.reg = reg
        self.worker_id = worker_id
        #: the in-flight count as the fleet is told it
        self.load = 0

    async def run(self) -> None:
        c = self.credits
        news = c.load.event()
        while True:
            await news.wait()
            until = time.monotonic() + LOAD_REPORT_S
            # changed again within LOAD_SETTLE_S (a dip undone by the next message): not
            # settled yet
            while c.in_flight != self.load and (left := until - time.monotonic()) > 0 \
                    and await c.load.wait(min(LOAD_SETTLE_S, left)):
                pass
            news = c.load.event()  # taken before the write: a change during it counts
            self.load = c.in_flight
            instruments.current.queue_depth.set(self.load, {spans.WORKER_ID: self.worker_id})
            if not self.reg.changed():  # the key holds it (heartbeats retry a failed write)
                continue
            try:
                await self.reg.flush()
            except Exception as exc:
                log.debug("in-flight count not published: %s", exc)
            await anyio.sleep(LOAD_REPORT_S)
