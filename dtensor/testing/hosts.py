"""Simulated hosts: N separate network hosts on one Linux machine, for multi-host tests.

Each host is a network namespace with its own address on a private bridge (made by this
process, inside 10.213.0.0/16, and removed on exit), and its own hostname (a UTS namespace for
each command run there). MPI's process manager reaches them the way it reaches a cluster's
nodes over ssh: ``-launcher ssh -launcher-exec SCRIPT``, where the script runs the command in
the host's namespace instead of logging in. ``dtlaunch_args()`` gives the dtlaunch options::

    from dtensor.testing.hosts import simulated_hosts
    with simulated_hosts(2, slots=2) as hosts:
        subprocess.run(["dtlaunch", *hosts.dtlaunch_args(), "--nproc", "4", "train.py"],
                       env={**os.environ, **hosts.env})

``env`` makes UCX carry every message over the network (``UCX_TLS=tcp,self``): its default
transports would use shared memory between namespaces of one machine. Making namespaces needs
root (CAP_NET_ADMIN) and iproute2; where they cannot be made, :class:`Unavailable` says why
(the pytest fixture turns it into a skip with that reason).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from contextlib import contextmanager
from typing import Iterator

__all__ = ["SimulatedHosts", "Unavailable", "simulated_hosts"]


class Unavailable(RuntimeError):
    """Network namespaces cannot be made here (not root, no iproute2, no kernel support)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


class SimulatedHosts:
    """``n`` hosts with ``slots`` ranks each (see the module doc). Build with
    :func:`simulated_hosts`, which also tears them down."""

    _made = 0

    def __init__(self, n: int, slots: int):
        if shutil.which("ip") is None:
            raise Unavailable("iproute2's `ip` is not installed (apt install iproute2)")
        if os.geteuid() != 0:
            raise Unavailable("making network namespaces needs root (CAP_NET_ADMIN)")
        SimulatedHosts._made += 1  # names and subnet of its own, beside others of this process
        tag = f"dt{os.getpid() % 10000}x{SimulatedHosts._made}"  # interface names: <= 15 chars
        self.names = [f"{tag}h{i}" for i in range(n)]
        net = 16 + (os.getpid() + 37 * SimulatedHosts._made) % 224  # another /24 each
        self.addresses = [f"10.213.{net}.{i + 1}" for i in range(n)]
        self.iface, self._veths, self.slots = f"{tag}br", [f"{tag}v{i}" for i in range(n)], slots
        self.dir = tempfile.mkdtemp(prefix="dtensor-hosts-")
        self.env = {"UCX_TLS": "tcp,self"}
        try:
            self._make(net)
        except BaseException:
            self.close()
            raise

    def _make(self, net: int) -> None:
        probe = _ip("link", "add", self.iface, "type", "bridge", check=False)
        if probe.returncode:
            raise Unavailable(f"cannot make a bridge: {probe.stderr.strip()}")
        _ip("addr", "add", f"10.213.{net}.254/24", "dev", self.iface)
        _ip("link", "set", self.iface, "up")
        for name, veth, addr in zip(self.names, self._veths, self.addresses):
            made = _ip("netns", "add", name, check=False)
            if made.returncode:
                raise Unavailable(f"cannot make a network namespace: {made.stderr.strip()}")
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", name)
            _ip("link", "set", veth, "master", self.iface)
            _ip("link", "set", veth, "up")
            _ip("-n", name, "addr", "add", f"{addr}/24", "dev", "eth0")
            _ip("-n", name, "link", "set", "eth0", "up")
            _ip("-n", name, "link", "set", "lo", "up")
        self.hostfile = os.path.join(self.dir, "hostfile")
        with open(self.hostfile, "w") as f:
            f.writelines(f"{addr}:{self.slots}\n" for addr in self.addresses)
        # Called as ssh is ("SCRIPT [-x ...] HOST COMMAND"): COMMAND is one shell string, run
        # in HOST's namespace, under its own hostname.
        cases = "".join(f"  {addr}) ns={name} ;;\n"
                        for addr, name in zip(self.addresses, self.names))
        self.launcher_exec = os.path.join(self.dir, "launcher-exec")
        with open(self.launcher_exec, "w") as f:
            f.write("#!/bin/sh\n"
                    'while [ "${1#-}" != "$1" ]; do shift; done\n'
                    'host="$1"; shift\n'
                    f'case "$host" in\n{cases}'
                    '  *) echo "launcher-exec: no simulated host $host" >&2; exit 255 ;;\n'
                    "esac\n"
                    'exec ip netns exec "$ns" unshare --uts sh -c \'hostname "$0"; exec sh -c '
                    '"$*"\' "$ns" "$@"\n')
        os.chmod(self.launcher_exec, 0o755)

    def dtlaunch_args(self) -> list[str]:
        """dtlaunch's options for a job on these hosts."""
        return ["--hostfile", self.hostfile, "--launcher", "ssh", "--launcher-exec",
                self.launcher_exec, "--iface", self.iface]

    def link(self, host: int, up: bool) -> None:
        """Take host ``host``'s network link down (or back up), as a pulled cable would."""
        _ip("link", "set", self._veths[host], "up" if up else "down")

    def close(self) -> None:
        for name in getattr(self, "names", []):
            _ip("netns", "del", name, check=False)
        for veth in getattr(self, "_veths", []):
            _ip("link", "del", veth, check=False)
        if hasattr(self, "iface"):
            _ip("link", "del", self.iface, check=False)
        if hasattr(self, "dir"):
            shutil.rmtree(self.dir, ignore_errors=True)


@contextmanager
def simulated_hosts(n: int = 2, slots: int = 2) -> Iterator[SimulatedHosts]:
    """``n`` simulated hosts of ``slots`` ranks, removed on exit (see the module doc)."""
    hosts = SimulatedHosts(n, slots)
    try:
        yield hosts
    finally:
        hosts.close()
