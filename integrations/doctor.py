"""`weightpull doctor`: what stands between this host and a working pull, one line per check
with the fix.

Each check is a small function returning a `Result` (its name, `ok`/`warn`/`fail`/`skip`,
what it found, and for a warning or a failure the fix). `run_checks` runs them at once,
each in a thread of its own with a time limit, so a hung driver or a dead registry costs
its limit and no more; the command exits 1 when any failed (a warning or a skip does not).

The transport check reads a buffer a NIXL agent serves, in a process of its own started
with `UCX_PROTO_INFO=y`, so that UCX's log says which transport its protocol picked for
the read (cma, tcp, rc_mlx5, cuda_ipc, ...). Between hosts, `weightpull doctor --listen`
on one serves the buffer (`listen`) and `weightpull doctor --peer HOST:PORT` on the other
reads it; without `--peer`, a listener process of this host serves it and another reads
it (two processes, as replicas and a trainer of one host are, so CMA can show up).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import errno
import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import attrs

from weightpull.errors import (
    AuthenticationError,
    InvalidArgumentError,
    RegistryUnavailableError,
    WeightpullError,
)

from .arguments import positive_seconds

OK, WARN, FAIL, SKIP = "ok", "warn", "fail", "skip"
CHECKS = ("keys", "registry", "transport", "ptrace", "shm", "gpus")
LISTEN_PORT = 5557  # `--listen`'s default port: the registry's default (5555) plus two
MiB, GiB = 1 << 20, 1 << 30
SHM_LOW = GiB  # below this, /dev/shm is worth a warning even with no model size given
TRANSPORT_LIMIT_S = 30.0  # two interpreters, two NIXL agents and a few reads: ~4 s here
CHECK_LIMIT_S = 10.0  # any other check
CLOCK_SPAN_S = 1.0  # between the registry's two clock samples
_NIXL_FIX = "pip install 'weightpull[nixl]'"


@attrs.frozen
class Result:
    """One check's outcome.

    Attributes:
        name: The check: keys, registry, transport, ptrace, shm or gpus.
        status: ok, warn, fail or skip.
        found: What it found, one sentence.
        fix: What to do about it ("" when there is nothing to do).
        data: Its figures, for `--json` (round trip ms, GB/s, free bytes, ...).
    """

    name: str
    status: str
    found: str
    fix: str = ""
    data: dict[str, Any] = attrs.Factory(dict)

    def line(self) -> str:
        label = "FAIL" if self.status == FAIL else self.status
        fix = f"; fix: {self.fix}" if self.fix and self.status in (WARN, FAIL, SKIP) else ""
        return f"{label:<4} {self.name:<9} {self.found}{fix}"

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


# -- keys and the registry ---------------------------------------------------------------


@attrs.frozen
class KeyChoice:
    """The key files a client would use, and where each was named."""

    key: str | None = None
    key_source: str = ""
    server_key: str | None = None
    server_key_source: str = ""

    @classmethod
    def of(cls, key: str | None = None, server_key: str | None = None) -> KeyChoice:
        """--key and --server-key, else $WEIGHTPULL_KEY and $WEIGHTPULL_SERVER_KEY."""
        from weightpull.drivers.zmq_registry.keys import KEY_ENV, SERVER_KEY_ENV

        def pick(given: str | None, flag: str, env: str) -> tuple[str | None, str]:
            if given:
                return given, flag
            if os.environ.get(env):
                return os.environ[env], f"${env}"
            return None, ""

        k, ks = pick(key, "--key", KEY_ENV)
        s, ss = pick(server_key, "--server-key", SERVER_KEY_ENV)
        return cls(k, ks, s, ss)


@attrs.frozen
class Probe:
    """What talking to a registry showed: its run and round trip, its clock against this
    host's, or the error that stopped it."""

    address: str
    run: str = ""
    rtt_ms: float | None = None
    rate: float | None = None  # its clock's seconds per second of this host's
    rate_error: float | None = None  # what the round trips leave unknown of the rate
    offset_s: float | None = None  # its wall clock minus this host's
    span_s: float = 0.0
    error: BaseException | None = None
    timeout: float = 0.0  # what it was given to answer


def registry_address(text: str) -> str:
    """`text` if it is a registry address (tcp://HOST:PORT, ipc://PATH, inproc://NAME or
    ray://NAME); else `InvalidArgumentError` saying how to write one."""
    scheme, sep, rest = text.partition("://")
    ok = bool(sep and rest)
    if ok and scheme == "tcp":
        host, colon, port = rest.rpartition(":")
        ok = bool(colon and host and port.isdigit() and 0 < int(port) <= 65535)
    elif ok:
        ok = scheme in ("ipc", "inproc", "ray")
    if not ok:
        raise InvalidArgumentError(
            f"{text!r} is not a registry address: write tcp://HOST:PORT (as `registry serve` "
            "prints), ipc://PATH or ray://NAME"
        )
    return text


def _load_cert(path: str, what: str) -> tuple[Any, str]:
    """(certificate, "") or (None, why it cannot be one)."""
    from weightpull.drivers.zmq_registry import keys

    try:
        return keys.load(path), ""
    except InvalidArgumentError as exc:
        return None, str(exc)


