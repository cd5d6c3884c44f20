"""Agent sessions on the bus: what a gateway served, turn by turn, and the trajectories that
a trainer reads back (DESIGN section 10).

Who sends what: a gateway appends one `SessionTurn` per request of a session, and a
`SessionEnd` when it is finished or expires, to `<prefix>.session.<key>` (stream
`<PREFIX>_SESSIONS`); gateways and trainers read them back. A record holds only what is new:
the tokens the gateway inserted after what the session had (not sampled: turn boundaries, new
messages, the generation prompt) and each sampled choice. `fold` turns the records into
`Trajectory` segments; it is pure, so a gateway keeps a session's fold and applies new records
to it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from rlfabric.schemas._base import Message, PackedF32, PackedI32, coerce_packed
from rlfabric.schemas.rollout import VersionSpan

#: why a segment starts (`Segment.reason`)
SEGMENT_REASONS: dict[str, str] = {
    "new_session": "the session's first turn",
    "messages_not_extended": "the request's messages do not start with the session's previous "
                             "request's messages (an earlier message was edited, removed or "
                             "truncated)",
    "assistant_not_sampled": "the message after the previous request's messages is not an "
                             "assistant message this session returned",
    "template_rewrote_history": "the chat template renders the history differently from the "
                                "tokens the model saw (e.g. earlier reasoning dropped)",
    "branch": "a choice of an n > 1 turn that the session did not continue, or of a turn "
              "the client sent again",
}


class TurnChoice(Message, frozen=True, kw_only=True):
    """One sampled choice of a turn. `message_digest` identifies the assistant message the
    gateway returned for it, so the agent sending it back selects this choice. `prefill`: the
    tokens the gateway wrote at the start of the assistant turn before the model sampled (to
    make it call a tool); they end the turn's `added` tokens."""

    completion_token_ids: PackedI32
    logprobs: PackedF32
    version_spans: tuple[VersionSpan, ...] = ()
    finish_reason: str = "stop"
    message_digest: str = ""
    prefill: PackedI32 = msgspec.field(default_factory=PackedI32)

    def __post_init__(self) -> None:
        coerce_packed(self, completion_token_ids=PackedI32, logprobs=PackedF32,
                      prefill=PackedI32)


class SessionTurn(Message, tag_field="kind", tag="turn", frozen=True, kw_only=True):
    """One request of a session. Continuing (`reason` empty): its prompt is the previous
    turn's prompt + choice `branch`'s tokens + `added`. Otherwise it starts a segment whose
    prompt is `added` alone, and `reason` (a `SEGMENT_REASONS` key) and `detail` say why;
    `branch` still names the previous choice the agent sent back, if any (-1: none).
    `resample`: the previous turn's request again (a client's retry): the same prompt sampled
    again, the previous turn's choices kept as branches."""

    session_id: str
    turn: int
    added: PackedI32
    choices: tuple[TurnChoice, ...] = ()
    branch: int = -1
    reason: str = ""
    detail: str = ""
    #: digests of the request's messages, in order (the next turn must start with them)
    message_digests: tuple[str, ...] = ()
    model: str = ""
    tenant: str = ""
    gateway: str = ""
    at: float = 0.0
    resample: bool = False

    def __post_init__(self) -> None:
        coerce_packed(self, added=PackedI32)


class SessionEnd(Message, tag_field="kind", tag="end", frozen=True, kw_only=True):
    """No turn follows: `finished` (asked for) or `expired` (idle past the gateway's TTL)."""

    session_id: str
    reason: str = "finished"
    at: float = 0.0


SessionRecord = SessionTurn | SessionEnd


class Segment(Message, frozen=True, kw_only=True):
    """One contiguous token sequence of a trajectory. `loss_mask[i]` is 1 exactly where the
    model sampled `token_ids[i]`; `logprobs[i]` is that token's logprob there, 0 elsewhere;
    `weight_versions` are half-open ranges of `token_ids` and the weight version that sampled
    them."""

    token_ids: PackedI32
    loss_mask: PackedI32
    logprobs: PackedF32
    weight_versions: tuple[VersionSpan, ...] = ()
    reason: str = "new_session"
    detail: str = ""
    turns: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        coerce_packed(self, token_ids=PackedI32, loss_mask=PackedI32, logprobs=PackedF32)


class Trajectory(Message, frozen=True, kw_only=True):
    """A session's segments, the live one last. `ended` is "" while the session may go on."""

    session_id: str
    segments: tuple[Segment, ...] = ()
    turns: int = 0
    ended: str = ""


@dataclass(eq=False)
class _Open:
    """A segment being built: tokens so far, and where its last prompt ends."""

    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    lps: list[float] = field(default_factory=list)
    spans: list[VersionSpan] = field(default_factory=list)
    reason: str = "new_session"
    detail: str = ""
    turns: list[int] = field(default_factory=list)

    def insert(self, ids: list[int]) -> None:
        self.ids += ids
        self.mask += [0] * len(ids)
        self.lps += [0.0] * len(ids)

    def sample(self, choice: TurnChoice) -> None:
        at = len(self.ids)
        ids = choice.completion_token_ids.tolist()
        self.ids += ids
        self.mask += [1] * len(ids)
        self.lps += choice.logprobs.tolist()
        for s in choice.version_spans:
            self.spans.append(msgspec.structs.replace(s, start=at + s.start, end=at + s.end))

    def copy(self) -> _Open:
        return _Open(self.ids[:], self.mask[:], self.lps[:], self.spans[:], self.reason,
                     self.detail, self.turns[:])

    def segment(self) -> Segment:
        return Segment(token_ids=PackedI32(self.ids), loss_mask=PackedI32(self.mask),
                       logprobs=PackedF32(self.lps),
                       weight_versions=_merged(self.spans), reason=self.reason,
                       detail=self.detail, turns=tuple(self.turns))


