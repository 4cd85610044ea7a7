"""A real `weightpull registry serve` process for tests: started on a free loopback port,
ready once it prints where it listens, its log kept in a file (a pipe could fill and
stall it). It serves with the deprecated shared secret by default (what most tests of
other things need: every client an admin), with keys when given a keys directory
(`make_keys` fills one), or in --insecure-dev mode with neither."""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
from pathlib import Path

SECRET = b"test-secret-of-the-served-registry"
READY = re.compile(r"listening on (\S+) \(run (\w+)\)")


CLEARED = ("WEIGHTPULL_SECRET", "WEIGHTPULL_REGISTRY", "WEIGHTPULL_KEY", "WEIGHTPULL_SERVER_KEY")


def make_keys(directory: Path, *principals: tuple[str, str]) -> Path:
    """A keys directory holding the server's pair (`registry`) and one per (role, name)."""
    from weightpull.drivers.zmq_registry import keys

    keys.new(directory, "server", "registry")
    for role, name in principals:
        keys.new(directory, role, name)
    return directory


def env(secret: bytes | None = SECRET, **extra: str) -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if k not in CLEARED}
    if secret is not None:
        out["WEIGHTPULL_SECRET"] = secret.decode()
    return {**out, **extra}


def cli(
    *args: str, secret: bytes | None = SECRET, timeout: float = 120, extra_env: dict[str, str] | None = None, **kw
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "weightpull", *args],
        env=env(secret, **(extra_env or {})),
        capture_output=True,
        text=True,
        timeout=timeout,
        **kw,
    )


class ServedRegistry:
    def __init__(
        self,
        log_dir: Path,
        *,
        secret: bytes | None = SECRET,
        bind: str = "tcp://127.0.0.1:0",
        keys: Path | None = None,
        args: tuple[str, ...] = (),
    ) -> None:
        self.log_dir, self.bind, self.keys, self.args = log_dir, bind, keys, args
        self.secret = None if keys is not None else secret
        self.proc: subprocess.Popen | None = None
        self.address = self.epoch = ""
        self.starts = 0

    def start(self, timeout: float = 20.0) -> str:
        """Start (again, on the same address once it has one); return when it is ready."""
        bind = self.address or self.bind
        self.starts += 1
        self.log_path = self.log_dir / f"registry-{self.starts}.log"
        if self.keys is not None:
            mode = ["--keys", str(self.keys), "--server-key", str(self.keys / "registry.key_secret")]
        else:
            mode = [] if self.secret is not None else ["--insecure-dev"]
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "weightpull", "registry", "serve", "--bind", bind, *mode, *self.args],
                env=env(self.secret),
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
            )
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        match = READY.search(line)
        if match is None:
            self.proc.kill()
            raise AssertionError(f"registry did not start: {line!r}\n{self.log()}")
        self.address, self.epoch = match.groups()
        return self.address

    def key(self, name: str) -> dict[str, str]:
        """The client options of the principal `name`: its key and the server's."""
        assert self.keys is not None
        return {"key": str(self.keys / f"{name}.key_secret"), "server_key": str(self.keys / "registry.key")}

    def log(self) -> str:
        return "".join(p.read_text() for p in sorted(self.log_dir.glob("registry-*.log")))

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def send_signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def stop(self, sig: int = signal.SIGTERM) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        rc = self.proc.wait(10)
        self.proc.stdout.close()
        return rc