def check_keys(choice: KeyChoice, probe: Probe | None = None) -> Result:
    """The client's key: readable, a client's secret certificate, the server's public key
    beside it, and (with a probe of a registry) accepted by that server."""
    try:
        from weightpull.drivers.zmq_registry import keys
    except ImportError as exc:
        return Result(
            "keys", SKIP, f"the served registry's client cannot load ({exc})", "pip install 'weightpull[service]'"
        )
    refused = probe is not None and isinstance(probe.error, AuthenticationError)
    if choice.key is None:
        if refused:
            assert probe is not None
            return Result("keys", FAIL, f"no key (--key, $WEIGHTPULL_KEY): {probe.error}", _make_key_fix())
        if os.environ.get("WEIGHTPULL_SECRET"):
            return Result(
                "keys",
                WARN,
                "no key given (--key or $WEIGHTPULL_KEY): the client uses $WEIGHTPULL_SECRET, a shared secret "
                "that is deprecated and goes in a later release",
                _make_key_fix(),
            )
        return Result(
            "keys",
            SKIP,
            "no key given (--key or $WEIGHTPULL_KEY): the client speaks plainly, which only a "
            "`registry serve --insecure-dev` takes",
            _make_key_fix(),
        )
    where = f"{choice.key} (from {choice.key_source})"
    cert, why = _load_cert(choice.key, "key")
    if cert is None:
        fix = (
            "pass the NAME.key_secret file `weightpull keys new` wrote"
            if not os.path.exists(choice.key)
            else "pass a certificate `weightpull keys new` made (its NAME.key_secret)"
        )
        return Result("keys", FAIL, f"the key {where} is unusable: {why}", fix)
    if cert.secret is None:
        return Result(
            "keys",
            FAIL,
            f"{where} is a public key ({cert.role} {cert.name}): a client needs its secret half",
            f"pass {Path(choice.key).with_suffix(keys.SECRET_SUFFIX).name} (NAME.key_secret); the public "
            ".key goes in the server's --keys directory",
        )
    if cert.role == "server":
        return Result(
            "keys",
            FAIL,
            f"{where} is the server's own key (server {cert.name}), not a client's",
            "pass this client's NAME.key_secret (`weightpull keys new --role reader --name NAME`); the server's "
            "public .key is --server-key",
        )
    who = f"{cert.role} {cert.name}"
    data = {"key": choice.key, "source": choice.key_source, "principal": who}
    if choice.server_key is None:
        return Result(
            "keys",
            FAIL,
            f"{who}'s key {where} is readable, but no server key is given",
            "pass --server-key FILE (or set $WEIGHTPULL_SERVER_KEY): the public .key of the pair the server's "
            "`registry serve --server-key` names",
            data,
        )
    server, why = _load_cert(choice.server_key, "server key")
    if server is None or server.role != "server":
        named = why or f"it is the key of {server.role} {server.name}"
        return Result(
            "keys",
            FAIL,
            f"the server key {choice.server_key} (from {choice.server_key_source}) is unusable: {named}",
            "pass the public .key of the pair `registry serve --server-key` was given",
            data,
        )
    if probe is None:
        return Result("keys", OK, f"{who}, {where}; pass --registry to ask the server whether it knows it", data=data)
    if refused:
        message = str(probe.error)
        if "refused the key" in message:
            return Result(
                "keys",
                FAIL,
                f"{who}, {where} is unknown to the server at {probe.address}, or was revoked there",
                f"its operator adds {cert.name}{keys.PUBLIC_SUFFIX} to the server's --keys directory",
                data,
            )
        return Result("keys", FAIL, f"{who}, {where}: {message}", "", data)
    if probe.error is not None:
        return Result("keys", SKIP, f"{who}, {where}; not asked of the server: it did not answer", data=data)
    return Result("keys", OK, f"{who}, {where}, known to the server at {probe.address}", data=data)


def _make_key_fix() -> str:
    return (
        "`weightpull keys new --role reader --name NAME --dir keys/`, then pass --key keys/NAME.key_secret "
        "--server-key keys/SERVER.key"
    )


def probe_registry(address: str, choice: KeyChoice, *, timeout: float = 2.0, span: float = CLOCK_SPAN_S) -> Probe:
    """Ping the served registry at `address` three times: once to connect, once for the
    round trip, and once `span` seconds later, so that its replies' timestamps, set by its
    clock, give the rate of its clock against this host's. Uses the key if it is usable,
    else none (so a server that takes keys still shows it is there by refusing)."""
    from weightpull.drivers.zmq_registry.client import ZmqRegistry

    stamps: list[tuple[float, float, float, float]] = []  # (perf sent, perf back, wall mid, its ts)

    class Timed(ZmqRegistry):
        # Reads each reply's timestamp (the server's wall clock when it answered); the
        # client's calls return results alone.
        async def _exchange(self, req: Any, timeout: float) -> Any:
            sent, wall = time.perf_counter(), time.time()
            reply = await super()._exchange(req, timeout)
            if reply is not None:
                back = time.perf_counter()
                stamps.append((sent, back, wall + (back - sent) / 2, float(reply.ts)))
            return reply

    options: dict[str, Any] = {}
    if choice.key is not None and _usable_pair(choice):
        options = {"key": choice.key, "server_key": choice.server_key}
    elif choice.key is not None:
        options = {"secret": ""}  # the key is unusable (the keys line says why): try plainly, not $WEIGHTPULL_KEY
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # a $WEIGHTPULL_SECRET: the keys line says so
            reg = Timed(address, timeout=min(1.0, timeout), retry_for=timeout, heartbeat=None, **options)
    except WeightpullError as exc:
        return Probe(address, error=exc)

    async def samples() -> Probe:
        try:
            run = await reg.ping()
            await reg.ping()
            first = stamps[-1]
            await anyio.sleep(span)
            await reg.ping()
            last = stamps[-1]
        except WeightpullError as exc:
            return Probe(address, error=exc, timeout=timeout)
        finally:
            await reg.aclose()
        rtt = min(first[1] - first[0], last[1] - last[0])
        local = (last[0] + last[1]) / 2 - (first[0] + first[1]) / 2
        theirs = last[3] - first[3]
        return Probe(
            address,
            run=run,
            rtt_ms=rtt * 1e3,
            rate=theirs / local,
            rate_error=max(first[1] - first[0], last[1] - last[0]) / local,
            offset_s=last[3] - last[2],
            span_s=local,
        )

    return anyio.run(samples)


def _usable_pair(choice: KeyChoice) -> bool:
    if choice.server_key is None:
        return False
    cert, _ = _load_cert(choice.key or "", "key")
    server, _ = _load_cert(choice.server_key, "server key")
    return bool(cert and cert.secret and cert.role != "server" and server and server.role == "server")


