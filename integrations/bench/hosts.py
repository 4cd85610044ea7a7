"""Emulated hosts: network namespaces on one machine, each with a shaped link to a switch.

Every host is a network namespace of its own with one veth link to a bridge that sits in a
switch namespace (so nothing is added to the machine's own network namespace). Each end
of every link is shaped with `tc tbf` to `rate`, so a host sends and receives at most
`rate` (a full-duplex NIC), and bytes between hosts really cross the links: run NIXL with
`UCX_TLS=tcp` (`ENV`), since the namespaces share one kernel and UCX would otherwise read
another process's memory directly (CMA), bypassing the links and their shaping.

With `control`, every host also has a second, unshaped link (`CONTROL_DEV`) to a second
bridge in the switch namespace, whose own address (`hub_address`) serves every host: a
cluster's front-end network beside its data fabric, for services such as the registry
whose few small messages must not queue behind the shaped bulk bytes. `ENV` then keeps
UCX to the data link (`DATA_DEV`), so that the bulk bytes never take the control one.

Bounded: at most `MAX_HOSTS` hosts; every `ip`/`tc` call has a timeout. It cleans up after
itself: `close()` (or leaving the `with`, also on SIGTERM) deletes every namespace it made,
which deletes their links, even when making them failed half way. Needs root.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import threading
from collections.abc import Sequence

from weightpull.errors import InvalidArgumentError

MAX_HOSTS = 17  # a trainer and 16 replicas
PREFIX = "wpfan"  # every namespace made here starts with it (leftovers are easy to find)
SUBNET = "10.213"  # hosts get 10.213.X.Y/16 inside their own namespaces only
CONTROL_SUBNET = "10.214"  # and, with control, 10.214.X.Y/16 on the control network
DATA_DEV, CONTROL_DEV = "data", "ctl"  # each host's links, named alike in every namespace
# UCX over the shaped data link alone: not shared memory or CMA, nor the control link
ENV = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": DATA_DEV}
_TIMEOUT_S = 20.0


def _run(argv: Sequence[str]) -> None:
    try:
        subprocess.run(list(argv), check=True, capture_output=True, timeout=_TIMEOUT_S)
    except subprocess.CalledProcessError as exc:
        raise RuntimeError(f"{' '.join(argv)} failed: {exc.stderr.decode().strip()}") from None


def unavailable_reason() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "emulated hosts need root (ip netns add)"
    for tool in ("ip", "tc"):
        if not shutil.which(tool):
            return f"emulated hosts need the {tool!r} command (iproute2)"
    return None


def namespaces() -> list[str]:
    """Every namespace on the machine whose name starts with `PREFIX`."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=_TIMEOUT_S).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(PREFIX)]


class Hosts:
    """`count` emulated hosts, host i at `address(i)`, each link shaped to `rate` (a `tc`
    rate: "1gbit", "400mbit"); None leaves the links unshaped. With `control`, host i is
    also at `control_address(i)` on an unshaped control network, where `hub_address` (in
    the switch's namespace: `hub_command`) reaches every host."""

    def __init__(self, count: int, *, rate: str | None = "1gbit", control: bool = False) -> None:
        if not isinstance(count, int) or isinstance(count, bool) or not 1 <= count <= MAX_HOSTS:
            raise InvalidArgumentError(f"hosts must be an int in [1, {MAX_HOSTS}], got {count!r}")
        why = unavailable_reason()
        if why:
            raise RuntimeError(why)
        self.count, self.rate, self.control = count, rate, control
        self.tag = secrets.token_hex(3)
        self.switch = f"{PREFIX}{self.tag}sw"
        self.made: list[str] = []
        try:
            self._make()
        except BaseException:
            self.close()
            raise

    def name(self, i: int) -> str:
        return f"{PREFIX}{self.tag}h{i}"

    def address(self, i: int) -> str:
        return f"{SUBNET}.{i // 250}.{i % 250 + 1}"

    def control_address(self, i: int) -> str:
        return f"{CONTROL_SUBNET}.{i // 250}.{i % 250 + 1}"

    @property
    def hub_address(self) -> str:
        """The switch namespace's own address on the control network (with `control`)."""
        return f"{CONTROL_SUBNET}.255.254"

    def _shape(self, ns: str, dev: str) -> None:
        if self.rate is None:
            return
        tc = ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev]
        _run([*tc, "root", "tbf", "rate", self.rate, "burst", "1mb", "latency", "50ms"])

    def _make(self) -> None:
        _run(["ip", "netns", "add", self.switch])
        self.made.append(self.switch)
        _run(["ip", "-n", self.switch, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", self.switch, "link", "set", "br0", "up"])
        if self.control:
            _run(["ip", "-n", self.switch, "link", "add", "br1", "type", "bridge"])
            _run(["ip", "-n", self.switch, "addr", "add", f"{self.hub_address}/16", "dev", "br1"])
            _run(["ip", "-n", self.switch, "link", "set", "br1", "up"])
        for i in range(self.count):
            ns = self.name(i)
            _run(["ip", "netns", "add", ns])
            self.made.append(ns)
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            there = self._link(ns, DATA_DEV, f"wf{self.tag}{i}s", self.address(i), "br0")
            self._shape(ns, DATA_DEV)  # what the host sends
            self._shape(self.switch, there)  # what it receives
            if self.control:
                self._link(ns, CONTROL_DEV, f"wf{self.tag}{i}c", self.control_address(i), "br1")

    def _link(self, ns: str, here: str, there: str, address: str, bridge: str) -> str:
        """A veth from host namespace `ns` (`here`, at `address`) to `bridge` (`there`)."""
        # made inside the host's namespace, so no link ever appears in the machine's own
        _run(["ip", "-n", ns, "link", "add", here, "type", "veth", "peer", "name", there, "netns", self.switch])
        _run(["ip", "-n", ns, "addr", "add", f"{address}/16", "dev", here])
        _run(["ip", "-n", ns, "link", "set", here, "up"])
        _run(["ip", "-n", self.switch, "link", "set", there, "master", bridge])
        _run(["ip", "-n", self.switch, "link", "set", there, "up"])
        return there

    def command(self, i: int, argv: Sequence[str]) -> list[str]:
        """`argv` run inside host i's namespace."""
        return ["ip", "netns", "exec", self.name(i), *argv]

    def hub_command(self, argv: Sequence[str]) -> list[str]:
        """`argv` run in the switch's namespace, which reaches every host at `hub_address`
        over the control network alone (with `control`)."""
        return ["ip", "netns", "exec", self.switch, *argv]

    def close(self) -> None:
        """Delete every namespace made (their links go with them). Safe to call twice."""
        errors = []
        while self.made:
            ns = self.made.pop()
            done = subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=_TIMEOUT_S)
            if done.returncode and ns in namespaces():
                errors.append(f"{ns}: {done.stderr.decode().strip()}")
        if errors:
            raise RuntimeError("could not delete namespaces: " + "; ".join(errors))

    def __enter__(self) -> Hosts:
        # A SIGTERM (`timeout`, a CI job cancelled) would end the process without its
        # finally blocks: while the hosts exist it raises instead, so they are deleted.
        self._previous = None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, _terminated)
        return self

    def __exit__(self, *exc_info: object) -> None:
        try:
            self.close()
        finally:
            if self._previous is not None:
                signal.signal(signal.SIGTERM, self._previous)


def _terminated(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)
