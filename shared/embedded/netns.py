"""Network namespaces for a NATS cluster on one machine, so that a partition is a real one.

`gpufleet up --nats-cluster 3 --nats-netns` runs each nats-server in a network namespace of
its own, joined to the host by a veth pair on one bridge (`NetLab`). The addresses are taken
from 198.18.0.0/15 (RFC 2544, set aside for benchmarking network devices: nothing routes it),
one /24 per lab, the host end of the bridge at .254; the traffic never leaves the machine.

A partition is a pair of blackhole routes (`cut`): node A drops what it sends to B and B what
it sends to A, while both still answer the clients on the host. That is the partition that
hurts: a client connected to the minority node keeps a healthy-looking connection to a server
that can no longer reach the stream's quorum (the bus's watch moves it, shared/runtime/bus.py).
`heal` removes the routes. Every name carries the owning process's pid, so `sweep` can remove
what a supervisor killed with -9 left behind.

Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) and `ip` (iproute2); `available()` says whether
this machine has them, and why not.
"""

from __future__ import annotations

import ipaddress
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field

from gpufleet.shared.embedded.procs import pid_alive

PREFIX = "gf"
BASE = ipaddress.IPv4Network("198.18.0.0/15")


class NetnsError(RuntimeError):
    """An `ip` command failed; the message carries its own words."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)
    if check and proc.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def available() -> str | None:
    """None when network namespaces can be made here; otherwise why not."""
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"{PREFIX}{os.getpid()}probe"[:15]
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot make a network namespace: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def _subnet(pid: int) -> ipaddress.IPv4Network:
    """A /24 of 198.18.0.0/15 not already on this machine, from the pid."""
    taken = _ip("-4", "-o", "addr", check=False).stdout
    subnets = list(BASE.subnets(new_prefix=24))
    for k in range(len(subnets)):
        net = subnets[(pid + k) % len(subnets)]
        if f" {net.network_address + 254}/" not in taken:
            return net
    raise NetnsError("every /24 of 198.18.0.0/15 is in use on this machine")


@dataclass
class NetLab:
    """`n` namespaces on one bridge; node i (from 1) at `addr(i)`, the host at `host_addr`."""

    n: int
    owner: int = field(default_factory=os.getpid)
    net: ipaddress.IPv4Network | None = None
    cuts: set[tuple[int, int]] = field(default_factory=set)

    @property
    def bridge(self) -> str:
        return f"{PREFIX}{self.owner}br"

    def ns(self, i: int) -> str:
        return f"{PREFIX}{self.owner}n{i}"

    def addr(self, i: int) -> str:
        assert self.net is not None, "create() first"
        return str(self.net.network_address + i)

    @property
    def host_addr(self) -> str:
        assert self.net is not None, "create() first"
        return str(self.net.network_address + 254)

    @classmethod
    def attach(cls, doc: dict[str, object]) -> NetLab:
        """The lab a supervisor made, from mesh.json's `netns` ({owner, n, net}): to cut and heal it."""
        return cls(int(str(doc["n"])), int(str(doc["owner"])), ipaddress.IPv4Network(str(doc["net"])))

    def create(self) -> NetLab:
        self.net = _subnet(self.owner)
        _ip("link", "add", self.bridge, "type", "bridge")
        try:
            _ip("addr", "add", f"{self.host_addr}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i in range(1, self.n + 1):
                host_end = f"{PREFIX}{self.owner}h{i}"
                _ip("netns", "add", self.ns(i))
                _ip("link", "add", host_end, "type", "veth", "peer", "name", "eth0", "netns", self.ns(i))
                _ip("link", "set", host_end, "master", self.bridge)
                _ip("link", "set", host_end, "up")
                for cmd in (["link", "set", "lo", "up"], ["addr", "add", f"{self.addr(i)}/24", "dev", "eth0"],
                            ["link", "set", "eth0", "up"]):
                    _ip("-n", self.ns(i), *cmd)
        except BaseException:
            self.destroy()
            raise
        return self

    def argv(self, i: int, argv: list[str]) -> list[str]:
        """`argv` run inside node i's namespace (`ip netns exec` execs it: the pid is the program's)."""
        return ["ip", "netns", "exec", self.ns(i), *argv]

    def cut(self, a: int, b: int) -> None:
        """Nothing goes between nodes a and b, either way (the clients on the host still reach both)."""
        for src, dst in ((a, b), (b, a)):
            _ip("-n", self.ns(src), "route", "replace", "blackhole", f"{self.addr(dst)}/32")
        self.cuts.add((min(a, b), max(a, b)))

    def isolate(self, i: int, among: range | None = None) -> list[tuple[int, int]]:
        """Cut node i from every other node (of `among`, default all); returns the cuts made."""
        made = [(i, j) for j in (among or range(1, self.n + 1)) if j != i]
        for a, b in made:
            self.cut(a, b)
        return made

    def heal(self) -> None:
        """Remove every cut (read from the namespaces' routes: a lab attached by another process heals too)."""
        for i in range(1, self.n + 1):
            shown = _ip("-n", self.ns(i), "route", "show", "type", "blackhole", check=False).stdout
            for dst in re.findall(r"blackhole (\S+)", shown):
                _ip("-n", self.ns(i), "route", "del", "blackhole", dst if "/" in dst else f"{dst}/32", check=False)
        self.cuts.clear()

    def destroy(self) -> None:
        """Remove the namespaces (their veth ends go with them) and the bridge; the processes inside
        must have stopped (a namespace with a process in it lives on as that process's)."""
        for i in range(1, self.n + 1):
            _ip("netns", "del", self.ns(i), check=False)
        _ip("link", "del", self.bridge, check=False)


def sweep() -> list[str]:
    """Remove the namespaces and bridges of labs whose owning process is gone; returns their names."""
    gone: list[str] = []
    names = _ip("netns", "list", check=False).stdout.split()
    links = re.findall(rf"^\d+: ({PREFIX}\d+br)[:@]", _ip("-o", "link", check=False).stdout, re.M)
    for name in [*names, *links]:
        m = re.fullmatch(rf"{PREFIX}(\d+)(?:n\d+|br)", name)
        if m and not pid_alive(int(m.group(1))):
            _ip("netns", "del", name, check=False) if not name.endswith("br") else _ip("link", "del", name, check=False)
            gone.append(name)
    return gone