def check_registry(address: str | None, probe: Probe | None) -> Result:
    """Whether the registry answers, its round trip, and its clock's rate against this host's."""
    if address is None:
        return Result("registry", SKIP, "no --registry (or $WEIGHTPULL_REGISTRY) given: nothing to reach")
    if address.startswith("ray://"):
        return Result(
            "registry",
            SKIP,
            f"{address} is an actor inside a Ray job, reachable only from that job's processes",
            "check it from the job: `await RayRegistry(address).ping()` after ray.init()",
        )
    if address.startswith("inproc://"):
        return Result("registry", SKIP, f"{address} lives inside one process: nothing to reach from here")
    if probe is None or probe.error is None and probe.rate is None:
        return Result("registry", FAIL, f"{address} was not probed", "report this as a bug")
    exc = probe.error
    if isinstance(exc, RegistryUnavailableError):
        return Result(
            "registry",
            FAIL,
            f"no answer from {address} within {probe.timeout:g} s",
            "is `weightpull registry serve` running there? Start it, or check the address, the port and the "
            "firewall between the hosts",
        )
    if isinstance(exc, AuthenticationError):
        return Result(
            "registry",
            WARN,
            f"{address} is there (it answered the handshake) but refused this client, so no round trip or "
            "clock was measured",
            "see the keys line",
        )
    if exc is not None:
        return Result("registry", FAIL, f"{address}: {type(exc).__name__}: {exc}", "see the message")
    assert probe.rate is not None and probe.rate_error is not None and probe.offset_s is not None
    data = {
        "address": address,
        "run": probe.run,
        "rtt_ms": round(probe.rtt_ms or 0.0, 3),
        "clock_rate": probe.rate,
        "clock_rate_error": probe.rate_error,
        "clock_offset_s": round(probe.offset_s, 4),
        "measured_over_s": round(probe.span_s, 3),
    }
    found = (
        f"{address} (run {probe.run}) answered in {probe.rtt_ms:.2f} ms; its clock runs {probe.rate:.5f} s per s "
        f"of this host's (+-{probe.rate_error:.5f}, two replies' timestamps {probe.span_s:.1f} s apart), "
        f"{probe.offset_s:+.3f} s from this host's"
    )
    if abs(probe.rate - 1) > max(0.01, 3 * probe.rate_error):
        return Result(
            "registry",
            WARN,
            found,
            "leases and liveness are judged on the registry's clock: check its host's time service "
            "(`chronyc tracking`, `timedatectl`)",
            data,
        )
    if abs(probe.offset_s) > 1.0:
        return Result(
            "registry",
            WARN,
            found,
            "sync both hosts' clocks (chrony or NTP): logs and the "
            "deprecated shared secret's 60 s window compare wall clocks",
            data,
        )
    return Result("registry", OK, found, data=data)


# -- ptrace, /dev/shm, GPUs ---------------------------------------------------------------

_CAP_SYS_PTRACE = 19
PTRACE_SCOPE = Path("/proc/sys/kernel/yama/ptrace_scope")
_PTRACE_FIX = (
    "`sudo sysctl -w kernel.yama.ptrace_scope=1` (0 also works; persist it in /etc/sysctl.d/), or grant "
    "CAP_SYS_PTRACE (`docker run --cap-add SYS_PTRACE`)"
)


def _cap_sys_ptrace() -> bool | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> _CAP_SYS_PTRACE & 1)
    except (OSError, ValueError):
        pass
    return None


