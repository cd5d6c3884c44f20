"""`rlfabric up`: the whole loop on one machine. An embedded NATS server, N worker processes
serving the tiny model, and the reference GRPO loop training it on a toy task, with a live
view, a summary table and a plot. Exit 0 only if the final reward (the mean of the last few
steps: `trainer.config.FINAL_STEPS`) rose past the threshold and every worker ended on the
final weight version.

`--nats URL --workers-external` runs the same loop on a server and workers that already run
(compose.yaml's trainer does); `--launcher ray` starts the workers as Ray actors in a placement
group instead of processes (the trainer side is the same). `--trace PATH` writes every
process's spans to PATH (one trace per step) and ends with where a step's time went."""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from rlfabric import transports
from rlfabric.bus import EmbeddedNats
from rlfabric.cli._common import (
    add_bus_options,
    add_telemetry_options,
    connect_options,
    limits_of,
    start_telemetry,
)
from rlfabric.cli.up_fleet import ProcessFleet, RayActorFleet
from rlfabric.engines import registry
from rlfabric.engines.kinds import DTYPES
from rlfabric.errors import LaunchError
from rlfabric.schemas import FleetView
from rlfabric.text.builtin import runs_dir
from rlfabric.trainer import config

Fleet = ProcessFleet | RayActorFleet

if TYPE_CHECKING:
    from rich.console import Console

    from rlfabric.schemas import WorkerInfo
    from rlfabric.telemetry import Telemetry
    from rlfabric.telemetry.report import PhaseRow
    from rlfabric.trainer import FabricClient
    from rlfabric.trainer.config import GRPOConfig
    from rlfabric.trainer.grpo import GRPOTrainer, StepStats


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "up", help="the demo: embedded NATS + N workers + GRPO on a toy task, live",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=2, help="worker processes (default %(default)s)")
    p.add_argument("--task", default="letter", choices=("letter", "tools"),
                   help="letter: single-turn requests, reward for one letter (the tiny model); "
                   "tools: multi-turn episodes, an agent with the openai client calling a "
                   "calculator tool through `rlfabric gateway`, trained on the trajectories "
                   "the bus recorded (the tinychat model; default %(default)s)")
    _grpo_options(p)
    p.add_argument("--out", default=None, metavar="DIR",
                   help="folder for the run's plot, summary and worker logs, a folder per run "
                   f"(default {runs_dir()}; $XDG_CACHE_HOME moves it)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON at the end")
    p.add_argument("--no-live", action="store_true",
                   help="one line per step instead of the live view (default when not a TTY)")
    g = add_bus_options(
        p, nats=(None, "use this NATS server (comma-separated URLs) instead of an embedded one"),
        title="attach",
        description="run the demo on a server and fleet that already run (e.g. compose.yaml's) "
        "instead of starting its own; with auth (e.g. `rlfabric nats --auth DIR`: --nkey "
        "DIR/trainer.nk), start the workers with their own role's key and pass "
        "--workers-external")
    g.add_argument("--workers-external", action="store_true",
                   help="start no workers: wait for --workers of them to join the job (started "
                   "elsewhere with `rlfabric worker --nats URL --prefix PREFIX`); they are "
                   "left running at the end")
    g.add_argument("--gateway-nkey", default=None, metavar="PATH",
                   help="--task tools on a server with per-role keys: the key of the gateway "
                   "up starts (DIR/gateway.nk of `rlfabric nats --auth DIR`); it takes up's "
                   "--tls-* options too")
    g.add_argument("--join-timeout", type=float, default=180.0, metavar="S",
                   help="seconds to wait for the workers to join (default %(default)s)")
    r = p.add_argument_group("launcher", "how up starts its workers")
    r.add_argument("--launcher", default="process", choices=("process", "ray"),
                   help="process: `rlfabric worker` child processes (default); ray: Ray actors "
                   "in one placement group, a bundle per worker (needs `pip install "
                   "'rlfabric[ray]'')")
    r.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="with --launcher ray: a running Ray cluster ('auto', or host:port); "
                   "default: a local Ray runtime for this run, shut down at the end")
    r.add_argument("--gpus-per-worker", type=float, default=0.0, metavar="G",
                   help="with --launcher ray: GPUs in each worker's bundle (default 0)")
    add_telemetry_options(p)  # the workers up starts write to the same files
    p.set_defaults(func=run)


