"""Provisioning is idempotent and follows the job prefix."""

from __future__ import annotations

import pytest
from nats.js.api import RetentionPolicy, StreamConfig

from rlfabric.bus import Bus, Limits, Subjects, connect, provision

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
        assert rollout.config.subjects == [f"{prefix}.rollout.request"]
        control = await js.stream_info(s.control_stream)
        assert control.config.subjects == [f"{prefix}.control.>"]
        assert (await js.stream_info(s.results_stream)).config.subjects == [
            f"{prefix}.rollout.result.>"]
        assert (await js.stream_info(s.weights_stream)).config.subjects == [f"{prefix}.weights.>"]
        # the first creator's settings stay; wrong subjects are repaired
        await js.update_stream(StreamConfig(name=s.control_stream, subjects=[f"{prefix}.x.>"],
                                            max_age=60.0))
        await provision(js, s)
        info = await js.stream_info(s.control_stream)
        assert info.config.subjects == [s.control_all] and info.config.max_age == 60.0
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