def _process_vm_readv_works() -> tuple[bool, str]:
    """Whether process_vm_readv (CMA's call) is allowed at all: read 8 bytes of this
    process. A seccomp profile (Docker's default without SYS_PTRACE) refuses it."""
    if not sys.platform.startswith("linux"):
        return False, "not Linux"

    class IoVec(ctypes.Structure):
        _fields_ = (("base", ctypes.c_void_p), ("len", ctypes.c_size_t))

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        call = libc.process_vm_readv
    except (OSError, AttributeError) as exc:
        return False, f"libc has no process_vm_readv ({exc})"
    src, dst = ctypes.create_string_buffer(b"weightpu"), ctypes.create_string_buffer(8)
    local = IoVec(ctypes.cast(dst, ctypes.c_void_p), 8)
    remote = IoVec(ctypes.cast(src, ctypes.c_void_p), 8)
    call.restype = ctypes.c_ssize_t
    got = call(os.getpid(), ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
    if got == 8 and dst.raw == src.raw[:8]:
        return True, ""
    return False, os.strerror(ctypes.get_errno() or errno.EPERM)


def check_ptrace(scope_file: Path = PTRACE_SCOPE) -> Result:
    """Whether UCX's CMA transport (process_vm_readv, gated by ptrace rules) can serve
    reads between this host's processes: Yama's ptrace_scope, CAP_SYS_PTRACE, and a try."""
    cap = _cap_sys_ptrace()
    capped = "with CAP_SYS_PTRACE" if cap else "without CAP_SYS_PTRACE" if cap is False else "CAP_SYS_PTRACE unknown"
    try:
        scope: int | None = int(scope_file.read_text().strip())
    except FileNotFoundError:
        scope = None
    except (OSError, ValueError) as exc:
        return Result("ptrace", WARN, f"cannot read {scope_file}: {exc}", "check it by hand: " + _PTRACE_FIX)
    works, why = _process_vm_readv_works()
    data = {"ptrace_scope": scope, "cap_sys_ptrace": cap, "process_vm_readv": works}
    named = f"ptrace_scope {scope}" if scope is not None else "no Yama (no ptrace_scope)"
    if not works:
        return Result(
            "ptrace",
            WARN,
            f"process_vm_readv is refused here ({why}; {named}, {capped}): UCX turns CMA off, and same-host "
            "reads go over TCP or shared-memory copies, several times slower",
            "a seccomp profile blocks it: `docker run --cap-add SYS_PTRACE` (or a profile allowing process_vm_readv)",
            data,
        )
    other = "readers in another container (pid namespace) or as another user cannot use it: run them in one"
    if scope in (None, 0):
        found = f"{named}, {capped}: CMA reads between this host's processes of one user work ({other})"
        return Result("ptrace", OK, found, data=data)
    if scope == 1:
        found = (
            f"{named}, {capped}: CMA works, as UCX lets any process of this user read (prctl "
            f"PR_SET_PTRACER_ANY) ({other})"
        )
        return Result("ptrace", OK, found, data=data)
    if scope == 2 and cap:
        return Result("ptrace", OK, f"{named}, {capped}: CMA works for this process's reads", data=data)
    fix = _PTRACE_FIX if scope == 2 else "ptrace_scope 3 holds until a reboot: boot with it at 1 (/etc/sysctl.d/)"
    return Result(
        "ptrace",
        WARN,
        f"{named}, {capped}: UCX turns CMA off, and same-host reads go over TCP or shared-memory copies, "
        "several times slower",
        fix,
        data,
    )


def check_shm(model_bytes: int | None = None, path: str = "/dev/shm") -> Result:
    """Free space in /dev/shm against a model mirror's bytes (host slots of the cuda_ipc
    driver, and whatever else maps shared memory there)."""
    try:
        st = os.statvfs(path)
    except OSError as exc:
        return Result("shm", WARN, f"{path}: {exc.strerror}", f"mount a tmpfs at {path}")
    free, size = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    data = {"path": path, "free_bytes": free, "size_bytes": size, "model_bytes": model_bytes}
    found = f"{path}: {_gib(free)} free of {_gib(size)}"
    fix = (
        f"grow it: `sudo mount -o remount,size=64G {path}`, or `docker run --shm-size=64g` "
        "(Docker gives containers 64 MiB)"
    )
    if model_bytes is not None:
        found += f"; a mirror of {_gib(model_bytes)} needs as much"
        return Result("shm", OK if free >= model_bytes else FAIL, found, fix if free < model_bytes else "", data)
    if free < SHM_LOW:
        return Result("shm", WARN, found + f" (under {_gib(SHM_LOW)}: too little for a model's host slot)", fix, data)
    return Result("shm", OK, found + " (--model-bytes N checks a model's size)", data=data)


def _gib(n: int) -> str:
    return f"{n / GiB:.1f} GiB" if n >= GiB else f"{n / MiB:.0f} MiB"


def _no_nvidia() -> bool:
    """True when this host shows no NVIDIA driver: no need to import torch to know."""
    return not (Path("/proc/driver/nvidia").exists() or Path("/dev/nvidiactl").exists())


def check_gpus(torch: Any = None) -> Result:
    """The GPUs torch sees, and whether each pair can reach the other's memory directly
    (peer access), which CUDA IPC reads between them use."""
    if torch is None:
        if "torch" not in sys.modules and importlib.util.find_spec("torch") is None:
            return Result("gpus", SKIP, "torch is not installed: no GPU check", "pip install 'weightpull[torch]'")
        if "torch" not in sys.modules and _no_nvidia():
            return Result("gpus", SKIP, "no NVIDIA driver on this host (no /proc/driver/nvidia): no GPUs to check")
        import torch
    if not torch.cuda.is_available():
        return Result("gpus", SKIP, "torch sees no CUDA device (a CPU build, or none visible)")
    count = int(torch.cuda.device_count())
    pairs = [(i, j) for i in range(count) for j in range(count) if i != j]
    denied = [(i, j) for i, j in pairs if not torch.cuda.can_device_access_peer(i, j)]
    data = {"count": count, "no_peer_access": [list(p) for p in denied]}
    if count < 2:
        return Result("gpus", OK, f"{count} GPU: no pairs to check", data=data)
    if denied:
        shown = ", ".join(f"{i}->{j}" for i, j in denied[:8]) + (" ..." if len(denied) > 8 else "")
        return Result(
            "gpus",
            WARN,
            f"{count} GPUs; no peer access for {len(denied)} of {len(pairs)} pairs ({shown}): CUDA IPC reads "
            "between them are staged through host memory",
            "check `nvidia-smi topo -m` (and the BIOS' IOMMU/ACS settings); keep a replica's GPUs on one "
            "NVLink or PCIe switch",
            data,
        )
    return Result("gpus", OK, f"{count} GPUs, every pair with peer access ({len(pairs)} pairs)", data=data)


# -- transport ------------------------------------------------------------------------------


def peer_address(text: str, default_host: str = "") -> tuple[str, int]:
    """(host, port) of HOST:PORT, HOST or :PORT; else `InvalidArgumentError`."""
    host, colon, port = text.rpartition(":")
    if not colon:
        host, port = text, str(LISTEN_PORT)
    host = host.strip("[]") or default_host
    if not host or not port.isdigit() or int(port) > 65535:
        raise InvalidArgumentError(f"{text!r} is not HOST:PORT (as in 10.0.0.2:{LISTEN_PORT})")
    return host, int(port)


# UCX's names of its transports, as its protocol tables show them, and what they are.
_KINDS = (
    ("cma", "CMA"),
    ("tcp", "TCP"),
    ("rc", "RDMA (rc)"),
    ("dc", "RDMA (dc)"),
    ("ud", "RDMA (ud)"),
    ("srd", "RDMA (EFA srd)"),
    ("cuda_ipc", "CUDA IPC"),
    ("cuda_copy", "CUDA copy (through host memory)"),
    ("gdr_copy", "GDRCopy"),
    ("posix", "shared memory (posix)"),
    ("sysv", "shared memory (sysv)"),
    ("xpmem", "shared memory (xpmem)"),
    ("knem", "shared memory (knem)"),
    ("self", "self (one process)"),
)


def kind_of(config: str) -> str:
    """What a UCX transport of a protocol table is: 'rc_mlx5/mlx5_0:1' -> 'RDMA (rc)'."""
    name = config.split("/", 1)[0]
    for prefix, kind in _KINDS:
        if name == prefix or name.startswith(prefix + "_") and prefix not in ("cuda", "gdr"):
            return kind
    return name


def read_transports(log: str) -> list[dict[str, str]]:
    """The transports UCX's protocol tables (`UCX_PROTO_INFO=y`) name for remote memory
    reads (ucp_get, which NIXL's READ is), each once: [{"config", "kind", "scope"}]. A
    table of an agent's own loopback endpoint ("self cfg") is left out."""
    out: list[dict[str, str]] = []
    scope, reading = "", False
    for raw in log.splitlines():
        cell = raw.split("]", 2)[-1].strip() if raw.startswith("[") else raw.strip()
        if not cell.startswith("|"):
            continue
        cells = [c.strip() for c in cell.strip("|").split("|")]
        if len(cells) == 1:
            if " cfg#" in cells[0]:
                scope = cells[0].rsplit(" cfg#", 1)[0].split()[-1]  # intra-node, inter-node or self
            else:
                reading = cells[0].startswith("remote memory read") and scope != "self"
            continue
        if reading and cells[-1] not in ("Config", ""):
            for config in re.findall(r"[a-z][a-z0-9_]*/[\w.:\-]+", cells[-1]):
                row = {"config": config, "kind": kind_of(config), "scope": scope}
                if row not in out:
                    out.append(row)
    return out


def _allocate(transport: Any, nbytes: int, device: str) -> Any:
    try:
        return transport.allocate(nbytes, device)
    except WeightpullError:
        raise
    except Exception as exc:  # torch's, for a device this host lacks
        raise InvalidArgumentError(
            f"cannot allocate {nbytes} bytes of {device} memory ({type(exc).__name__}: {exc}): --device cuda needs "
            "torch with CUDA and a GPU on this host; leave --device out to read host memory"
        ) from None


def _fill(region: Any, device: str) -> int:
    """Fill the region with a pattern; its CRC-32."""
    block = os.urandom(4096)
    pattern = block * (region.nbytes // len(block)) + block[: region.nbytes % len(block)]
    if device == "cpu":
        region.view[:] = pattern
    else:
        import torch

        region.memory.copy_(torch.frombuffer(bytearray(pattern), dtype=torch.uint8))
    return zlib.crc32(pattern)


def _crc(region: Any, device: str) -> int:
    if device == "cpu":
        return zlib.crc32(region.view)
    return zlib.crc32(region.memory.cpu().numpy().tobytes())


async def listen(
    bind: str,
    *,
    nbytes: int = 64 * MiB,
    device: str = "cpu",
    serve_for: float = 120.0,
    once: bool = False,
    ready: Callable[[dict[str, Any]], None] = lambda event: None,
    served: Callable[[dict[str, Any]], None] = lambda event: None,
) -> None:
    """Serve `nbytes` of `device` memory from a NIXL agent to `weightpull doctor --peer`
    readers for `serve_for` seconds (after the first reader's report, with `once`): each
    connection to `bind` (HOST:PORT) gets the buffer's descriptor and its CRC-32 as one
    JSON line, and answers with its result, passed to `served`."""
    from anyio.streams.buffered import BufferedByteReceiveStream

    from weightpull.transports import create_transport

    host, port = peer_address(bind, "0.0.0.0")
    transport: Any = create_transport("nixl")
    region = _allocate(transport, nbytes, device)
    crc = _fill(region, device)
    hello = {
        "descriptor": transport.export(region).decode(),
        "nbytes": nbytes,
        "crc32": crc,
        "host": socket.gethostname(),
        "device": device,
    }
    try:
        listener = await anyio.create_tcp_listener(local_host=host, local_port=port, reuse_port=False)
    except OSError as exc:
        raise InvalidArgumentError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    bound = listener.extra(anyio.abc.SocketAttribute.local_port)
    async with listener, anyio.create_task_group() as tg:

        async def one(stream: anyio.abc.SocketStream) -> None:
            async with stream:
                who = str(stream.extra(anyio.abc.SocketAttribute.remote_address)[0])
                await stream.send((json.dumps(hello) + "\n").encode())
                try:
                    with anyio.fail_after(TRANSPORT_LIMIT_S):
                        line = await BufferedByteReceiveStream(stream).receive_until(b"\n", 1 << 16)
                    report = json.loads(line)
                except (TimeoutError, anyio.EndOfStream, anyio.IncompleteRead, ValueError) as exc:
                    report = {"ok": False, "error": f"the reader left without a report ({type(exc).__name__})"}
                served({"reader": who, **report})
            if once:
                tg.cancel_scope.cancel()

        tg.start_soon(listener.serve, one)
        tg.start_soon(transport.serve)
        ready(
            {
                "listening": f"{host}:{bound}",
                "agent": transport.agent_name,
                "nbytes": nbytes,
                "device": device,
                "serve_for": serve_for,
            }
        )
        await anyio.sleep(serve_for)
        tg.cancel_scope.cancel()
    transport.deregister(region)
    await transport.aclose()


def read_peer(host: str, port: int, *, device: str = "cpu", reads: int = 3, timeout: float = 5.0) -> dict[str, Any]:
    """Read the buffer a listener at host:port serves: once to wire up, then `reads` times
    timed; its figures, with the transports UCX's log named if it was asked to log them
    (`UCX_PROTO_INFO=y`, `UCX_LOG_FILE`). Meant for a process of its own."""
    try:
        conn = socket.create_connection((host, port), timeout=timeout)
    except OSError as exc:
        return {"ok": False, "stage": "connect", "error": f"cannot reach {host}:{port}: {exc.strerror or exc}"}
    with conn:
        conn.settimeout(TRANSPORT_LIMIT_S)
        try:
            hello = json.loads(conn.makefile("rb").readline())
        except (OSError, ValueError) as exc:
            return {"ok": False, "stage": "hello", "error": f"{host}:{port} is not a doctor listener ({exc})"}
        try:
            result = anyio.run(_read, hello, device, reads)
        except WeightpullError as exc:
            result = {"ok": False, "stage": "read", "error": f"{type(exc).__name__}: {exc}"}
        result["transports"] = read_transports(_ucx_log())
        result["peer_host"] = hello.get("host", "")
        result["ucx_tls"] = os.environ.get("UCX_TLS", "")
        with contextlib.suppress(OSError):
            conn.sendall((json.dumps({**result, "host": socket.gethostname()}) + "\n").encode())
    return result


async def _read(hello: dict[str, Any], device: str, reads: int) -> dict[str, Any]:
    from weightpull.transports import create_transport

    transport: Any = create_transport("nixl")
    remote = transport.connect(str(hello["descriptor"]).encode())
    nbytes = int(hello["nbytes"])
    local = _allocate(transport, nbytes, device)
    started = time.perf_counter()
    await transport.read(remote, 0, local, 0, nbytes)
    first = time.perf_counter() - started
    times = []
    for _ in range(reads):
        started = time.perf_counter()
        await transport.read(remote, 0, local, 0, nbytes)
        times.append(time.perf_counter() - started)
    intact = _crc(local, device) == int(hello["crc32"])
    transport.disconnect(remote)
    await transport.aclose()
    best = min(times)
    return {
        "ok": intact,
        "nbytes": nbytes,
        "first_s": first,
        "gbps": nbytes / best / 1e9,
        "reads": reads,
        "intact": intact,
    }


def _ucx_log() -> str:
    path = os.environ.get("UCX_LOG_FILE", "")
    if not path or path in ("stdout", "stderr"):
        return ""
    path = path.replace("%p", str(os.getpid()))
    with contextlib.suppress(OSError, AttributeError):  # UCX's log is a stdio stream: flush it first
        ctypes.CDLL(None).fflush(None)
    with contextlib.suppress(OSError):
        return Path(path).read_text(errors="replace")
    return ""


def _python(*args: str) -> list[str]:
    return [sys.executable, "-m", "weightpull.integrations.doctor", *args]


def check_transport(
    peer: str | None = None,
    *,
    nbytes: int = 64 * MiB,
    device: str = "cpu",
    timeout: float = 5.0,
    limit: float = TRANSPORT_LIMIT_S,
) -> Result:
    """Read a NIXL agent's buffer from a process of its own: the peer's (`peer`,
    HOST:PORT of a `weightpull doctor --listen`), else a listener's of this host (a
    loopback between two processes); which transport UCX picked, and the GB/s."""
    try:
        from weightpull.transports import transport_class

        transport_class("nixl")
    except WeightpullError as exc:
        return Result("transport", SKIP, f"NIXL cannot load here ({exc})", _NIXL_FIX)
    deadline = time.monotonic() + limit
    with tempfile.TemporaryDirectory(prefix="weightpull-doctor-") as tmp:
        listener: subprocess.Popen[str] | None = None
        try:
            if peer is None:
                errors = Path(tmp) / "listener.err"
                with open(errors, "w") as err:
                    listener = subprocess.Popen(
                        _python("listen", "127.0.0.1:0", str(nbytes), device, str(limit)),
                        stdout=subprocess.PIPE,
                        stderr=err,
                        text=True,
                    )
                ready = _line_within(listener, deadline)
                if ready is None:
                    tail = (errors.read_text(errors="replace").strip().splitlines() or [""])[-1]
                    fix = "" if "cannot allocate" in tail else "report it, with the message"
                    return Result(
                        "transport", FAIL, f"the loopback listener did not start: {tail or 'no message'}", fix
                    )
                peer = str(json.loads(ready)["listening"])
            host, port = peer_address(peer)
            env = {
                **os.environ,
                "UCX_PROTO_INFO": "y",
                "UCX_LOG_FILE": str(Path(tmp) / "ucx.%p.log"),
                "NIXL_LOG_LEVEL": os.environ.get("NIXL_LOG_LEVEL", "WARN"),
            }
            try:
                done = subprocess.run(
                    _python("read", f"{host}:{port}", device, str(timeout)),
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=max(1.0, deadline - time.monotonic()),
                )
            except subprocess.TimeoutExpired:
                return Result(
                    "transport",
                    FAIL,
                    f"the read from {peer} did not finish within {limit:g} s",
                    "is the listener's host reachable on UCX's ports too (not only the listener's)? Try UCX_TLS=tcp",
                )
            lines = done.stdout.strip().splitlines()
            try:
                result = json.loads(lines[-1])
            except (IndexError, ValueError):
                tail = " ".join(done.stderr.strip().splitlines()[-2:])
                return Result("transport", FAIL, f"the reader process failed (exit {done.returncode}): {tail}", "")
        finally:
            if listener is not None:
                listener.kill()
                listener.wait()
    return verdict(result, loopback=listener is not None, peer=peer)


def _line_within(proc: subprocess.Popen[str], deadline: float) -> str | None:
    """The process's first line of stdout, or None if none came by `deadline`."""
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(proc.stdout.readline() if proc.stdout else ""), daemon=True)
    reader.start()
    reader.join(max(0.0, deadline - time.monotonic()))
    return got[0] if got and got[0] else None


def verdict(result: dict[str, Any], *, loopback: bool, peer: str, where: str = "") -> Result:
    """A reader's result as the transport check's line (`where`: what the line calls the read)."""
    named = f" ({result['peer_host']})" if result.get("peer_host") else ""
    where = where or ("loopback (two processes of this host)" if loopback else f"to {peer}{named}")
    if not result.get("ok"):
        if result.get("stage") == "connect":
            return Result(
                "transport",
                FAIL,
                f"{where}: {result.get('error')}",
                f"run `weightpull doctor --listen 0.0.0.0:{peer_address(peer)[1]}` on that host first, and open "
                "that port",
            )
        if result.get("intact") is False:
            return Result("transport", FAIL, f"{where}: the bytes read differ from the buffer's", "report it", result)
        return Result("transport", FAIL, f"{where}: {result.get('error')}", "run with -v for UCX's log", result)
    kinds = list(dict.fromkeys(t["kind"] for t in result["transports"]))
    configs = ", ".join(t["config"] for t in result["transports"])
    size = _gib(int(result["nbytes"]))
    figures = (
        f"{result['gbps']:.2f} GB/s (best of {result['reads']} reads of {size}; the first, wiring up, "
        f"took {result['first_s']:.2f} s)"
    )
    if not kinds:
        found = f"{where}: {figures}; UCX did not name its transport (a UCX without UCX_PROTO_INFO)"
        return Result("transport", OK, found, data=result)
    found = f"{where}: {' + '.join(kinds)} ({configs}), {figures}"
    same_host = loopback or all(t["scope"] == "intra-node" for t in result["transports"])
    if kinds == ["TCP"] and same_host:
        return Result(
            "transport",
            WARN,
            found,
            "a read of this host went over TCP, so CMA is off: see the ptrace line (or UCX_TLS leaves cma out)",
            result,
        )
    if kinds == ["TCP"]:
        return Result(
            "transport",
            WARN,
            found,
            "UCX found no RDMA device: check `ibv_devices`, that the container sees /dev/infiniband, and "
            "UCX_TLS / UCX_NET_DEVICES",
            result,
        )
    return Result("transport", OK, found, data=result)


# -- running them ------------------------------------------------------------------------------


def bounded(name: str, check: Callable[[], Result], limit: float) -> Callable[[], Result]:
    """`check`, run in a thread of its own, given up on after `limit` seconds."""

    def run() -> Result:
        out: list[Result] = []

        def target() -> None:
            try:
                out.append(check())
            except Exception as exc:  # a check's bug: its line says so, the others still run
                out.append(Result(name, FAIL, f"the check failed: {type(exc).__name__}: {exc}", "report it"))

        thread = threading.Thread(target=target, name=f"doctor-{name}", daemon=True)
        thread.start()
        thread.join(limit)
        if not out:
            return Result(name, FAIL, f"did not finish within {limit:g} s", "run with -v to see where it waits")
        return out[0]

    return run


def run_checks(
    *,
    registry: str | None = None,
    key: str | None = None,
    server_key: str | None = None,
    peer: str | None = None,
    model_bytes: int | None = None,
    read_bytes: int = 64 * MiB,
    device: str = "cpu",
    timeout: float = 2.0,
    skip: Sequence[str] = (),
) -> list[Result]:
    """Every check but those in `skip`, at once, in the order of `CHECKS`.

    Args:
        registry: The registry's address (else $WEIGHTPULL_REGISTRY); None: not checked.
        key: The client's secret certificate (else $WEIGHTPULL_KEY).
        server_key: The server's public certificate (else $WEIGHTPULL_SERVER_KEY).
        peer: HOST:PORT of a `weightpull doctor --listen`; None: a loopback read.
        model_bytes: A model mirror's bytes, which /dev/shm must hold.
        read_bytes: The buffer a loopback listener serves.
        device: The reader's (and a loopback listener's) memory: cpu or cuda[:N].
        timeout: Seconds the registry and the peer have to answer.
        skip: Checks not to run.

    Raises:
        InvalidArgumentError: A malformed registry or peer address.
    """
    from weightpull.registry import REGISTRY_ENV

    registry = registry or os.environ.get(REGISTRY_ENV) or None
    if registry is not None:
        registry_address(registry)
    if peer is not None:
        peer_address(peer)
    try:
        choice = KeyChoice.of(key, server_key)
    except ImportError:
        choice = KeyChoice(key, "--key" if key else "", server_key, "--server-key" if server_key else "")
    served = registry is not None and registry.startswith(("tcp://", "ipc://"))
    wanted = [c for c in CHECKS if c not in skip]
    probe: list[Probe] = []

    def registry_check() -> Result:
        if served and ("registry" in wanted or "keys" in wanted):
            try:
                probe.append(probe_registry(str(registry), choice, timeout=timeout))
            except ImportError as exc:
                probe.append(Probe(str(registry), error=exc))
        return check_registry(registry, probe[0] if probe else None)

    checks: dict[str, tuple[Callable[[], Result], float]] = {
        "registry": (registry_check, timeout * 2 + CLOCK_SPAN_S + 5),
        "transport": (
            lambda: check_transport(peer, nbytes=read_bytes, device=device, timeout=timeout),
            TRANSPORT_LIMIT_S + 5,
        ),
        "ptrace": (check_ptrace, CHECK_LIMIT_S),
        "shm": (lambda: check_shm(model_bytes), CHECK_LIMIT_S),
        "gpus": (check_gpus, CHECK_LIMIT_S * 3),  # importing torch takes seconds
    }
    results: dict[str, Result] = {}

    def run_one(name: str) -> None:
        check, limit = checks[name]
        results[name] = bounded(name, check, limit)()

    # The registry first, as the keys check reads what it found.
    threads = [
        threading.Thread(target=run_one, args=(n,), daemon=True)
        for n in checks
        if n in wanted or (n == "registry" and "keys" in wanted)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if "keys" in wanted:
        asked = probe[0] if probe and not isinstance(probe[0].error, ImportError) else None
        results["keys"] = check_keys(choice, asked)
    return [results[name] for name in CHECKS if name in wanted]


# -- the command ---------------------------------------------------------------------------------


def _nbytes(text: str) -> int:
    """An argparse type: a byte count, as digits or with a suffix (64M, 16G, 1.5T)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*", text.lower())
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: write bytes, or 64M, 16G, 1T")
    unit = (match.group(2) or "b")[0]
    return int(float(match.group(1)) * {"b": 1, "k": 1 << 10, "m": MiB, "g": GiB, "t": 1 << 40}[unit])


def _arg(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    def typed(text: str) -> Any:
        try:
            return parse(text)
        except InvalidArgumentError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    typed.__name__ = parse.__name__
    return typed


def _device(text: str) -> str:
    if not re.fullmatch(r"cpu|cuda(:\d+)?", text):
        raise argparse.ArgumentTypeError(f"{text!r} is not cpu, cuda or cuda:N")
    return text


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "doctor",
        help="check this host: keys, the registry and its clock, the transport to a peer, ptrace, /dev/shm, GPUs",
        description="One line per check, each with the fix: the client's key (readable, a client's secret "
        "certificate, known to the server), the registry (reachable, its round trip, its clock's rate against "
        "this host's), the transport NIXL's UCX picks for a read (CMA, TCP, RDMA, CUDA IPC) and its GB/s "
        "(from --peer, else between two processes of this host), ptrace permission for CMA, /dev/shm space, "
        "GPU peer access. Exits 1 if a check failed (a warning or a skip does not). Between two hosts: "
        f"`weightpull doctor --listen` on one (it serves a buffer on port {LISTEN_PORT}), `weightpull doctor "
        "--peer HOST` on the other (docs/guides/troubleshooting.md).",
    )
    p.add_argument(
        "--registry",
        type=_arg(registry_address),
        help="the registry to reach, tcp://HOST:PORT (default: $WEIGHTPULL_REGISTRY, else none checked)",
    )
    p.add_argument("--key", metavar="FILE", help="this client's secret certificate (default: $WEIGHTPULL_KEY)")
    p.add_argument(
        "--server-key", metavar="FILE", help="the server's public certificate (default: $WEIGHTPULL_SERVER_KEY)"
    )
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--peer",
        type=_arg(lambda text: peer_address(text) and text),
        metavar="HOST[:PORT]",
        help=f"read from the `weightpull doctor --listen` there (port {LISTEN_PORT} unless named) (default: a "
        "loopback read between two processes of this host)",
    )
    where.add_argument(
        "--listen",
        nargs="?",
        const=f"0.0.0.0:{LISTEN_PORT}",
        type=_arg(lambda text: peer_address(text, "0.0.0.0") and text),
        metavar="HOST:PORT",
        help=f"run no checks: serve a buffer from a NIXL agent to `--peer` readers for --serve-for seconds "
        f"(default address: 0.0.0.0:{LISTEN_PORT})",
    )
    p.add_argument(
        "--serve-for", type=positive_seconds, default=120.0, metavar="SECONDS", help="with --listen (default: 120)"
    )
    p.add_argument(
        "--read-size", type=_nbytes, default=64 * MiB, metavar="BYTES", help="the buffer --listen serves (default: 64M)"
    )
    p.add_argument(
        "--device",
        type=_device,
        default="cpu",
        help="the buffers' memory, cpu or cuda[:N] (CUDA IPC shows for GPU memory)",
    )
    p.add_argument(
        "--model-bytes",
        type=_nbytes,
        metavar="BYTES",
        help="a model mirror's size (16G, 1T): /dev/shm must hold it (default: warn under 1 GiB free)",
    )
    p.add_argument(
        "--timeout",
        type=positive_seconds,
        default=2.0,
        help="seconds the registry and the peer have to answer (default: 2)",
    )
    p.add_argument("--skip", action="append", choices=CHECKS, default=[], help="leave a check out (repeatable)")
    p.add_argument("--json", action="store_true", help="print a JSON list of the checks, the last line of stdout")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.listen:
        return _listen(args)
    results = run_checks(
        registry=args.registry,
        key=args.key,
        server_key=args.server_key,
        peer=args.peer,
        model_bytes=args.model_bytes,
        read_bytes=args.read_size,
        device=args.device,
        timeout=args.timeout,
        skip=args.skip,
    )
    if args.json:
        print(json.dumps([r.to_dict() for r in results]))
    else:
        for r in results:
            print(r.line())
    return 1 if any(r.status == FAIL for r in results) else 0


def _listen(args: argparse.Namespace) -> int:
    def ready(event: dict[str, Any]) -> None:
        if args.json:
            print(json.dumps(event), flush=True)
            return
        host, port = peer_address(event["listening"])
        shown = socket.gethostname() if host in ("0.0.0.0", "::") else host
        print(
            f"listening on {event['listening']}: NIXL agent {event['agent']} serves {_gib(event['nbytes'])} of "
            f"{event['device']} memory for {event['serve_for']:g} s; on the other host run: "
            f"weightpull doctor --peer {shown}:{port}",
            flush=True,
        )

    def served(event: dict[str, Any]) -> None:
        if args.json:
            print(json.dumps(event), flush=True)
            return
        who = f"read by {event['reader']}" + (f" ({event['host']})" if event.get("host") else "")
        print(verdict(event, loopback=False, peer=event["reader"], where=who).line(), flush=True)

    with contextlib.suppress(KeyboardInterrupt):
        anyio.run(
            lambda: listen(
                args.listen,
                nbytes=args.read_size,
                device=args.device,
                serve_for=args.serve_for,
                ready=ready,
                served=served,
            )
        )
    return 0


def _child(argv: list[str]) -> int:
    """The processes `check_transport` starts: `listen ADDR NBYTES DEVICE SECONDS` (prints
    its ready line, serves one reader) and `read HOST:PORT DEVICE TIMEOUT` (prints its
    result as the last line)."""
    try:
        return _child_run(argv)
    except WeightpullError as exc:  # its last line of stderr is what the check's line shows
        sys.stderr.write(f"error: {' '.join(str(exc).split())}\n")
        return 1


def _child_run(argv: list[str]) -> int:
    if argv[0] == "listen":
        bind, nbytes, device, seconds = argv[1], int(argv[2]), argv[3], float(argv[4])
        anyio.run(
            lambda: listen(
                bind,
                nbytes=nbytes,
                device=device,
                serve_for=seconds,
                once=True,
                ready=lambda event: print(json.dumps(event), flush=True),
            )
        )
        return 0
    host, port = peer_address(argv[1])
    print(json.dumps(read_peer(host, port, device=argv[2], timeout=float(argv[3]))), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(_child(sys.argv[1:]))