def _grpo_options(p: argparse.ArgumentParser) -> None:
    d = config.defaults()
    p.add_argument("--steps", type=int, default=None,
                   help=f"GRPO steps (default {d['steps']}; {config.ASYNC_STEPS} with --async, "
                   f"which learns from one-step stale samples and needs a few more; "
                   f"{config.TOOLS_STEPS} with --task tools)")
    p.add_argument("--transport", default=None, choices=transports.names(),
                   help=f"how weights reach the workers (default {d['transport']}; cuda_ipc "
                   "with --colocate --device cuda)")
    p.add_argument("--delta", action="store_true",
                   help="send each update as the bytes that changed since the last one every "
                   "worker holds (--transport nats or filesystem; over shm they go whole; "
                   "bfloat16 pays most: a step leaves most bit patterns as they were); the "
                   "summary gives the last update's bytes")
    p.add_argument("--engine", default="torch", choices=registry.names(trains=True),
                   help="the workers' engine (default %(default)s); vllm serves the tiny64 "
                   "model (64-wide heads; tinychat with --task tools) and needs vLLM "
                   "installed (README, 'vLLM')")
    p.add_argument("--device", default=None, metavar="DEV",
                   help="the trainer's torch device, and the torch workers' (e.g. cuda; "
                   "default: the trainer on cpu, torch workers on cuda if there is one)")
    p.add_argument("--dtype", default="float32", choices=DTYPES,
                   help="the trainer's and the workers' weights dtype (default %(default)s; "
                   "bfloat16 as RL runs on GPUs train: the mismatch column shows what it costs)")
    p.add_argument("--colocate", action="store_true",
                   help="trainer and workers share the device: each step the workers sleep "
                   "while the trainer trains, wake, take the update and resume (the per-step "
                   "table shows each phase); with --device cuda weights go over cuda_ipc "
                   "unless --transport says otherwise")
    p.add_argument("--sleep-level", type=int, default=1, choices=(1, 2),
                   help="--colocate: 1 moves the workers' weights to host memory while they "
                   "sleep, 2 drops them (the update brings them back) (default %(default)s)")
    p.add_argument("--async", dest="async_mode", action="store_true",
                   help="overlap generation of step k+1 with training of step k (one step "
                   "off-policy; keep pauses; version spans)")
    p.add_argument("--prompts", type=int, default=d["prompts_per_step"],
                   help="prompts per step, each --group-size samples (--task tools: "
                   "questions, each --group-size episodes; default %(default)s)")
    p.add_argument("--group-size", type=int, default=d["group_size"],
                   help="samples per prompt (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=d["max_tokens"],
                   help="tokens per sample (--task tools: of the turn that calls the tool; "
                   "default %(default)s)")
    p.add_argument("--lr", type=float, default=d["lr"],
                   help="Adam learning rate (default %(default)s)")
    p.add_argument("--threshold", type=float, default=None,
                   help=f"final reward (the mean of the last {config.FINAL_STEPS} steps) "
                   f"needed for exit 0 (default {d['reward_threshold']}; "
                   f"{config.TOOLS_THRESHOLD} with --task tools)")
    p.add_argument("--max-failed", type=float, default=d["max_failed"], metavar="SHARE",
                   help="the share of a step's samples that may fail (an engine error, a "
                   "deadline, a lost worker): each is left out of the loss and counted in the "
                   "table's fail column; past it the run stops naming the causes (default "
                   "%(default)s)")
    p.add_argument("--lora", type=int, default=d["lora_rank"], metavar="RANK",
                   help="train a LoRA adapter of this rank instead of every weight, and push "
                   "only the adapter each step (default: off)")


@contextlib.asynccontextmanager
async def _server(url: str | None) -> AsyncIterator[tuple[str, int | None]]:
    """The server's URL and pid: an embedded one, or `url` (pid unknown)."""
    if url:
        yield url, None
        return
    async with EmbeddedNats() as nats:
        yield nats.url, nats.pid


