"""What `rlfabric up` shows: a live view while it trains, then a summary table and a plot."""

from __future__ import annotations

import math
from typing import Any

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from rlfabric.cli._fleet import desired_line, note
from rlfabric.schemas import FleetView
from rlfabric.telemetry.report import PhaseRow
from rlfabric.trainer.grpo import StepStats

SPARK = "▁▂▃▄▅▆▇█"


def spark(values: list[float]) -> str:
    vals = [v for v in values if not math.isnan(v)][-40:]
    if not vals:
        return ""
    lo, hi = min(vals), max(vals)
    return "".join(SPARK[int((v - lo) / (hi - lo + 1e-12) * (len(SPARK) - 1))] for v in vals)


def live_view(history: list[StepStats], fleet: FleetView, *, steps: int, mode: str,
              transport: str, status: str) -> Group:
    head = Table.grid(padding=(0, 2))
    last = history[-1] if history else None
    head.add_row(
        Text(f"step {len(history)}/{steps}", style="bold"),
        Text(f"reward {last.reward:.3f}" if last else "reward -", style="green"),
        Text(f"mismatch {last.mismatch:.2e}" if last and last.mismatch is not None
             else "mismatch -"),
        Text(f"tokens/s {last.tokens_per_s:.0f}" if last else "tokens/s -"),
        Text(f"{mode}, {transport}", style="dim"),
    )
    if last and last.failed:
        head.add_row(Text("failed", style="red"), Text(f"{last.failed} of the last step's "
                                                        "samples (left out of the loss)"),
                     Text(""), Text(""), Text(""))
    if last and last.moved:
        head.add_row(Text("moved", style="yellow"), Text(
            f"{last.moved} of the last step's samples went on from a worker that left"),
                     Text(""), Text(""), Text(""))
    head.add_row(Text("reward"), Text(spark([h.reward for h in history]), style="green"),
                 Text(""), Text(""), Text(status, style="yellow"))
    if last:
        head.add_row(Text("control ms"), Text(f"pause {last.pause_ms:.1f}"),
                     Text(f"update {last.update_ms:.1f}"), Text(f"resume {last.resume_ms:.1f}"),
                     Text(""))
    if last and last.turns_per_episode:  # the tools task
        head.add_row(Text("per episode"), Text(f"turns {last.turns_per_episode:.2f}"),
                     Text(f"tool calls {last.tool_calls_per_episode:.2f}"),
                     Text(f"segments {last.segments_per_episode:.3f}"), Text(""))
    workers = Table(title="workers", title_justify="left", caption=desired_line(fleet),
                    caption_justify="left", expand=False)
    for col in ("worker", "version", "state", "in flight", "note"):
        workers.add_column(col)
    for m in fleet.members:
        workers.add_row(m.worker_id, str(m.weight_version), m.state, str(m.in_flight),
                        note(m, fleet))
    return Group(head, workers)


def summary_table(history: list[StepStats]) -> Table:
    t = Table(title="rlfabric up: per step (control columns in ms, all workers acked)",
              title_justify="left", padding=(0, 0, 0, 1), box=box.SIMPLE_HEAD, pad_edge=False)
    episodes = any(h.turns_per_episode for h in history)  # the tools task
    colocated = any(h.sleep_ms for h in history)  # --colocate: sleep before train, wake after
    failures = any(h.failed for h in history)  # samples left out of the loss
    moves = any(h.moved for h in history)  # samples that went on from a worker that left
    cols = ["step", "ver", "reward", "mismatch", "n", *(("fail",) if failures else ()),
            *(("moved",) if moves else ()), "gen s",
            *(("sleep",) if colocated else ()), "train s", "pause",
            *(("wake",) if colocated else ()), "update", "resume", "tok/s",
            *(("turns", "calls", "segs") if episodes else ())]
    for col in cols:
        t.add_column(col, justify="right", no_wrap=True)
    for h in history:
        cells = [str(h.step + 1), str(h.version), f"{h.reward:.3f}",
                 "-" if h.mismatch is None else f"{h.mismatch:.1e}", str(h.samples),
                 *((str(h.failed),) if failures else ()),
                 *((str(h.moved),) if moves else ()), f"{h.gen_s:.2f}",
                 *((f"{h.sleep_ms:.1f}",) if colocated else ()),
                 f"{h.train_s:.2f}", f"{h.pause_ms:.1f}",
                 *((f"{h.wake_ms:.1f}",) if colocated else ()),
                 f"{h.update_ms:.1f}", f"{h.resume_ms:.1f}", f"{h.tokens_per_s:.0f}"]
        if episodes:
            cells += [f"{h.turns_per_episode:.2f}", f"{h.tool_calls_per_episode:.2f}",
                      f"{h.segments_per_episode:.3f}"]
        t.add_row(*cells)
    return t


