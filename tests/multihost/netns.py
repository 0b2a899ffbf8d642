"""A tiny virtual network of Linux network namespaces for multi-host tests.

Layout (every name carries a per-run tag: pid + random hex, so concurrent runs
never collide):

    switch namespace  `pdmh-<tag>-sw`: a bridge `br0` (the "switch")
    host namespaces   `pdmh-<tag>-<host>`: `lo` up and `eth0` (a veth whose peer
                      `v-<host>` sits on the bridge) with 10.213.X.<n>/24
    root namespace    `pmh<tag>` (a veth whose peer `v-root` sits on the bridge)
                      with 10.213.X.1/24, so the test process itself can reach
                      the hosts without entering a namespace

Almost every link is created directly inside the namespaces (`ip -n NS link
add ... peer name ... netns OTHER`); the root-side veth is the only interface
the root namespace ever sees, and `remove()` deletes it together with every
namespace, whatever state the setup reached.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass, field

SUBNET_PREFIX = "10.213"


class NetnsUnavailable(Exception):
    """This process cannot create network namespaces (no `ip`, or no privilege)."""


def ip(*args: str, check: bool = True, timeout: float = 10.0) -> subprocess.CompletedProcess[str]:
    """Run `ip ARGS...`; raise with its stderr when `check` and it fails."""
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def new_tag() -> str:
    return f"{os.getpid() % 100000}{secrets.token_hex(2)}"


def check_available() -> None:
    """Raise NetnsUnavailable unless `ip` exists and a namespace can be created (and removed)."""
    missing = [tool for tool in ("ip", "ss") if shutil.which(tool) is None]
    if missing:
        raise NetnsUnavailable(f"iproute2 is not installed (no {', '.join(missing)} on PATH)")
    probe = f"pdmh-probe-{new_tag()}"
    try:
        made = ip("netns", "add", probe, check=False)
    except (OSError, subprocess.SubprocessError) as e:
        raise NetnsUnavailable(f"`ip netns add` could not run: {e}") from e
    if made.returncode != 0:
        raise NetnsUnavailable(
            f"cannot create network namespaces (`ip netns add` says: {made.stderr.strip()})"
        )
    ip("netns", "del", probe, check=False)


def _used_subnets() -> set[int]:
    out = (
        ip("-4", "-o", "addr", "show", check=False).stdout
        + ip("-4", "route", "show", "table", "all", check=False).stdout
    )
    used = set()
    for word in out.split():
        if word.startswith(SUBNET_PREFIX + "."):
            with contextlib.suppress(ValueError, IndexError):
                used.add(int(word.split(".")[2].split("/")[0]))
    return used


def pick_subnet() -> int:
    """A third octet X such that 10.213.X.0/24 is not in use in the root namespace."""
    used = _used_subnets()
    for _ in range(64):
        x = 16 + secrets.randbelow(224)
        if x not in used:
            return x
    raise RuntimeError("no free 10.213.X.0/24 subnet found")


@dataclass
class VirtualNetwork:
    hosts: tuple[str, ...]
    tag: str = field(default_factory=new_tag)
    subnet: int = field(default_factory=pick_subnet)
    _namespaces: list[str] = field(default_factory=list)
    _root_link: str = ""

    @property
    def switch(self) -> str:
        return f"pdmh-{self.tag}-sw"

    @property
    def root_link(self) -> str:
        return f"pmh{self.tag}"[:15]

    def ns(self, host: str) -> str:
        return f"pdmh-{self.tag}-{host}"

    def addr(self, host: str) -> str:
        return f"{SUBNET_PREFIX}.{self.subnet}.{self.hosts.index(host) + 2}"

    @property
    def root_addr(self) -> str:
        return f"{SUBNET_PREFIX}.{self.subnet}.1"

    @property
    def cidr(self) -> str:
        return str(ipaddress.ip_network(f"{SUBNET_PREFIX}.{self.subnet}.0/24"))

    def create(self) -> None:
        """Build the network; on any failure remove what was built and re-raise."""
        try:
            self._add_ns(self.switch)
            ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            ip("-n", self.switch, "link", "set", "br0", "up")
            for host in self.hosts:
                ns = self.ns(host)
                self._add_ns(ns)
                port = f"v-{host}"[:15]
                ip(
                    "-n",
                    self.switch,
                    *f"link add {port} type veth peer name eth0 netns {ns}".split(),
                )
                ip("-n", self.switch, "link", "set", port, "master", "br0")
                ip("-n", self.switch, "link", "set", port, "up")
                ip("-n", ns, "addr", "add", f"{self.addr(host)}/24", "dev", "eth0")
                ip("-n", ns, "link", "set", "eth0", "up")
            self._root_link = self.root_link
            ip(
                *f"link add {self._root_link} type veth peer name v-root netns {self.switch}".split()
            )
            ip("-n", self.switch, "link", "set", "v-root", "master", "br0")
            ip("-n", self.switch, "link", "set", "v-root", "up")
            ip("addr", "add", f"{self.root_addr}/24", "dev", self._root_link)
            ip("link", "set", self._root_link, "up")
        except BaseException:
            self.remove()
            raise

    def _add_ns(self, ns: str) -> None:
        ip("netns", "add", ns)
        self._namespaces.append(ns)
        ip("-n", ns, "link", "set", "lo", "up")

    def exec_prefix(self, host: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns(host)]

    def cut(self, host: str) -> None:
        """Pull the host's cable: its only interface goes down (the process keeps running)."""
        ip("-n", self.ns(host), "link", "set", "eth0", "down")

    def run_in(self, host: str, *cmd: str) -> str:
        proc = subprocess.run(
            [*self.exec_prefix(host), *cmd], capture_output=True, text=True, timeout=10
        )
        return proc.stdout

    def remove(self) -> None:
        """Delete the root veth and every namespace created (idempotent, never raises)."""
        if self._root_link:
            with contextlib.suppress(Exception):
                ip("link", "del", self._root_link, check=False)
            self._root_link = ""
        for ns in reversed(self._namespaces):
            with contextlib.suppress(Exception):
                ip("netns", "del", ns, check=False)
        self._namespaces.clear()

    def leftovers(self) -> list[str]:
        """Namespaces or links of this network still present (for the teardown check)."""
        names = ip("netns", "list", check=False).stdout
        left = [
            line.split()[0] for line in names.splitlines() if line.startswith(f"pdmh-{self.tag}-")
        ]
        if ip("link", "show", self.root_link, check=False).returncode == 0:
            left.append(self.root_link)
        return left
