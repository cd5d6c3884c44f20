"""The fleet's words, in one place: what `rlfabric status`, `rlfabric ctl` and `up`'s live view
print of a `FleetView` (so they agree on each worker's version and on what the fleet serves)."""

from __future__ import annotations

import time
from typing import Any

import msgspec

from rlfabric.schemas import FleetView, JobShare, WorkerInfo
from rlfabric.schemas.jobs import ENDED

#: the columns of the members table, in order
COLUMNS = ["worker_id", "engine", "model", "weight_version", "state", "age_s", "in_flight",
           "capacity", "checkpoint", "adapters"]


def member_row(m: WorkerInfo, view: FleetView) -> dict[str, Any]:
    now = view.at or time.time()
    return {
        "worker_id": m.worker_id,
        "engine": m.engine,
        "model": m.model,
        "weight_version": m.weight_version,
        "state": m.state,
        "age_s": round(now - m.started_at, 1),
        "key_age_s": round(now - m.heartbeat_at, 1),  # its last key write
        "host": m.host,
        "pid": m.pid,
        "capacity": m.capacity,
        "in_flight": m.in_flight,
        "checkpoint": m.checkpoint[:12],
        "policy": m.policy,
        "adapters": " ".join(f"{n}@{','.join(f'v{v}' for v in vs)}"
                             for n, vs in sorted(m.adapters.items())) or "-",
        "note": note(m, view),
    }


def note(m: WorkerInfo, view: FleetView) -> str:
    """Why a worker takes no requests, if it takes none."""
    if m.behind:
        return f"takes no requests: {m.behind}"
    claim = view.checkpoint
    if claim is not None and m.weight_version < 0 and m.checkpoint and \
            m.checkpoint != claim.checksum:
        return (f"checkpoint differs from version 0 (claimed by {claim.worker_id}): not "
                "serving until a weight push")
    return ""


def desired_line(view: FleetView) -> str:
    """What the fleet is to serve, in words."""
    d = view.desired
    if not view.pushed:
        c = view.checkpoint
        return ("desired: nothing pushed yet: the workers serve their checkpoint as version 0"
                + (f" ({c.model}, checksum {c.checksum[:12]}, first loaded by {c.worker_id})"
                   if c is not None else " (none has joined yet)"))
    state = f"paused ({d.pause_mode})" if d.paused else "running"
    if d.locator is not None:
        where = f"over {msgspec.to_builtins(d.locator.transport)['kind']}"
    else:
        where = ("pushed over a collective or cuda_ipc: a worker joining later waits for the "
                 "next push")
    return (f"desired: version {d.weight_version} (policy {d.policy or '-'}), {state}, {where}"
            + (f", collective group epoch {d.group_epoch}" if d.group_epoch else "")
            + "".join(f", adapter {n} v{u.version}" for n, u in sorted(d.adapters.items())))


def job_rows(view: FleetView) -> list[dict[str, Any]]:
    """Each job on the pool: its pause, its adapters' desired versions, its requests in
    flight (summed over the workers), the workers holding its requests, its weight and quota,
    and its share of the tokens served in the last minute beside its weight's share of the
    jobs served then ("" is the pool's own job)."""
    names = set(view.jobs) | {j for m in view.members for j in m.jobs if j} | \
        {j for m in view.members for j in m.paused_jobs} | set(view.shares) | \
        {j for m in view.members for j in m.job_tokens}
    tokens = {j: sum(m.job_tokens.get(j, 0) for m in view.members) for j in names}
    served = sum(tokens.values())
    weights = {j: view.shares.get(j, JobShare()).weight for j in names if tokens[j]}
    rows = []
    for job in sorted(names):
        d = view.jobs.get(job)
        share = view.shares.get(job, JobShare())
        held = [m.worker_id for m in view.members if job in m.paused_jobs]
        rows.append({
            "job": job,
            "state": ("deleted" if d is not None and d.pause_mode == ENDED else
                      f"paused ({d.pause_mode})" if d is not None and d.paused else "running"),
            "adapters": " ".join(f"{n}@v{u.version}" for n, u in sorted(d.adapters.items()))
            if d is not None and d.adapters else "-",
            "in_flight": sum(m.jobs.get(job, 0) for m in view.members),
            "held_by": ",".join(held) or "-",
            "weight": share.weight,
            "quota": share.max_in_flight or "-",
            "tokens_1m": tokens[job],
            # its part of the tokens served beside its weight's part among the jobs served
            "share_1m": f"{tokens[job] / served:.2f}" if served else "-",
            "weight_share": f"{share.weight / sum(weights.values()):.2f}"
            if job in weights else "-",
        })
    return rows


def desired_json(view: FleetView) -> dict[str, Any]:
    d = view.desired
    return {
        "weight_version": d.weight_version,
        "serving": view.serving,
        "pushed": view.pushed,
        "policy": d.policy,
        "paused": d.paused,
        "pause_mode": d.pause_mode,
        "group_epoch": d.group_epoch,
        "transport": msgspec.to_builtins(d.locator.transport)["kind"] if d.locator else None,
        "adapters": {n: u.version for n, u in sorted(d.adapters.items())},
        "text": desired_line(view),
    }


def event_row(event: Any) -> dict[str, Any]:
    """A fleet event (`rlfabric.schemas.Event`) as JSON-ready builtins, every field spelled
    out (the wire leaves defaults out) and its `kind`."""
    row: dict[str, Any] = msgspec.to_builtins(msgspec.structs.asdict(event))
    row["kind"] = event.__struct_config__.tag
    return row


def command_text(c: dict[str, Any]) -> str:
    """A command's outcome (a `CommandEvent` as builtins), in words."""
    version = f" v{c['version']}" if c.get("version", -1) >= 0 else ""
    failed = ", ".join(f"{w} ({code})" for w, code in sorted(c["failed"].items()))
    return (f"{c['op']}{version} {c['cmd_id'][:12]} from {c['source']}: ok "
            f"{', '.join(c['ok']) or '-'}; failed {failed or '-'}; missing "
            f"{', '.join(c['missing']) or '-'}; {c['seconds']:.3f}s")
