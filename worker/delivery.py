"""What the rollout server serves: a delivered message (pulled from the shared queue, or
offered to this worker directly) and the keys its results are stored under."""

from __future__ import annotations

from dataclasses import dataclass, field

from nats.aio.msg import Msg

from rlfabric.schemas import TRACEPARENTS_HEADER, RolloutRequest


@dataclass(eq=False)
class Delivery:
    """One delivered message and its requests still being served."""

    msg: Msg
    left: int  # requests the lanes still serve (a message served at once counts in `_Many`)
    t0: float
    back: float | None = None  # set: nak with this delay once all are done (serve again)
    #: adapters its admitted requests hold resident until it is done (`Residency.pin`)
    pins: list[str] = field(default_factory=list)

    #: a part of a message split between engine calls: the message's own delivery, which is
    #: acked once its last part is done
    whole: Delivery | None = None
    parts: int = 0  # parts of this message being served
    rest: int = 0  # requests of this message waiting for a part of their own

    def serve_again(self, delay: float) -> None:
        """Nak the message (after `delay` at least) once all its requests are done."""
        self.back = max(self.back or 0.0, delay)

    def part(self, n: int, rest: int) -> Delivery:
        """The next `n` requests as a part of their own; `rest` are left waiting."""
        self.parts += 1
        self.rest = rest
        return Delivery(self.msg, n, self.t0, whole=self)

    def part_done(self) -> Delivery | None:
        """A part is done: the message's delivery if that was its last (to ack), else None."""
        w = self.whole
        if w is None:
            return self
        if self.back is not None:
            w.serve_again(self.back)
        w.parts -= 1
        return w if w.parts == 0 and w.rest == 0 else None


def result_id(req: RolloutRequest | None, sample: int | str, request_id: str = "") -> str:
    """The results stream's dedupe key: one per submission and sample (a reused request id
    is a new submission, never a duplicate of the old one's result)."""
    sub = (req.submission_id or f"{req.client_id}/{req.request_id}") if req else request_id
    return f"{sub}/{sample}"


def traces(headers: dict[str, str] | None, n: int) -> list[dict[str, str] | None]:
    """Each request's trace context: the message's `traceparent`, or one per request when it
    combined several traced calls (`rlf-traceparents`; see `Outbox`)."""
    hdrs = headers or {}
    listed = hdrs.get(TRACEPARENTS_HEADER)
    if listed is not None:
        tps = listed.split(",")
        if len(tps) == n:
            return [None if tp == "-" else {"traceparent": tp} for tp in tps]
    return [hdrs] * n
