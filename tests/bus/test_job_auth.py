"""Per-job keys (`rlfabric job create`), as the NATS server enforces them: with its own key a
job does everything it needs on the shared pool, and each thing of the pool's or of another
job's is refused at once, saying what.

| job A's key tries                               | refused by           | how             |
| its requests, results, adapter push, pause       | -                    | served          |
| pause the pool (`<p>.control.pause`)            | the server (publish) | PermissionDenied |
| base weights on the pool's subject              | the server (publish) | PermissionDenied |
| base weights on its own job's subject           | the worker           | ack `pool_only` |
| a command on job B's subjects                   | the server (publish) | PermissionDenied |
| a command naming job B on its own subjects      | the worker           | ack `pool_only` |
| a request on job B's subject                    | the server (publish) | PermissionDenied |
| a request naming job B on its own subject       | the worker           | `bad_request`   |
| a request on the pool's subject                 | the server (publish) | PermissionDenied |
| job B's results (a consumer on its stream)      | the server (publish) | refusal, at once |
| job B's token deltas, the gateway's sessions    | the server (subscribe) | refusal, at once |
| the pool's or job B's desired state             | the server (publish) | PermissionDenied |
| base weights, sleep through `FabricClient`      | the client           | PoolOnly        |
"""

from __future__ import annotations

import subprocess
import sys
import time
from typing import Any

import anyio
import msgspec
import pytest

from rlfabric.bus import (
    Bus,
    ConnectOptions,
    NatsAuthFailed,
    PermissionDenied,
    QuorumNotReached,
    connect,
)
from rlfabric.bus.nats.provision import ensure_consumer
from rlfabric.schemas import (
    Ack,
    Adapter,
    DesiredState,
    JobShare,
    Pause,
    RolloutError,
    RolloutRequest,
    RolloutResult,
    SamplingParams,
    encode,
)
from rlfabric.tensors import lora
from rlfabric.tensors.models import build_model
from rlfabric.trainer import FabricClient, PoolOnly

pytestmark = [pytest.mark.nats, pytest.mark.anyio, pytest.mark.timeout(240)]

QV = Adapter(name="policy", rank=4, alpha=8.0, target_modules=("q_proj", "v_proj"))


