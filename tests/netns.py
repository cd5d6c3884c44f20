"""A partition harness: hosts in network namespaces of their own on one bridge, a JetStream
cluster across three of them, and the faults a real network has.

    net = Net()                          # a hub namespace holding the bridge
    a = net.host("n0")                   # a namespace with eth0 on the bridge (10.<k>.0.x)
    net.cut("n0") / net.heal()           # its link down (cut off from every host) / all back
    net.split(["n0", "w0"])              # those hosts keep each other, lose the rest
    with a.entered(): ...                # this thread's sockets are made inside `a`
    net.close()                          # its servers stopped, every namespace removed

A cut or a split drops packets silently, as a pulled cable does: no host is told. Only
namespaces and addresses this harness creates are touched; `close()` removes them however the
test ended. `why_not()` says why namespaces cannot be made here (not root, no `ip`).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator

from rlfabric.bus import EmbeddedNats
from rlfabric.bus.nats.cluster import knows_meta_leader, route_config

CLONE_NEWNET = 0x40000000
CLIENT_PORT, ROUTE_PORT, HTTP_PORT = 4222, 6222, 8222


def ip(*args: str) -> None:
    """Run `ip ARGS`; a failure raises saying what it printed."""
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if done.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip() or done.returncode}")


def why_not() -> str:
    """Empty if this process can make network namespaces; else why not."""
    if sys.platform != "linux":
        return f"network namespaces are Linux's ({sys.platform} here)"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    if not shutil.which("ip"):
        return "no `ip` (iproute2) on PATH"
    probe = f"rlfprobe{uuid.uuid4().hex[:6]}"
    try:
        ip("netns", "add", probe)
    except RuntimeError as exc:
        return f"cannot make a network namespace: {exc}"
    with contextlib.suppress(RuntimeError):
        ip("netns", "del", probe)
    return ""


def _setns(path: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({path}): {os.strerror(err)}")
    finally:
        os.close(fd)


class Host:
    def __init__(self, name: str, ns: str, addr: str) -> None:
        self.name = name
        self.ns = ns
        self.addr = addr

    def argv(self, *cmd: str) -> list[str]:
        """`cmd` run inside this host (`ip netns exec` execs it: its pid is the command's)."""
        return ["ip", "netns", "exec", self.ns, *cmd]

    @contextlib.contextmanager
    def entered(self) -> Iterator[Host]:
        """This thread inside the host while the block runs: sockets made then (an asyncio
        loop's, run in this thread) live there. Threads started earlier stay outside."""
        back = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        try:
            _setns(f"/var/run/netns/{self.ns}")
            yield self
        finally:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.setns(back, CLONE_NEWNET)
            os.close(back)


class Net:
    def __init__(self) -> None:
        self.tag = uuid.uuid4().hex[:6]
        self.subnet = f"10.{200 + int(self.tag[:2], 16) % 50}.{int(self.tag[2:4], 16)}"
        self.hub = f"rlf{self.tag}hub"
        self.hosts: dict[str, Host] = {}
        self.servers: list[EmbeddedNats] = []
        ip("netns", "add", self.hub)
        try:
            for br in ("br0", "br1"):  # br1: the island a split moves one side onto
                ip("-n", self.hub, "link", "add", br, "type", "bridge")
                ip("-n", self.hub, "link", "set", br, "up")
        except BaseException:
            self.close()
            raise

    def host(self, name: str) -> Host:
        ns = f"rlf{self.tag}{name}"
        addr = f"{self.subnet}.{len(self.hosts) + 10}"
        ip("netns", "add", ns)
        host = Host(name, ns, addr)
        self.hosts[name] = host
        ip("-n", ns, "link", "set", "lo", "up")
        ip("-n", self.hub, "link", "add", f"p-{name}", "type", "veth", "peer", "name", "eth0",
           "netns", ns)
        ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
        ip("-n", ns, "link", "set", "eth0", "up")
        ip("-n", self.hub, "link", "set", f"p-{name}", "master", "br0")
        ip("-n", self.hub, "link", "set", f"p-{name}", "up")
        return host

    def cut(self, *names: str) -> None:
        """Each host's link down: it reaches no other host, and none reaches it."""
        for name in names:
            ip("-n", self.hub, "link", "set", f"p-{name}", "down")

    def split(self, side: list[str]) -> None:
        """The hosts in `side` keep reaching each other and nobody else."""
        for name in side:
            ip("-n", self.hub, "link", "set", f"p-{name}", "master", "br1")

    def heal(self) -> None:
        for name in self.hosts:
            ip("-n", self.hub, "link", "set", f"p-{name}", "master", "br0")
            ip("-n", self.hub, "link", "set", f"p-{name}", "up")

    def close(self) -> None:
        for srv in self.servers:
            with contextlib.suppress(Exception):
                resume(srv)
                srv.stop(timeout=5)
        for ns in [h.ns for h in self.hosts.values()] + [self.hub]:
            with contextlib.suppress(RuntimeError):
                ip("netns", "del", ns)
        self.hosts.clear()


def pause(srv: EmbeddedNats) -> None:
    """SIGSTOP the server: it holds its sockets and answers nothing, as a stalled VM does."""
    if srv.pid is not None:
        os.kill(srv.pid, signal.SIGSTOP)


def resume(srv: EmbeddedNats) -> None:
    if srv.pid is not None:
        os.kill(srv.pid, signal.SIGCONT)


class NsCluster:
    """Three or more nats-server nodes (JetStream on), node i in host `n<i>` of `net`, routed
    into one cluster; each keeps its store in `store_dir/n<i>` (kept across a node's `kill()`
    and `start()`)."""

    def __init__(self, net: Net, n: int, store_dir: str, *, sync: str = "") -> None:
        self.net = net
        hosts = [net.host(f"n{i}") for i in range(n)]
        self.hosts = hosts
        self.nodes = []
        routes = [f"{h.addr}:{ROUTE_PORT}" for h in hosts]
        for i, h in enumerate(hosts):
            conf = f'http: "{h.addr}:{HTTP_PORT}"\n' + route_config("part", i, routes)
            node = EmbeddedNats(port=CLIENT_PORT, host=h.addr, extra_config=conf,
                                store_dir=os.path.join(store_dir, f"n{i}"), sync=sync,
                                ready_timeout=30, launcher=h.argv(), max_file_store=1 << 32)
            self.nodes.append(node)
            net.servers.append(node)

    @property
    def urls(self) -> list[str]:
        return [f"nats://{h.addr}:{CLIENT_PORT}" for h in self.hosts]

    @property
    def url(self) -> str:
        return ",".join(self.urls)

    def start(self, timeout: float = 60.0) -> NsCluster:
        """Start every node not running, then wait until each has logged an elected metadata
        leader (a JetStream request sent before can go unanswered)."""
        for node in self.nodes:
            if node.pid is None:
                node.start()
        deadline = time.monotonic() + timeout
        while not all(knows_meta_leader(node.log_lines) for node in self.nodes):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no metadata leader within {timeout}s: "
                                   + " || ".join(" | ".join(n.log_lines[-3:])
                                                 for n in self.nodes))
            time.sleep(0.05)  # the servers' logs are read by threads; nothing to await here
        return self

    def jsz(self, i: int) -> dict:
        """Node i's /jsz monitoring page (the caller's thread must reach the node)."""
        url = f"http://{self.hosts[i].addr}:{HTTP_PORT}/jsz"
        with urllib.request.urlopen(url, timeout=2) as page:
            return json.loads(page.read())

    def meta_leader(self, timeout: float = 60.0, among: range | None = None) -> int:
        """The node every reachable node (`among`, default all) names as metadata leader."""
        among = among if among is not None else range(len(self.nodes))
        deadline = time.monotonic() + timeout
        seen: list[str] = []
        while time.monotonic() < deadline:
            try:
                seen = [self.jsz(i).get("meta_cluster", {}).get("leader", "") for i in among]
            except OSError as exc:
                seen = [f"{type(exc).__name__}"]
            if seen and seen[0][1:].isdecimal() and len(set(seen)) == 1 and all(
                    knows_meta_leader(self.nodes[i].log_lines) for i in among):
                return int(seen[0][1:])
            time.sleep(0.1)  # the nodes elect on their own clock; nothing here to await
        raise TimeoutError(f"no metadata leader agreed within {timeout}s: {seen}")