def breakdown_table(rows: list[PhaseRow], step_ms: float, steps: int, path: str) -> Table:
    """Where one step's time went, from the spans in `path`."""
    t = Table(title=f"where a step's time went: mean of {steps}, {step_ms:.1f} ms",
              caption=f"from the spans in {path}", title_justify="left",
              caption_justify="left", padding=(0, 0, 0, 1), box=box.SIMPLE_HEAD,
              pad_edge=False)
    for col in ("phase", "ms", "share"):
        t.add_column(col, justify="right" if col != "phase" else "left", no_wrap=True)
    for r in rows:
        t.add_row(r.phase, f"{r.mean_ms:.1f}", f"{r.share:.0%}")
    rest = step_ms - sum(r.mean_ms for r in rows)
    t.add_row("(between phases)", f"{rest:.1f}", f"{rest / step_ms:.0%}" if step_ms else "-")
    return t


def plot(history: list[StepStats], path: str, title: str, *,
         threshold: float | None = None) -> None:
    """Steps numbered from 1, as the live view and the table count them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h.step + 1 for h in history]
    episodes = any(h.turns_per_episode for h in history)  # the tools task
    fig, ax = plt.subplots(1, 4 if episodes else 3, figsize=(20 if episodes else 15, 4))
    ax[0].plot(steps, [h.reward for h in history], marker="o")
    if threshold is not None:
        ax[0].axhline(threshold, linestyle="--", color="gray",
                      label=f"threshold {threshold:g} (last 3 steps' mean)")
        ax[0].legend(loc="lower right")
    ax[0].set(title="reward per step", xlabel="step", ylabel="mean reward", ylim=(-0.05, 1.05))
    if episodes:
        for key, label in (("turns_per_episode", "turns"),
                           ("tool_calls_per_episode", "tool calls"),
                           ("segments_per_episode", "segments")):
            ax[3].plot(steps, [getattr(h, key) for h in history], marker=".", label=label)
        ax[3].set(title="per episode", xlabel="step", ylabel="mean per episode")
        ax[3].legend()
    mm = [(h.step + 1, h.mismatch) for h in history if h.mismatch is not None]
    if mm:
        ax[1].plot([s for s, _ in mm], [m for _, m in mm], marker="o")
        # logarithmic above 1e-9, linear below: an exact 0 is drawn at 0
        ax[1].set_yscale("symlog", linthresh=1e-9)
    ax[1].set(title="trainer vs rollout logprob mismatch", xlabel="step",
              ylabel="mean |trainer - rollout|")
    for key, label in (("pause_ms", "pause"), ("update_ms", "update_weights"),
                       ("resume_ms", "resume")):
        ax[2].plot(steps, [getattr(h, key) for h in history], marker=".", label=label)
    ax[2].set(title="control latency", xlabel="step", ylabel="ms (all workers acked)")
    ax[2].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def summary_json(history: list[StepStats], **extra: Any) -> dict[str, Any]:
    return {"steps": [h.as_dict() for h in history], **extra}
