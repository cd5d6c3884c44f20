"""Reading a spans file back (`--trace PATH`): traces as trees, and where a step's time went.

    spans = read_spans("spans.jsonl")
    print("\\n".join(draw(spans, trace_id)))          # one trace, indented, with processes
    rows = step_breakdown(spans)                      # per phase: mean ms and share of a step
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

#: the phases of a GRPO step, as the trainer's spans name them
STEP_PHASES = ("generate", "train", "pause", "update_weights", "resume")


def read_spans(path: str) -> list[dict[str, Any]]:
    """Every span in the file; a line cut short (a process killed mid-write) is skipped."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def process_of(span: dict[str, Any]) -> str:
    """`trainer`, or `worker w0`: the role and worker id of the process that made it."""
    r = span.get("resource", {})
    wid = r.get("rlfabric.worker.id")
    return f"{r.get('rlfabric.role', '?')}{' ' + wid if wid else ''}"


def ms(span: dict[str, Any]) -> float:
    return (span["end"] - span["start"]) * 1e3


def by_trace(spans: Iterable[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for s in spans:
        out[s["trace_id"]].append(s)
    return dict(out)


def draw(spans: Iterable[dict[str, Any]], trace_id: str, *, collapse: bool = False
         ) -> list[str]:
    """One trace as an indented tree: name, process, duration, children by start time.
    `collapse`: of siblings with the same name and process, the first is drawn and the rest
    summed up in one line (count and mean ms)."""
    mine = [s for s in spans if s["trace_id"] == trace_id]
    ids = {s["span_id"] for s in mine}
    children: dict[str | None, list[dict[str, Any]]] = defaultdict(list)
    for s in mine:
        children[s["parent"] if s["parent"] in ids else None].append(s)
    lines: list[str] = []

    def walk(parent: str | None, depth: int) -> None:
        pad = "  " * depth
        kids = sorted(children.get(parent, []), key=lambda s: s["start"])
        groups: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
        for s in kids:
            groups[(s["name"], process_of(s))].append(s)
        for s in kids:
            same = groups[(s["name"], process_of(s))]
            if collapse and s is not same[0]:
                continue
            lines.append(f"{pad}{s['name']}  [{process_of(s)}]  {ms(s):.1f} ms")
            walk(s["span_id"], depth + 1)
            if collapse and len(same) > 1:
                rest = same[1:]
                lines.append(f"{pad}(+{len(rest)} more like it, "
                             f"{statistics.fmean(ms(x) for x in rest):.1f} ms each on average)")

    walk(None, 0)
    return lines


@dataclass(frozen=True)
class PhaseRow:
    phase: str
    mean_ms: float
    share: float  # of the mean step


def step_breakdown(spans: Iterable[dict[str, Any]]) -> tuple[list[PhaseRow], float, int]:
    """Mean ms per phase of the trainer's `step` spans, with its share of the mean step;
    also the mean step in ms and how many steps were found."""
    all_spans = list(spans)
    steps = [s for s in all_spans if s["name"] == "step"]
    if not steps:
        return [], 0.0, 0
    step_ids = {s["span_id"] for s in steps}
    per: dict[str, list[float]] = defaultdict(list)
    for s in all_spans:
        if s["parent"] in step_ids and s["name"] in STEP_PHASES:
            per[s["name"]].append(ms(s))
    step_ms = statistics.fmean(ms(s) for s in steps)
    rows = []
    for phase in STEP_PHASES:
        vals = per.get(phase, [])
        if vals:
            mean = sum(vals) / len(steps)
            rows.append(PhaseRow(phase, mean, mean / step_ms if step_ms else 0.0))
    return rows, step_ms, len(steps)