@pytest.fixture
def pool(tmp_path, prefix, spawn):
    """`rlfabric nats --auth DIR`, jobs exp-a and exp-b created with `rlfabric job create`,
    a worker with the worker key: (url, key dir)."""
    keys = tmp_path / "keys"
    proc = spawn("nats", "--port", "0", "--auth", str(keys), "--prefix", prefix,
                 module="rlfabric")
    url = proc.wait_for(r"ready at (nats://\S+)", timeout=30).group(1)
    for name in ("exp-a", "exp-b"):
        done = subprocess.run([sys.executable, "-m", "rlfabric", "job", "create", name,
                               "--auth", str(keys), "--prefix", prefix],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and "reloaded its users" in done.stdout, done
    worker = spawn("worker", "--nats", url, "--prefix", prefix, "--worker-id", "w0",
                   "--engine", "torch", "--threads", "1", "--nkey", str(keys / "worker.nk"),
                   module="rlfabric")
    worker.wait_for(r"ready \(", timeout=60)  # the pool's streams are there
    return url, keys


def opts(url: str, seed: Any) -> ConnectOptions:
    return ConnectOptions.from_url(url, nkey_seed_file=str(seed), connect_wait=3)


def req(rid: str, job: str = "", adapter: str = "") -> RolloutRequest:
    return RolloutRequest(request_id=rid, prompt_token_ids=[256, 3, 4], job=job,
                          adapter=adapter, sampling=SamplingParams(max_tokens=4, seed=1))


async def refused_at_once(bus: Bus, what: str, action: Any) -> str:
    """Run `action()` (which the server refuses without answering it) until the server's
    refusal naming `what` arrives; its words. Fails past 1 s."""
    since = time.monotonic()
    with anyio.fail_after(1.0):
        async with anyio.create_task_group() as tg:
            tg.start_soon(action)
            while (why := bus.link.refusal(what, since)) is None:
                await bus.link.refusals.event().wait()
            tg.cancel_scope.cancel()
    return why


async def sent_by_hand(bus: Bus, job: str, cmd: Pause) -> Ack:
    """`cmd` stored and sent live on job `job`'s subjects, as a client bypassing the
    broadcaster would; the worker's ack."""
    s = bus.subjects
    acks = await bus.nc.subscribe(s.ack(cmd.cmd_id))
    data = encode(cmd)
    stored = await bus.persist(s.control("pause", job), data,
                               bus.headers({"Nats-Msg-Id": cmd.cmd_id}))
    await bus.nc.publish(s.live_copy("pause", stored.seq, job), data)
    msg = await acks.next_msg(timeout=10)
    await acks.unsubscribe()
    return msgspec.msgpack.decode(msg.data, type=Ack)


async def test_a_jobs_key_does_its_jobs_work_and_nothing_of_the_pools_or_another_jobs(
        pool, prefix) -> None:
    url, keys = pool
    a_key, b_key = keys / "jobs" / "exp-a.nk", keys / "jobs" / "exp-b.nk"
    # what job A needs, with its own key only
    async with FabricClient.connect(opts(url, a_key), prefix=prefix, job="exp-a") as a:
        await a.wait_for_workers(1, timeout=60)
        state = lora.random_adapter(build_model("tiny"), QV, seed=3, std=0.2)
        rep = await a.update_weights(0, state_dict=state, adapter=QV)
        assert rep.ok == ("w0",)
        got = [r async for r in a.generate([req(f"r{i}", adapter="policy") for i in range(3)],
                                           timeout=60)]
        assert all(isinstance(r, RolloutResult) for r in got), got
        assert {s.policy.split("/")[1] for r in got for s in r.version_spans} == \
            {"exp-a:policy"}
        assert (await a.pause("keep")).ok == ("w0",) and (await a.resume()).ok == ("w0",)

        # the client refuses what acts on the pool before sending anything
        with pytest.raises(PoolOnly):
            await a.update_weights(1, module=build_model("tiny"))
        with pytest.raises(PoolOnly):
            await a.sleep()

        # the worker refuses what came on A's subjects but is not A's to send
        staged = await a.stage_weights(1, build_model("tiny"))
        base = staged.command("base-on-a", job="exp-a")
        with pytest.raises(QuorumNotReached) as ack:
            await a.broadcast(base)
        await staged.release()
        assert ack.value.report.acks["w0"].error_code == "pool_only"
        ack = await sent_by_hand(a.bus, "exp-a", Pause(cmd_id="pause-b", job="exp-b"))
        assert ack.error_code == "pool_only" and "names job 'exp-b'" in ack.error_message
        forged = [r async for r in a.rollouts.generate([req("forged", job="exp-b")],
                                                       timeout=30)]
        assert isinstance(forged[0], RolloutError) and forged[0].code == "bad_request"
        assert "came on job exp-a's subject" in forged[0].message

        # the server refuses the rest at once, saying what
        bus, s = a.bus, a.bus.subjects
        for subject, body in ((s.control("pause"), Pause(cmd_id="p1")),
                              (s.control("pause", "exp-b"), Pause(cmd_id="p2", job="exp-b")),
                              (s.control("update_weights"), base),
                              (s.rollout_request_of("exp-b"), req("b1", job="exp-b")),
                              (s.rollout_request, req("p2")),
                              (f"$KV.{s.state_bucket}.desired", DesiredState()),
                              (f"$KV.{s.state_bucket}.job.exp-b", DesiredState()),
                              # its own weight and quota are the operator's to set
                              (f"$KV.{s.state_bucket}.share.exp-a", JobShare(weight=100.0))):
            t0 = time.monotonic()
            with pytest.raises(PermissionDenied, match="publishing to") as denied:
                await bus.persist(subject, encode(body), bus.headers({"Nats-Msg-Id": subject}))
            assert time.monotonic() - t0 < 1.0, subject
            assert subject.lower() in str(denied.value).lower()
        b_results = s.results_stream_of("exp-b")
        why = await refused_at_once(bus, f"$JS.API.CONSUMER.CREATE.{b_results}", lambda: (
            bus.js.subscribe(s.rollout_result("cB", "exp-b"), stream=b_results,
                             ordered_consumer=True)))
        assert "publish" in why.lower()
        mine = s.consumer_of("exp-a")  # its consumer holds its quota: not its to change
        why = await refused_at_once(bus, f"$JS.API.CONSUMER.CREATE.{s.rollout_stream}.{mine}"
                                    f".{s.rollout_request_of('exp-a')}",
                                    lambda: ensure_consumer(bus.js, s, "exp-a", ack_wait=15,
                                                            max_in_flight=1000))
        assert "publish" in why.lower()
        for subject in (s.token_stream("cB", "exp-b"), s.sessions_all):
            why = await refused_at_once(bus, subject, lambda subject=subject: (
                bus.nc.subscribe(subject)))
            assert "subscription" in why.lower()

    # job B, with its own key, is untouched by all of it and does its own work
    async with FabricClient.connect(opts(url, b_key), prefix=prefix, job="exp-b") as b:
        got = [r async for r in b.generate([req("b-own")], timeout=60)]
        assert isinstance(got[0], RolloutResult)
        assert not (await b.bus.state.read("exp-b")).paused


async def test_job_list_show_and_delete(pool, prefix) -> None:
    """`rlfabric job list|show` name the jobs and what the pool holds of them; `delete`
    takes a key away: that key no longer connects."""
    url, keys = pool

    def job(*argv: str, role: str = "observer") -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "rlfabric", "job", *argv, "--auth",
                               str(keys), "--prefix", prefix, "--nats", url, "--nkey",
                               str(keys / f"{role}.nk"), "--wait", "3"],
                              capture_output=True, text=True, timeout=60)
    shared = job("set", "exp-a", "--weight", "2", "--max-in-flight", "3", role="trainer")
    assert shared.returncode == 0 and "weight 2, quota 3" in shared.stdout, shared
    refused = job("set", "exp-a", "--weight", "0", role="trainer")
    assert refused.returncode == 2 and "a weight must be > 0" in refused.stderr, refused
    listed = job("list")
    assert listed.returncode == 0 and "job exp-a" in listed.stdout and "job exp-b" in listed.stdout
    assert "exp-a: running" in listed.stdout and "weight 2, quota 3" in listed.stdout, listed
    shown = job("show", "exp-a")
    assert shown.returncode == 0 and f"{prefix}.rollout.request.exp-a" in shown.stdout
    kept = keys.parent / "exp-b.nk"
    kept.write_bytes((keys / "jobs" / "exp-b.nk").read_bytes())
    gone = job("delete", "exp-b", role="trainer")  # the pool's operator
    assert gone.returncode == 0 and "reloaded its users" in gone.stdout, gone
    assert "ended on the pool: 1 worker(s) acked" in gone.stdout
    assert "job exp-b" not in job("list").stdout
    with pytest.raises(NatsAuthFailed):  # its key no longer lets a client in
        await connect(ConnectOptions.from_url(url, nkey_seed_file=str(kept), connect_wait=1))
