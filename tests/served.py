"""A real `weightpull registry serve` process for tests: started on a free loopback port,
ready once it prints where it listens, its log kept in a file (a pipe could fill and
stall it)."""

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


def env(secret: bytes | None = SECRET, **extra: str) -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if k not in ("WEIGHTPULL_SECRET", "WEIGHTPULL_REGISTRY")}
    if secret is not None:
        out["WEIGHTPULL_SECRET"] = secret.decode()
    return {**out, **extra}


def cli(*args: str, secret: bytes | None = SECRET, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "weightpull", *args],
        env=env(secret),
        capture_output=True,
        text=True,
        timeout=timeout,
        **kw,
    )


class ServedRegistry:
    def __init__(self, log_dir: Path, *, secret: bytes | None = SECRET, bind: str = "tcp://127.0.0.1:0") -> None:
        self.log_dir, self.secret, self.bind = log_dir, secret, bind
        self.proc: subprocess.Popen | None = None
        self.address = self.epoch = ""
        self.starts = 0

    def start(self, timeout: float = 20.0) -> str:
        """Start (again, on the same address once it has one); return when it is ready."""
        bind = self.address or self.bind
        self.starts += 1
        self.log_path = self.log_dir / f"registry-{self.starts}.log"
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "weightpull", "registry", "serve", "--bind", bind],
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
