"""Provisioning is idempotent and follows the job prefix."""

from __future__ import annotations

import subprocess
import sys

import pytest
from nats.js.api import AckPolicy, ConsumerConfig, RetentionPolicy, StreamConfig

from rlfabric.bus import Bus, EmbeddedNats, Limits, ProvisioningError, Subjects, connect, provision
from rlfabric.bus.nats.provision import ensure_consumer

pytestmark = [pytest.mark.nats, pytest.mark.anyio]


async def test_provision_twice_and_repair_drift(nats_url: str, prefix: str) -> None:
    s = Subjects(prefix)
    nc = await connect(nats_url)
    try:
        js = nc.jetstream()
        b1 = await provision(js, s, Limits(member_ttl=3.0))
        b2 = await provision(js, s, Limits(member_ttl=9.0))  # the first creator's TTL stays
        assert b1.member_ttl == b2.member_ttl == 3.0
        rollout = await js.stream_info(s.rollout_stream)
        assert rollout.config.retention == RetentionPolicy.WORK_QUEUE
        assert rollout.config.subjects == [f"{prefix}.rollout.request",
                                           f"{prefix}.rollout.request.*"]  # and each job's
        control = await js.stream_info(s.control_stream)
        assert control.config.subjects == [f"{prefix}.control.>"]
        assert (await js.stream_info(s.results_stream)).config.subjects == [
            f"{prefix}.rollout.result.*"]  # a job's results have a stream of their own
        assert (await js.stream_info(s.weights_stream)).config.subjects == [f"{prefix}.weights.>"]
        # the first creator's settings stay; wrong subjects are repaired
        await js.update_stream(StreamConfig(name=s.control_stream, subjects=[f"{prefix}.x.>"],
                                            max_age=60.0))
        await provision(js, s)
        info = await js.stream_info(s.control_stream)
        assert info.config.subjects == [s.control_all] and info.config.max_age == 60.0
    finally:
        await nc.close()


async def test_a_pool_from_before_job_consumers_gives_each_job_its_own_once_provisioned(
        nats_url: str, prefix: str) -> None:
    """A rollout stream from before jobs had subjects, and a workers' consumer that took every
    job's requests (schema 1.3), are repaired: the pool's consumer takes the pool's requests
    only, and a job's request goes to that job's consumer."""
    s = Subjects(prefix)
    nc = await connect(nats_url)
    try:
        js = nc.jetstream()
        await js.add_stream(StreamConfig(name=s.rollout_stream, subjects=[s.rollout_request],
                                         retention=RetentionPolicy.WORK_QUEUE))
        await js.add_consumer(s.rollout_stream, ConsumerConfig(
            durable_name=s.rollout_consumer, ack_policy=AckPolicy.EXPLICIT,
            filter_subject=f"{prefix}.rollout.>"))
        await provision(js, s)
        info = await js.consumer_info(s.rollout_stream, s.rollout_consumer)
        assert info.config.filter_subject == s.rollout_request
        await ensure_consumer(js, s, "exp-a", ack_wait=15.0, max_in_flight=3)
        mine = await js.consumer_info(s.rollout_stream, s.consumer_of("exp-a"))
        assert mine.config.max_ack_pending == 3
        await js.publish(s.rollout_request_of("exp-a"), b"x")
        sub = await js.pull_subscribe_bind(s.consumer_of("exp-a"), s.rollout_stream)
        (msg,) = await sub.fetch(1, timeout=5)
        assert msg.subject == f"{prefix}.rollout.request.exp-a"
    finally:
        await nc.close()


async def test_two_prefixes_do_not_share_anything(nats_url: str) -> None:
    async with Bus.connect(nats_url, prefix="jobA") as a, Bus.connect(nats_url, prefix="jobB") as b:
        assert a.subjects.control_stream == "JOBA_CONTROL"
        assert b.subjects.control_stream == "JOBB_CONTROL"
        await a.buckets.members.put("w", b"x")
        assert await b.fleet.members() == {}


def test_bad_prefix_is_refused() -> None:
    with pytest.raises(ValueError, match=r"subject prefix 'rl\.x'"):
        Subjects("rl.x")


async def test_a_job_the_store_cannot_set_aside_is_refused_naming_it_until_one_is_deleted(
        ) -> None:
    """Two jobs' caps (about 1.1 GiB each) on a 1.5 GiB store: the second is refused, naming
    what and how much; `rlfabric ctl delete-job` on the first makes room for it."""
    async with EmbeddedNats(max_file_store=1536 * 1024 * 1024) as srv:
        async with Bus.connect(srv.url, prefix="one"):
            pass
        with pytest.raises(ProvisioningError, match=r"cannot set aside \d+ MiB for .*delete-job"):
            async with Bus.connect(srv.url, prefix="two"):
                pass
        out = subprocess.run([sys.executable, "-m", "rlfabric", "ctl", "--nats", srv.url,
                              "--prefix", "one", "delete-job"], capture_output=True, text=True,
                             timeout=60)
        async with Bus.connect(srv.url, prefix="two") as two:
            depths = await two.fleet.stream_depths()
    assert out.returncode == 0 and "ONE_WEIGHTS" in out.stdout, out.stderr
    assert depths["TWO_WEIGHTS"] == 0
