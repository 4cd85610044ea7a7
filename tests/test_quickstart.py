"""docs/quickstart.md's two scripts run as written: a trainer and a replica in two
processes over nixl, on one host, and on two "hosts" (network namespaces joined by a veth
pair) where every connection must go from the replica to the ports the page names."""

from __future__ import annotations

import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

PAGE = Path(__file__).resolve().parents[1] / "docs" / "quickstart.md"
LAST = "replica-0: serving v3, weight[0, 0] = 3"


def scripts(directory: Path) -> dict[str, Path]:
    """Each python block of the page that names its file on its first line, written out."""
    out = {}
    for code in re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S):
        name = re.match(r"# (\w+\.py):", code)
        if name:
            path = out[name.group(1)] = directory / name.group(1)
            path.write_text(code)
    assert set(out) == {"trainer.py", "replica.py"}
    return out


def needs_nixl_and_torch() -> None:
    pytest.importorskip("torch")
    from weightpull import create_transport

    reason = type(create_transport("nixl")).unavailable_reason()
    if reason:
        pytest.skip(reason)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_both(trainer: list[str], replica: list[str], env: dict[str, str], *, timeout: float = 120) -> tuple[str, str]:
    """Start the trainer, run the replica to its end; both must exit 0. (stdout, stdout)."""
    t = subprocess.Popen(trainer, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        r = subprocess.run(replica, env=env, capture_output=True, text=True, timeout=timeout)
        t_out, t_err = t.communicate(timeout=30)
    finally:
        if t.poll() is None:
            t.kill()
            t.wait()
    assert r.returncode == 0, f"replica: {r.stdout}\n{r.stderr}\ntrainer: {t.stdout and t.stdout.read()}"
    assert t.returncode == 0, f"trainer: {t_out}\n{t_err}"
    return t_out, r.stdout


def test_the_quickstart_runs_as_written_in_two_processes(tmp_path):
    needs_nixl_and_torch()
    files = scripts(tmp_path)
    address = f"tcp://127.0.0.1:{free_port()}"
    env = {**os.environ, "WEIGHTPULL_SECRET": secrets.token_hex(16)}
    env.pop("WEIGHTPULL_REGISTRY", None)
    trainer, replica = run_both(
        [sys.executable, str(files["trainer.py"]), address], [sys.executable, str(files["replica.py"]), address], env
    )
    assert "trainer: published v3" in trainer
    assert replica.strip().splitlines()[-1] == LAST


# -- two hosts: network namespaces --------------------------------------------------------------

TRAINER_IP, REPLICA_IP = "10.213.7.1", "10.213.7.2"  # a private range, inside our namespaces only
UCX_PORTS = range(41000, 41010)  # the page's UCX_TCP_PORT_RANGE
REGISTRY_PORT = 5555


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


class Namespaces:
    """Two network namespaces joined by a veth pair; `close()` deletes both (and the pair)."""

    def __init__(self) -> None:
        tag = f"{os.getpid() % 100000}{secrets.token_hex(2)}"
        self.trainer, self.replica = f"wpq-t-{tag}", f"wpq-r-{tag}"
        self.made: list[str] = []
        for ns in (self.trainer, self.replica):
            ip("netns", "add", ns)
            self.made.append(ns)
        ip("link", "add", f"wpt{tag}", "type", "veth", "peer", "name", f"wpr{tag}")
        for ns, dev, addr in ((self.trainer, f"wpt{tag}", TRAINER_IP), (self.replica, f"wpr{tag}", REPLICA_IP)):
            ip("link", "set", dev, "netns", ns)
            ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            ip("-n", ns, "link", "set", dev, "up")
            ip("-n", ns, "link", "set", "lo", "up")

    def run(self, ns: str, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", ns, *argv]

    def close(self) -> None:
        for ns in self.made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)


def connections(ns: str) -> set[tuple[str, str]]:
    """(local, peer) of every TCP socket in `ns` that has a peer."""
    out = subprocess.run(["ip", "netns", "exec", ns, "ss", "-tanH"], capture_output=True, text=True, timeout=10).stdout
    return {
        (f[3], f[4]) for f in (line.split() for line in out.splitlines()) if len(f) >= 5 and not f[4].endswith(":*")
    }


def port(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


def test_the_quickstart_runs_across_two_hosts_through_the_named_ports_only(tmp_path):
    needs_nixl_and_torch()
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("ss"):
        pytest.skip("network namespaces need root, ip and ss")
    files = scripts(tmp_path)
    try:
        ns = Namespaces()
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"cannot make network namespaces here: {exc.stderr.decode().strip()}")
    seen: dict[str, set[tuple[str, str]]] = {ns.trainer: set(), ns.replica: set()}
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            for name in seen:
                seen[name] |= connections(name)
            time.sleep(0.1)

    watcher = threading.Thread(target=watch, daemon=True)
    try:
        watcher.start()
        address = f"tcp://{TRAINER_IP}:{REGISTRY_PORT}"
        # One kernel under both namespaces: UCX would read over CMA, never crossing the veth.
        env = {
            **os.environ,
            "WEIGHTPULL_SECRET": secrets.token_hex(16),
            "UCX_TLS": "tcp",
            "UCX_TCP_PORT_RANGE": f"{UCX_PORTS.start}-{UCX_PORTS.stop - 1}",
        }
        env.pop("WEIGHTPULL_REGISTRY", None)
        trainer, replica = run_both(
            ns.run(ns.trainer, [sys.executable, str(files["trainer.py"]), address]),
            ns.run(ns.replica, [sys.executable, str(files["replica.py"]), address]),
            env,
        )
    finally:
        done.set()
        watcher.join(10)
        ns.close()
    assert replica.strip().splitlines()[-1] == LAST

    allowed = {REGISTRY_PORT, *UCX_PORTS}
    crossing = {(local, peer) for local, peer in seen[ns.replica] if peer.startswith(TRAINER_IP + ":")}
    assert {port(peer) for _, peer in crossing} >= {REGISTRY_PORT}  # the watcher saw the registry's
    assert any(port(peer) in UCX_PORTS for _, peer in crossing)  # and the reads'
    assert all(port(peer) in allowed for _, peer in crossing), crossing
    # The trainer opened nothing towards the replica: its end of each is a listening port.
    from_trainer = {(local, peer) for local, peer in seen[ns.trainer] if peer.startswith(REPLICA_IP + ":")}
    assert all(port(local) in allowed for local, _ in from_trainer), from_trainer