async def _wait_workers(fabric, fleet: Fleet | None, n: int, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while len(fabric.watcher.snapshot().members) < n:
        if fleet is not None and (dead := fleet.dead()):
            raise LaunchError("a worker failed to start: " + "; ".join(dead))
        if time.monotonic() > deadline:
            where = (fleet.where() if fleet is not None else
                     f"start them with `rlfabric worker --nats URL --prefix "
                     f"{fabric.bus.subjects.prefix}`")
            raise LaunchError(f"only {len(fabric.watcher.snapshot().members)} of {n} workers "
                              f"joined within {timeout}s; {where}")
        changed = fabric.watcher.changed()
        with anyio.move_on_after(0.5):  # and look at the processes twice a second
            await changed.wait()


@dataclass
class _Run:
    """What `up` needs to report a run: the steps it trained, where it ended, and how."""

    args: argparse.Namespace
    cfg: GRPOConfig
    mode: str
    run_dir: Path
    console: Console
    history: list[StepStats] = field(default_factory=list)
    final: int = -1
    on_final: dict[str, int] = field(default_factory=dict)
    wall: float = 0.0
    full_bytes: int = 0  # the whole model's weights, beside what each update pushed


async def _main(args: argparse.Namespace, run_dir: Path, fleet: Fleet | None,
                telemetry: Telemetry) -> int:
    from rich.console import Console

    from rlfabric.trainer.config import GRPOConfig

    cfg = GRPOConfig(steps=args.steps or (config.ASYNC_STEPS if args.async_mode
                                          else config.TOOLS_STEPS if args.task == "tools"
                                          else config.defaults()["steps"]),
                     prompts_per_step=args.prompts, group_size=args.group_size,
                     max_tokens=args.max_tokens, lr=args.lr, transport=_transport(args),
                     async_mode=args.async_mode, reward_threshold=_threshold(args),
                     lora_rank=args.lora, device=args.device or "cpu",
                     max_failed=args.max_failed, delta=args.delta,
                     sleep_level=args.sleep_level if args.colocate else 0)
    run = _Run(args=args, cfg=cfg, run_dir=run_dir,
               mode="async (1 step off-policy)" if args.async_mode else "sync",
               console=Console() if sys.stdout.isatty() else Console(width=150))
    t_start = time.monotonic()
    async with _server(args.nats) as (url, nats_pid):
        try:
            await _train(run, url, nats_pid, fleet)
        finally:
            # NOTE: workers first, while the bus is still there for their clean exit
            if fleet is not None:
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(fleet.stop)
    run.wall = time.monotonic() - t_start
    telemetry.shutdown()  # this process's spans written, beside the workers' (they exited)
    return _report(run)


def _transport(args: argparse.Namespace) -> str:
    if args.transport:
        return str(args.transport)
    if args.colocate and (args.device or "").startswith("cuda"):
        return "cuda_ipc"
    return str(config.defaults()["transport"])


def _threshold(args: argparse.Namespace) -> float:
    if args.threshold is not None:
        return float(args.threshold)
    return config.TOOLS_THRESHOLD if args.task == "tools" else config.defaults()[
        "reward_threshold"]


async def _train(run: _Run, url: str, nats_pid: int | None, fleet: Fleet | None) -> None:
    """Start the workers, train, and wait (10 s at most) for every one to serve the last
    version."""
    import torch

    from rlfabric.tensors.models import build_model
    from rlfabric.trainer import FabricClient
    from rlfabric.trainer.grpo import GRPOTrainer

    args = run.args
    model = "tinychat" if args.task == "tools" else registry.kind(args.engine).default_model
    if fleet is not None:
        # the workers hold the one adapter --lora trains (vLLM holds none unless told)
        extra: tuple[str, ...] = ("--max-adapters", "1") if args.lora else ()
        if args.device and args.engine == "torch":
            extra += ("--device", args.device)
        if args.dtype != "float32":
            extra += ("--dtype", args.dtype)
        if args.engine == "vllm" and run.cfg.transport == "cuda_ipc":
            extra += ("--weight-transfer", "ipc")  # pushes enter vLLM through its ipc backend
        await anyio.to_thread.run_sync(fleet.start, args.workers, url, args.prefix,
                                       args.engine, model, args.trace, args.metrics, extra)
    run.console.print(f"rlfabric up: NATS at {url}, {args.workers} workers "
                      + (f"starting ({fleet.where()})" if fleet is not None
                         else "joining from elsewhere") + f"; job prefix {args.prefix!r}")
    if args.task == "tools":
        run.console.print(f"rlfabric up: --task tools runs {run.cfg.steps} steps of "
                          f"{run.cfg.prompts_per_step * run.cfg.group_size} agent episodes each "
                          "(every turn through the gateway): several minutes on a 2-core "
                          "machine")
    async with FabricClient.connect(connect_options(args, "rlfabric-up", url=url),
                                    prefix=args.prefix, limits=limits_of(args)) as fabric:
        await _wait_workers(fabric, fleet, args.workers, args.join_timeout)
        pids = await anyio.to_thread.run_sync(fleet.pids) if fleet is not None else []
        (run.run_dir / "pids.json").write_text(json.dumps(
            {"up": os.getpid(), "nats": nats_pid, "workers": pids}))
        live = run.console.is_terminal and not args.no_live
        async with _agents(run, fabric, url) as agent:
            trainer = GRPOTrainer(fabric, build_model(model, dtype=getattr(torch, args.dtype)),
                                  run.cfg, agent=agent,
                                  on_step=functools.partial(_on_step, run, live))
            await _drive(run, trainer, fabric, live)
        run.final, run.full_bytes = trainer.version, trainer.full_bytes
        with anyio.move_on_after(10):
            await fabric.watcher.wait_until(
                lambda s: len(s.members) == args.workers
                and all(_serves(m, args.lora) == run.final for m in s.members), timeout=10)
        run.on_final = {m.worker_id: _serves(m, args.lora)
                        for m in fabric.watcher.snapshot().members}


@contextlib.asynccontextmanager
async def _agents(run: _Run, fabric: FabricClient, url: str) -> AsyncIterator[Any]:
    """The tools task's agents and their gateway (None for the letter task)."""
    if run.args.task != "tools":
        yield None
        return
    from rlfabric.cli.up_agent import agent_rollouts

    a = run.args
    connect = [arg for flag, value in (("--nkey", a.gateway_nkey), ("--tls-ca", a.tls_ca),
                                       ("--tls-cert", a.tls_cert), ("--tls-key", a.tls_key))
               if value for arg in (flag, value)]
    async with agent_rollouts(fabric, url, a.prefix, run.run_dir, turn_tokens=run.cfg.max_tokens,
                              connect=connect) as agents:
        run.console.print(f"rlfabric up: agents through the gateway at {agents.base_url}")
        yield agents


def _serves(m: WorkerInfo, lora: int) -> int:
    """The version a worker serves: its weights', or with --lora its adapter's newest."""
    if not lora:
        return m.weight_version
    return max(m.adapters.get(config.LORA_NAME, (-1,)))


def _on_step(run: _Run, live: bool, s: StepStats) -> None:
    run.history.append(s)
    if not live:
        mm = "-" if s.mismatch is None else f"{s.mismatch:.1e}"
        slept = (f"sleep/wake {s.sleep_ms:.1f}/{s.wake_ms:.1f} ms  "
                 if run.cfg.sleep_level else "")
        run.console.print(f"step {s.step + 1}/{run.cfg.steps}  reward {s.reward:.3f}  "
                          f"mismatch {mm}  {slept}pause/update/resume "
                          f"{s.pause_ms:.1f}/{s.update_ms:.1f}/{s.resume_ms:.1f} ms  "
                          f"{s.tokens_per_s:.0f} tokens/s")


async def _drive(run: _Run, trainer: GRPOTrainer, fabric: FabricClient, live: bool) -> None:
    """Run the trainer, under the live view when there is a terminal for it."""
    from rich.live import Live

    from rlfabric.cli import up_view

    if not live:
        await trainer.run()
        return

    def view() -> Any:
        # the fleet as `rlfabric status` reads it, from what this process holds already
        fleet = FleetView(prefix=run.args.prefix, members=fabric.watcher.snapshot().members,
                          desired=fabric.desired.state, at=time.time())
        return up_view.live_view(run.history, fleet, steps=run.cfg.steps, mode=run.mode,
                                 transport=run.cfg.transport, status="training")

    with Live(view(), console=run.console, refresh_per_second=4) as shown:
        async with anyio.create_task_group() as tg:
            async def refresh() -> None:
                while True:
                    shown.update(view())
                    await anyio.sleep(0.25)

            tg.start_soon(refresh)
            await trainer.run()
            tg.cancel_scope.cancel()
        shown.update(view())


def _summary(run: _Run) -> dict[str, Any]:
    from rlfabric.cli import up_view

    h, cfg, args = run.history, run.cfg, run.args
    all_final = len(run.on_final) == args.workers and all(
        v == run.final for v in run.on_final.values())
    first, last = h[0].reward, h[-1].reward
    final = sum(x.reward for x in h[-config.FINAL_STEPS:]) / len(h[-config.FINAL_STEPS:])
    plot_path = run.run_dir / "rlfabric-up.png"
    up_view.plot(h, str(plot_path),
                 f"rlfabric up: {args.workers} workers, {run.mode}, {cfg.transport} weights",
                 threshold=cfg.reward_threshold)
    mismatches = [x.mismatch for x in h if x.mismatch is not None]
    busy = sum(x.wall_s for x in h)
    return up_view.summary_json(
        h, workers=args.workers, mode=run.mode, transport=cfg.transport,
        final_version=run.final, workers_on_final=run.on_final, all_workers_on_final=all_final,
        reward_first=first, reward_last=last, reward_final=final,
        threshold=cfg.reward_threshold,
        mismatch_mean=sum(mismatches) / len(mismatches) if mismatches else None,
        mismatch_max=max(mismatches) if mismatches else None,
        wall_s=run.wall, steps_per_s=len(h) / busy, tokens_per_s=sum(x.tokens for x in h) / busy,
        lora_rank=cfg.lora_rank, update_bytes=h[-1].update_bytes, full_model_bytes=run.full_bytes,
        task=args.task, **_episodes(h) if args.task == "tools" else {},
        passed=final >= cfg.reward_threshold and final > first and all_final,
        plot=str(plot_path))


def _episodes(h: list[StepStats]) -> dict[str, float]:
    """The tools task's episodes over the run: turns, tool calls, segments, on average."""
    keys = ("turns_per_episode", "tool_calls_per_episode", "segments_per_episode")
    return {k: round(sum(getattr(x, k) for x in h) / len(h), 4) for k in keys}


def _report(run: _Run) -> int:
    """Write summary.json (and the trace breakdown), print the verdict; the exit status."""
    from rlfabric.cli import up_view

    args, console = run.args, run.console
    summary = _summary(run)
    rows, step_ms, n_steps = _breakdown(args.trace, run.run_dir) if args.trace else ([], 0.0, 0)
    if args.trace:
        summary["trace"] = args.trace
        summary["breakdown_ms"] = {r.phase: round(r.mean_ms, 3) for r in rows}
    (run.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    console.print(up_view.summary_table(run.history))
    if n_steps:
        console.print(up_view.breakdown_table(rows, step_ms, n_steps, args.trace))
        console.print(f"the last step's trace, drawn: {run.run_dir / 'last-step-trace.txt'}")
    elif args.trace:
        console.print(f"no step spans in {args.trace}")
    console.print(
        f"reward {summary['reward_first']:.3f} -> {summary['reward_final']:.3f} (the last "
        f"{config.FINAL_STEPS} steps' mean; threshold {run.cfg.reward_threshold}); mismatch "
        f"mean {summary['mismatch_mean']:.1e}, max {summary['mismatch_max']:.1e}; workers on "
        f"final version {run.final}: {run.on_final}; {summary['steps_per_s']:.2f} steps/s, "
        f"{summary['tokens_per_s']:.0f} tokens/s; {run.wall:.1f}s in all; each update pushed "
        f"{summary['update_bytes']:,} bytes (the whole model: {run.full_bytes:,})")
    console.print(f"plot: {summary['plot']}\nsummary: {run.run_dir / 'summary.json'}")
    console.print("[bold green]PASS[/]" if summary["passed"] else
                  "[bold red]FAIL[/]: reward below threshold or a worker not on the final version")
    if args.json:
        print(json.dumps(summary))
    return 0 if summary["passed"] else 1


def _breakdown(path: str, run_dir: Path) -> tuple[list[PhaseRow], float, int]:
    """Where a step's time went, from the spans file; the last step's trace drawn into
    run_dir/last-step-trace.txt."""
    from rlfabric.telemetry.report import draw, read_spans, step_breakdown

    try:
        spans = read_spans(path)
    except OSError:
        return [], 0.0, 0
    steps = [s for s in spans if s["name"] == "step"]
    if steps:
        last = max(steps, key=lambda s: s["attributes"].get("rlfabric.step", -1))
        (run_dir / "last-step-trace.txt").write_text(
            "\n".join(draw(spans, last["trace_id"], collapse=True)) + "\n")
    return step_breakdown(spans)


def _refused(args: argparse.Namespace) -> str:
    """Why these flags cannot run together ("" if they can)."""
    if args.workers < 1:
        return "--workers must be >= 1"
    if args.task == "tools":
        import importlib.util

        missing = [m for m in ("openai", "starlette", "uvicorn")
                   if importlib.util.find_spec(m) is None]
        if missing:
            return (f"--task tools runs its agents through `rlfabric gateway`, which needs "
                    f"{', '.join(missing)}: pip install 'rlfabric[gateway]'")
    if args.task == "tools" and (args.async_mode or args.lora):
        return ("--task tools trains every weight in sync mode: drop "
                f"{'--async' if args.async_mode else '--lora'}")
    if args.device and args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            return (f"--device {args.device}: no CUDA device is visible here; drop --device "
                    "(the trainer runs on cpu) or run on a GPU machine")
    if args.colocate and args.engine == "vllm" and not (args.device or "").startswith("cuda"):
        return ("--colocate: vLLM's CPU build frees no memory when it sleeps; colocate torch "
                "workers (--engine torch), or vLLM on a GPU (--device cuda)")
    if args.workers_external and not args.nats:
        return "--workers-external needs --nats URL, the server those workers use"
    auth = [f"--{n.replace('_', '-')}" for n in ("user", "token", "creds", "nkey", "tls_ca",
                                                  "tls_cert") if getattr(args, n)]
    if auth and not args.workers_external:
        return (f"{', '.join(auth)}: the workers up starts would connect without them; start "
                "workers with their own role's key (`rlfabric worker --nkey DIR/worker.nk ...`) "
                "and pass --workers-external")
    if args.nkey and args.task == "tools" and not args.gateway_nkey:
        return ("--task tools with --nkey: the gateway up starts needs its own role's key; "
                "pass --gateway-nkey DIR/gateway.nk")
    if args.workers_external and args.launcher != "process":
        return "--workers-external starts no workers; drop --launcher"
    if args.launcher != "ray" and (args.ray_address or args.gpus_per_worker):
        return "--ray-address and --gpus-per-worker go with --launcher ray"
    return ""


def run(args: argparse.Namespace) -> int:
    from rlfabric.errors import RLFabricError

    refused = _refused(args)
    if refused:
        print(f"rlfabric up: {refused}", file=sys.stderr)
        return 2
    run_dir = Path(args.out or runs_dir()) / time.strftime("%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)
    for path in (args.trace, args.metrics):  # this run's, not appended to an earlier one's
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_bytes(b"")
    fleet: Fleet | None = (None if args.workers_external
                           else RayActorFleet(args.ray_address, args.gpus_per_worker)
                           if args.launcher == "ray" else ProcessFleet(run_dir))
    telemetry = start_telemetry(args, "trainer")
    try:
        return anyio.run(_main, args, run_dir, fleet, telemetry)
    except KeyboardInterrupt:
        print(f"\nrlfabric up: interrupted; stopping {0 if fleet is None else args.workers} "
              "workers and the NATS server", file=sys.stderr)
        return 130
    except (RLFabricError, ValueError) as exc:
        print(f"rlfabric up: {exc}", file=sys.stderr)
        return 1
    finally:
        if fleet is not None:
            with contextlib.suppress(Exception):
                fleet.stop()
        telemetry.shutdown()
