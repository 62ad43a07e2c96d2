"""Several hosts on this machine: network namespaces joined by a bridge, each with its own
address, and links a test can cut and restore.

`Hosts(n)` makes n namespaces `mpmd<tag>h<i>` (tag: random, so concurrent test runs never
share one), a bridge `mpmd<tag>b` in this machine's own namespace with no address of its
own (nothing outside the namespaces is reachable from them, and they reach nothing else),
and a veth pair per host: `mpmd<tag>v<i>` on the bridge, `eth0` inside with 10.<x>.<y>.<i+1>/24.
`cut(i)` sets host i's bridge end down (every packet to and from it is dropped: a partition
that its processes cannot see locally) and `restore(i)` sets it up again. Processes are
started inside a host by `popen(i, argv)` (`ip netns exec`), remembered by pid and stopped
by pid on close, which then deletes every namespace, link and the bridge, whatever happened
(a context manager; `skip_unless_root` skips where namespaces cannot be made).

Inside host i this machine's hostname names host i's address, as a real host's name names its
own (`ip netns exec` mounts /etc/netns/<name>/hosts over /etc/hosts): a gang's gloo collectives
(runtime/worker/gang.py) listen on the address the hostname resolves to, which here would
otherwise be loopback, out of the other hosts' reach.

A namespace shares this machine's filesystem, /dev/shm and pid space; its abstract Unix
sockets are its own (they belong to the network namespace), so mpmd's shared-memory
endpoints (runtime/wire/shm.py), which are abstract sockets, are reachable only from the
same namespace: two workers in one namespace pair through shared memory, two in different
ones through sockets, which is what "one host" means here.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest


def _ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + ["ip", *args]
    return subprocess.run(cmd, capture_output=True, text=True, check=check)


def skip_unless_root() -> None:
    """Skip the calling test where network namespaces cannot be made (not root, no `ip`)."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    probe = f"mpmdp{secrets.token_hex(3)}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot make a network namespace here: {r.stderr.strip()}")
    subprocess.run(["ip", "netns", "delete", probe], capture_output=True)


class Hosts:
    def __init__(self, n: int):
        self.tag = secrets.token_hex(2)
        self.bridge = f"mpmd{self.tag}b"
        self.names = [f"mpmd{self.tag}h{i}" for i in range(n)]
        self.links = [f"mpmd{self.tag}v{i}" for i in range(n)]
        x, y = secrets.randbelow(200) + 20, secrets.randbelow(250) + 1
        self.addresses = [f"10.{x}.{y}.{i + 1}" for i in range(n)]
        self.procs: list[subprocess.Popen] = []
        try:
            _ip("link", "add", "name", self.bridge, "type", "bridge")
            _ip("link", "set", self.bridge, "up")
            for name, link, address in zip(self.names, self.links, self.addresses):
                subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True)
                _ip("link", "add", link, "type", "veth", "peer", "name", f"{link}p")
                _ip("link", "set", f"{link}p", "netns", name)
                _ip("link", "set", link, "master", self.bridge)
                _ip("link", "set", link, "up")
                _ip("link", "set", "lo", "up", ns=name)
                _ip("link", "set", f"{link}p", "name", "eth0", ns=name)
                _ip("addr", "add", f"{address}/24", "dev", "eth0", ns=name)
                _ip("link", "set", "eth0", "up", ns=name)
                etc = Path("/etc/netns") / name
                etc.mkdir(parents=True, exist_ok=True)
                (etc / "hosts").write_text(f"127.0.0.1 localhost\n::1 localhost\n{address} {socket.gethostname()}\n")
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def popen(self, i: int, argv: list[str], **kw) -> subprocess.Popen:
        """`argv` started inside host i (its own network; this machine's files and pids)."""
        p = subprocess.Popen(["ip", "netns", "exec", self.names[i], *argv], **kw)
        self.procs.append(p)
        return p

    def cut(self, i: int) -> None:
        """Host i drops off the network (its link down at the bridge)."""
        _ip("link", "set", self.links[i], "down")

    def restore(self, i: int) -> None:
        _ip("link", "set", self.links[i], "up")

    def close(self) -> None:
        """Stop every process started here (SIGKILL by pid, which a stopped process takes too),
        then remove the namespaces, links and bridge."""
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for link in self.links:
            _ip("link", "delete", link, check=False)
        for name in self.names:
            subprocess.run(["ip", "netns", "delete", name], capture_output=True)
            shutil.rmtree(Path("/etc/netns") / name, ignore_errors=True)
        _ip("link", "delete", self.bridge, check=False)
        deadline = time.monotonic() + 5
        while any(os.path.exists(f"/run/netns/{name}") for name in self.names) and time.monotonic() < deadline:
            time.sleep(0.05)
