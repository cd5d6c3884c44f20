"""`EmbeddedCluster`: N nats-servers on loopback routed into one cluster, JetStream on each.

    with EmbeddedCluster(3) as c:         # started once JetStream has a metadata leader
        c.url                             # every node's client URL, comma-separated
        c.kill(1); c.start_node(1)        # a crash and a restart with its own store

Each node is an `EmbeddedNats` with a server name (`n0`, `n1`, ...), its own JetStream store
(`<store_dir>/n<i>` when a store dir is given; kept), and routes to every other node. JetStream
clustering needs a quorum of nodes: N >= 3. Streams and buckets a job provisions on a
cluster get `replicas = min(3, N)` (`Limits.replicas`). With `route_tls`
(`TlsSetup.route_config()`) the nodes route to each other over mutual TLS.
"""

from __future__ import annotations

import json
import os
import socket
import time
from types import TracebackType

from rlfabric.bus.errors import NatsServerError
from rlfabric.bus.nats.server import DEFAULT_MAX_PAYLOAD, EmbeddedNats

#: in every line a node logs when its metadata leader changes (nats-server's
#: `processLeaderChange`): one elected ("Self is new JetStream cluster metadata leader",
#: "JetStream cluster new metadata leader: n1/rlfabric") or none ("JetStream cluster no
#: metadata leader", logged when a node's leader is gone: it stepped down, or lost quorum)
_META_LEADER = "metadata leader"
_NO_META_LEADER = "no metadata leader"
#: what a node logs when a port chosen for it was taken before it bound it
_PORT_TAKEN = "address already in use"
#: fresh starts on newly chosen ports before giving up
_START_TRIES = 3


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct free ports (all held open while choosing, so none repeats)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def route_config(cluster: str, i: int, routes: list[str], tls: str = "") -> str:
    """The config lines of node `n<i>` of `cluster`: it listens for routes on `routes[i]`
    ("host:port") and routes to every other node's; `tls`: the routes' `tls` block
    (`TlsSetup.route_config`), or plaintext."""
    peers = ", ".join(f'"nats-route://{r}"' for j, r in enumerate(routes) if j != i)
    return (f"server_name: n{i}\n"
            f"cluster {{\n  name: {cluster}\n  listen: \"{routes[i]}\"\n"
            f"  routes: [{peers}]\n{tls}}}\n")


def knows_meta_leader(log_lines: list[str]) -> bool:
    """Whether a node's log (`EmbeddedNats.log_lines`: its last 200 lines) last named a
    JetStream metadata leader elected, not lost. A JetStream API request sent to a node that
    knows none can go unanswered: the client times out."""
    last = next((line for line in reversed(log_lines) if _META_LEADER in line), None)
    return last is not None and _NO_META_LEADER not in last


class EmbeddedCluster:
    def __init__(self, n: int = 3, *, host: str = "127.0.0.1", port: int = 0,
                 store_dir: str | None = None, name: str = "rlfabric",
                 max_payload: int = DEFAULT_MAX_PAYLOAD, extra_config: str = "",
                 ready_timeout: float = 30.0, sync: str = "", route_tls: str = "") -> None:
        if n < 3:
            raise ValueError(f"a JetStream cluster needs at least 3 nodes (a quorum survives "
                             f"one loss); got {n}. One server: EmbeddedNats")
        self.n = n
        self.host = host
        self.name = name
        self.ready_timeout = ready_timeout
        self._port = port
        self._max_payload = max_payload
        self._store_dir = store_dir
        self._extra_config = extra_config
        self._sync = sync
        self._route_tls = route_tls
        #: each node's route listener, "host:port"
        self.routes: list[str] = []
        self.nodes = self._make_nodes()

    def _make_nodes(self) -> list[EmbeddedNats]:
        """The nodes, on the given client ports or on free ones, and on free route ports."""
        n, host, store = self.n, self.host, self._store_dir
        client = [self._port + i for i in range(n)] if self._port else free_ports(n, host)
        self.routes = [f"{host}:{p}" for p in free_ports(n, host)]
        return [
            EmbeddedNats(port=client[i], host=host, max_payload=self._max_payload,
                         store_dir=os.path.join(store, f"n{i}") if store else None,
                         extra_config=route_config(self.name, i, self.routes, self._route_tls)
                         + self._extra_config,
                         ready_timeout=self.ready_timeout, sync=self._sync)
            for i in range(n)
        ]

    @property
    def urls(self) -> list[str]:
        return [f"nats://{self.host}:{node.requested_port}" for node in self.nodes]

    @property
    def url(self) -> str:
        """Every node's client URL, comma-separated: what clients and workers take."""
        return ",".join(self.urls)

    def start(self) -> EmbeddedCluster:
        """Start every node. A port chosen at random can be taken (by any process's connection)
        before its node binds it: the cluster then starts again on newly chosen ports."""
        tries = 1
        while True:
            try:
                for node in self.nodes:
                    node.start()
                self.wait_for_jetstream()
                return self
            except NatsServerError as exc:
                self.stop()
                taken = any(_PORT_TAKEN in line for line in exc.fatal_lines)
                if not taken or self._port or tries == _START_TRIES:
                    raise
                tries += 1
                self.nodes = self._make_nodes()
            except BaseException:
                self.stop()
                raise

    def wait_for_jetstream(self, timeout: float | None = None) -> None:
        """Block until every node knows the cluster's JetStream metadata leader and
        every node tells a connecting client about all N nodes (a job provisioned then
        counts the whole cluster: `provision.cluster_size`)."""
        deadline = time.monotonic() + (timeout or self.ready_timeout)
        while not (all(knows_meta_leader(node.log_lines) for node in self.nodes)
                   and all(self._known_nodes(url) == self.n for url in self.urls)):
            if time.monotonic() > deadline:
                tails = " || ".join(f"n{i}: " + " | ".join(node.log_lines[-3:])
                                    for i, node in enumerate(self.nodes))
                raise NatsServerError(f"cluster of {self.n} formed no JetStream metadata leader "
                                      f"with every node routed within "
                                      f"{timeout or self.ready_timeout}s: {tails}")
            time.sleep(0.05)  # the servers' logs are read by threads; nothing to await here

    def _known_nodes(self, url: str) -> int:
        """The nodes the server at `url` advertises to a client (its INFO's connect_urls)."""
        host, _, port = url.removeprefix("nats://").rpartition(":")
        try:
            with socket.create_connection((host, int(port)), timeout=1.0) as sock:
                line = sock.makefile("rb").readline(1 << 16)
        except OSError:
            return 0
        if not line.startswith(b"INFO "):
            return 0
        return len(set(json.loads(line[5:]).get("connect_urls") or []))

    def kill(self, i: int) -> None:
        """SIGKILL node `i`, as a crash would (its store stays)."""
        self.nodes[i].kill()

    def start_node(self, i: int) -> None:
        """Start node `i` again on its port, with its store."""
        self.nodes[i].start()

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> EmbeddedCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def __aenter__(self) -> EmbeddedCluster:
        import anyio.to_thread

        return await anyio.to_thread.run_sync(self.start)

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        import anyio

        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(self.stop)
