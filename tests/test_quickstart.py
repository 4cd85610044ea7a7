"""docs/guides/quickstart.md's two scripts run as written: a trainer and a replica in two
processes over nixl, on one host (the registry in development mode), and on two "hosts"
(network namespaces joined by a veth pair), where the page's shell commands run as printed
(each host's key pair made there, the trainer serving with keys) and every connection
must go from the replica to the ports the page names."""

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

PAGE = Path(__file__).resolve().parents[1] / "docs" / "guides" / "quickstart.md"
LAST = "replica-0: serving v3, weight[0, 0] = 3"
# What the scripts must not take from the environment the tests run in.
CLEARED = ("WEIGHTPULL_REGISTRY", "WEIGHTPULL_SECRET", "WEIGHTPULL_KEY", "WEIGHTPULL_SERVER_KEY")
# The deprecated shared secret's warnings (server's and client's) fail the scripts: the page
# shows the ways that replace it.
NO_SECRET = (
    "error:serving the registry with a shared secret:DeprecationWarning,error:a shared secret:DeprecationWarning"
)


def clean_env(**extra: str) -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if k not in CLEARED}, "PYTHONWARNINGS": NO_SECRET, **extra}


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


def run_both(
    trainer: list[str],
    replica: list[str],
    env: dict[str, str],
    *,
    cwd: tuple[Path | None, Path | None] = (None, None),
    timeout: float = 120,
) -> tuple[str, str]:
    """Start the trainer, run the replica to its end; both must exit 0. (stdout, stdout)."""
    t = subprocess.Popen(trainer, env=env, cwd=cwd[0], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        r = subprocess.run(replica, env=env, cwd=cwd[1], capture_output=True, text=True, timeout=timeout)
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
    address = f"tcp://127.0.0.1:{free_port()}"  # the page's default, 5555, on a port free here
    trainer, replica = run_both(
        [sys.executable, str(files["trainer.py"]), address],
        [sys.executable, str(files["replica.py"]), address],
        clean_env(),
    )
    assert "trainer: published v3" in trainer
    assert replica.strip().splitlines()[-1] == LAST


# -- two hosts: network namespaces --------------------------------------------------------------

# The page's hosts, inside our namespaces only (each has a routing table of its own).
TRAINER_IP, REPLICA_IP = "10.0.0.1", "10.0.0.2"
UCX_PORTS = range(41000, 41010)  # the page's UCX_TCP_PORT_RANGE
REGISTRY_PORT = 5555


def two_host_steps() -> list[tuple[str, str]]:
    """(host, shell lines) of each `# on HOST` part of the "Two hosts" section's shell
    blocks, in the page's order."""
    section = PAGE.read_text().split("## Two hosts", 1)[1].split("\n## ", 1)[0]
    steps: list[tuple[str, str]] = []
    for block in re.findall(r"```\n(.*?)```", section, re.S):
        for part in re.split(r"^(?=# on )", block, flags=re.M):
            host = re.match(r"# on ([\d.]+)", part)
            assert host or not part.strip(), f"a shell block's part that names no host: {part!r}"
            if host:
                steps.append((host.group(1), part))
    return steps


def commands_on_path(directory: Path) -> dict[str, str]:
    """`python` and `weightpull` as the page's lines call them: this interpreter, first on PATH."""
    directory.mkdir()
    for name, argv in (("python", [sys.executable]), ("weightpull", [sys.executable, "-m", "weightpull"])):
        (directory / name).write_text(f'#!/bin/sh\nexec {" ".join(argv)} "$@"\n')
        (directory / name).chmod(0o755)
    return {"PATH": f"{directory}:{os.environ['PATH']}"}


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
    steps = two_host_steps()
    assert [host for host, _ in steps] == [TRAINER_IP, REPLICA_IP, TRAINER_IP, REPLICA_IP], steps
    make_server_key, make_replica_key, trainer_cmd, replica_cmd = (lines for _, lines in steps)
    hosts = {TRAINER_IP: tmp_path / "trainer-host", REPLICA_IP: tmp_path / "replica-host"}
    for directory in hosts.values():
        directory.mkdir()
        scripts(directory)
    # One kernel under both namespaces: UCX would read over CMA, never crossing the veth.
    env = clean_env(UCX_TLS="tcp", **commands_on_path(tmp_path / "bin"))
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
        # Each host makes its key pair; the public halves are copied across, as the page says.
        for name, host, lines in (
            (ns.trainer, TRAINER_IP, make_server_key),
            (ns.replica, REPLICA_IP, make_replica_key),
        ):
            subprocess.run(ns.run(name, ["bash", "-ec", lines]), env=env, cwd=hosts[host], check=True, timeout=60)
        trainer_keys, replica_keys = hosts[TRAINER_IP] / "keys", hosts[REPLICA_IP] / "keys"
        shutil.copy(trainer_keys / "registry.key", replica_keys)
        shutil.copy(replica_keys / "replica-0.key", trainer_keys)
        trainer, replica = run_both(
            ns.run(ns.trainer, ["bash", "-ec", trainer_cmd]),
            ns.run(ns.replica, ["bash", "-ec", replica_cmd]),
            env,
            cwd=(hosts[TRAINER_IP], hosts[REPLICA_IP]),
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
