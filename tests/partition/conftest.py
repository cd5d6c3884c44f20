"""What the partition tests share: a `Net` of namespaces removed after each test, a 3-node
cluster in it, and workers each beside one node (the null engine: the faults under test are
the fabric's, and the CI machine has two cores)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest
from netns import Net, NsCluster, why_not


@pytest.fixture
def net() -> Iterator[Net]:
    if why := why_not():
        pytest.skip(f"the partition tests make network namespaces, and here {why}")
    n = Net()
    try:
        yield n
    finally:
        n.close()


@dataclass
class Site:
    """A cluster of 3 nodes; worker `w<i>` in host `w<i>` talks to node i; the trainer in
    host `tr` and the gateway (if asked for) in host `gw` know every node."""

    net: Net
    cluster: NsCluster
    workers: list = field(default_factory=list)
    gateway: str = ""  # the base URL of the gateway in host `gw` ("": none)


@pytest.fixture
def site(net: Net, spawn, tmp_path, prefix: str) -> Callable[..., Site]:
    def _start(*, sync: str = "", workers: int = 3, engine: str = "null",
               gateway: bool = False) -> Site:
        cluster = NsCluster(net, 3, str(tmp_path / "store"), sync=sync)
        net.host("tr")
        hosts = [net.host(f"w{i}") for i in range(workers)]
        gw = net.host("gw") if gateway else None
        cluster.start()
        out = Site(net, cluster)
        if gw is not None:  # a gateway of its own, knowing every node, as the trainer does
            proc = spawn("gateway", "--nats", cluster.url, "--prefix", prefix, "--model",
                         "tinyqwen", "--host", gw.addr, "--port", "8000", module="rlfabric",
                         under=gw.argv())
            out.gateway = proc.wait_for(r"serving \S+ at (http://\S+/v1)", timeout=120).group(1)
        for i, h in enumerate(hosts):
            out.workers.append(spawn(
                "worker", "--nats", cluster.urls[i % 3], "--prefix", prefix, "--worker-id",
                f"w{i}", "--engine", engine, "--threads", "1", "--capacity", "32",
                module="rlfabric", under=h.argv()))
        return out

    return _start