def _merged(spans: list[VersionSpan]) -> tuple[VersionSpan, ...]:
    out: list[VersionSpan] = []
    for s in spans:
        if s.end <= s.start:
            continue
        if out and (out[-1].version, out[-1].policy) == (s.version, s.policy) and \
                out[-1].end == s.start:
            out[-1] = msgspec.structs.replace(out[-1], end=s.end)
        else:
            out.append(s)
    return tuple(out)


@dataclass(eq=False)
class SessionFold:
    """A session's records applied in order. `prompt` is the live segment's last prompt (what
    the next continuing turn extends, after the chosen choice); `last` the last turn;
    `returned` every choice the session returned, by the digest of its assistant message (the
    last one of equal digests); `positions` the choice each continued turn took, by the index
    its assistant message has in the requests after it (two equal messages, such as a tool
    call repeated, are two turns' tokens)."""

    session_id: str = ""
    closed: list[_Open] = field(default_factory=list)
    live: _Open | None = None
    last: SessionTurn | None = None
    ended: str = ""
    turns: int = 0
    returned: dict[str, TurnChoice] = field(default_factory=dict)
    positions: dict[int, TurnChoice] = field(default_factory=dict)

    def choice_at(self, index: int, digest: str) -> TurnChoice | None:
        """The choice this session returned as the assistant message at `index` of a request
        extending its last one, if that message is it (`digest`); else the one returned with
        that digest, if any."""
        at = self.positions.get(index)
        if at is None and self.last is not None and index == len(self.last.message_digests):
            at = next((c for c in self.last.choices if c.message_digest == digest), None)
        if at is not None and at.message_digest == digest:
            return at
        return self.returned.get(digest)

    @property
    def prompt(self) -> list[int]:
        return self.live.ids if self.live is not None else []

    def held_tokens(self) -> int:
        """Tokens this fold holds: its segments' and the choices it returned."""
        segments = sum(len(o.ids) for o in self.closed) + len(self.prompt)
        return segments + sum(len(c.completion_token_ids) for c in self.returned.values())

    def apply(self, record: SessionRecord) -> None:
        self.session_id = record.session_id
        if isinstance(record, SessionEnd):
            self.ended = record.reason
            return
        if record.resample and self.last is not None and self.live is not None:
            self._close_forks(self.last, self.live, keep=-1)
        elif self.last is not None and self.live is not None:
            chosen = record.branch if 0 <= record.branch < len(self.last.choices) else 0
            self._close_forks(self.last, self.live, keep=chosen)
            if self.last.choices:
                self.live.sample(self.last.choices[chosen])
                if record.branch >= 0:
                    self.positions[len(self.last.message_digests)] = self.last.choices[chosen]
        if record.reason or self.live is None:
            if self.live is not None:
                self.closed.append(self.live)
            self.live = _Open(reason=record.reason or "new_session", detail=record.detail)
        self.live.insert(record.added.tolist())
        if not record.resample:
            self.live.turns.append(record.turn)
        self.last = record
        self.turns += 1
        for choice in record.choices:
            if choice.message_digest:
                self.returned[choice.message_digest] = choice

    def _close_forks(self, turn: SessionTurn, live: _Open, *, keep: int) -> None:
        for i, choice in enumerate(turn.choices):
            if i == keep:
                continue
            fork = live.copy()
            fork.sample(choice)
            fork.reason, fork.detail = "branch", f"choice {i} of turn {turn.turn}"
            fork.turns = [turn.turn]
            self.closed.append(fork)

    def trajectory(self) -> Trajectory:
        """The segments as of now: the last turn's first choice ends the live segment, its
        other choices are segments of their own."""
        segments = [s.segment() for s in self.closed]
        if self.live is not None and self.last is not None:
            live = self.live.copy()
            forks: list[_Open] = []
            for i, choice in enumerate(self.last.choices):
                if i == 0:
                    continue
                fork = self.live.copy()
                fork.sample(choice)
                fork.reason, fork.detail = "branch", f"choice {i} of turn {self.last.turn}"
                fork.turns = [self.last.turn]
                forks.append(fork)
            if self.last.choices:
                live.sample(self.last.choices[0])
            segments += [live.segment()] + [f.segment() for f in forks]
        return Trajectory(session_id=self.session_id, segments=tuple(segments),
                          turns=self.turns, ended=self.ended)


def fold(records: list[SessionRecord]) -> Trajectory:
    """The trajectory of a session's records, in the order they were stored."""
    f = SessionFold()
    for r in records:
        f.apply(r)
    return f.trajectory()
