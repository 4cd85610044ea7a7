"""Fan-out across emulated hosts: the time until N replicas serve one version.

The trainer (a streaming `Publisher` over NIXL) runs in host 0's namespace; each replica
(a `Puller`) in a host of its own; every data link is shaped (`hosts.Hosts`), and NIXL
runs over TCP (`UCX_TLS=tcp`), so every byte a replica reads crosses its source's link and
its own. They all speak to one registry, the real server (`weightpull registry serve`,
keyed: each process its own principal), in the switch's namespace on the hosts' unshaped
control network: its few small messages (leases, offers, marks) do not queue behind the
shaped bulk bytes, as a cluster's front-end network carries them beside its data fabric.

Before each step the trainer publishes a version of its own (its relays' offers of the
one before go with it); the replicas start, make their NIXL agents, map the trainer's
reserved slots and their mirrors (`Puller.prepare`), then are told to go at once; the
time until N serve is from that moment until the last one's pull ended (leasing, every
bucket, the lease check and the digest check). Each copy is then checked byte for byte,
once every replica ended (a check while others still read would take their CPU). Each
process also says its CPU seconds (user and system, every thread) from going until the
last replica ended, the bench reads the registry's from /proc, and the machine's busy CPU
seconds (/proc/stat) over the same time: on a machine of few cores they contend.

Directly, each replica is a plain `Puller` reading the trainer's slot. With relays, each
is a `Puller(host=, stream=True, relay=True, relay_cap=cap)`: the registry places its
lease at the source `choose_source` picks (the slot, or a replica that offered what it
holds), it offers its own mirror once its first bucket landed and marks each bucket as it
lands, and a reader of a relay reads each bucket once the relay marked it, then checks
the publisher's digests. The registry lets `cap` readers at once read the trainer's slot
(`registry serve --origin-cap`), as each relay does; a replica it finds no source for
(every one full) asks again every `ASK_AGAIN_S`. A relaying puller reads its buckets one
at a time, in order, so that each lands, and is offered, as early as it can (asked at
once, over NIXL's tcp, they would all land together at the end).

With `tp`, each replica is that many tensor-parallel ranks, each a process of its own in
the replica's host (sharing its link), each a `SlicePuller` of its slice of a Qwen3-shaped
model of about the size asked for (`tensor_parallel`): plain, reading the trainer's slot,
or with relays `SlicePuller(host=, stream=True, relay=True, relay_cap=cap)`, placed by
the registry at the trainer's slot (which takes `cap` x `tp` ranks at once: the bytes of
`cap` whole readers) or at the same rank of another replica, which offers its slice once
whole; its readers check the slice's digests (of the kind `digest` names). A replica
serves once its last rank holds its slice. Each slice is then checked against an oracle
(numpy indexing of the model's tensors, made again from their seed in each rank).

With `form` (`--form`), the version timed is one of `FORMS`: "full" is the above; the
others are a Qwen3-shaped model of about the size asked for, in bf16 valued as trained
weights are, whose next version moves `changed` of its elements by one unit at random
places (as `bench delta` changes them, at the share it measured an RL step to change).
"delta" publishes that version with its delta (`Publisher(deltas=True)`, whole publishes),
"fp8" in block fp8 whole, "fp8-delta" in block fp8 with its delta against the fp8 base.
For the delta forms each replica first pulls the base, off the clock (relays offering it
on), and is ready once it holds it; then the trainer publishes the next version and they
go: each `Puller` reads the delta section alone and patches its base (a relay's readers
read the section from the relay). Each replica counts the bytes it read for the version
timed (`wire_bytes`), says whether it patched, and its copy is checked tensor by tensor
against the digests of the form's own cast, made in the trainer apart from its publish.

Each process is this module run with `python -m` inside its namespace, spoken to by JSON
lines on its stdin and stdout.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import attrs

from weightpull.digests import KINDS
from weightpull.errors import InvalidArgumentError
from weightpull.integrations.processes import Children

from . import tensor_parallel
from .hosts import ENV, Hosts

MiB = 1 << 20
DEFAULT_SIZE = 256 * MiB
DEFAULT_BUCKET = 16 * MiB
_START_TIMEOUT_S = 120.0
_WARM_TIMEOUT_S = 600.0  # a replica of a delta form is ready once it pulled the base: every replica's, shared links
_PUBLISH_TIMEOUT_S = 300.0  # a publish of the forms: fp8's cast on the CPU, a delta's encode, the oracle's digests
MAX_REPLICAS = 16  # hosts.MAX_HOSTS less the trainer's
# How often the trainer and each relay poll NIXL for their readers (UCX's tcp emulation
# needs the owner's progress): every 5 ms, not the driver's 1 ms, spent 6% less CPU in a
# relayed run of 8 on 2 cores (7.57 against 8.05 core-seconds); 20 ms slowed one copy.
DEFAULT_PROGRESS_S = 0.005
# What the publisher records and readers check: replicas of one job, so the cheap
# checksum (a 256 MiB copy checked in 0.02 core-s against BLAKE2b's 0.29).
DEFAULT_DIGEST = "wsum64"
# How soon a replica asks the registry again when every source is full (a chain's next
# link offers once its first bucket landed, ~0.15 s after it was placed).
ASK_AGAIN_S = 0.005
_LEASE_TTL_S = 60.0  # every reader shares one link: a pull of 8 direct takes ~18 s
# A rank's reads land a batch (up to 64 MiB) at a time, all its batches asked at once: with
# every rank on one shared link, and UCX's tcp moving each row of a 2-D read on the owner's
# progress, none may land for longer than the default 30 s on this shared machine.
_SLICE_STALL_S = 120.0
SEED = 33  # the model's tensors with `tp` (tp.tensors): every rank makes them again to check its slice
MAX_TP = 4  # ranks per replica: each a process, all sharing this machine's cores
MAX_PULLERS = 32  # replicas x ranks: the processes the bench starts at most
TP_FORMS_UNSUPPORTED = (
    "not supported: a SlicePuller reads its slice of the version's own bytes, never a delta section, and an fp8 "
    "version's scales are blocks a rank's rows would split (use --form full with --tp)"
)
# The forms a version can take (`--form`): whole bf16 (random bytes, as the bench always
# moved), its delta against the version before, the version in block fp8, and the delta of
# that against the fp8 version before.
FORMS = ("full", "delta", "fp8", "fp8-delta")
DELTA_FORMS = ("delta", "fp8-delta")  # their replicas pull the base first (off the clock), then patch
# The share of bf16 elements one RL step changes: `bench delta`'s small Qwen3 at lr 1e-6,
# lag 1, 1.90% (1.40-3.02%) (docs/guides/bytes.md)
DEFAULT_CHANGED = 0.019
MODEL_SEED = 34  # the model's weights in the forms but full; the next version's changes from MODEL_SEED + 1


# -- the processes -------------------------------------------------------------------------------


def _say(**message: Any) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


async def _line() -> dict[str, Any]:
    """The next JSON line on stdin; {} once it closed."""
    line = await anyio.to_thread.run_sync(sys.stdin.readline)
    return json.loads(line) if line.strip() else {}


def _connect(cfg: dict[str, Any]) -> Any:
    from weightpull.registry import connect_registry

    return connect_registry(cfg["registry"], key=cfg["key"], server_key=cfg["server_key"])


def _publisher(cfg: dict[str, Any], registry: Any, **options: Any) -> Any:
    """The trainer's `Publisher` over NIXL, polling for its readers every `progress_s`."""
    from weightpull.publisher import Publisher
    from weightpull.transports import create_transport

    return Publisher(
        registry,
        create_transport("nixl", progress_interval=cfg["progress_s"]),
        rollout_dtype=None,
        bucket_bytes=cfg["bucket"],
        name="trainer",
        digests=cfg["digest"],  # what readers from relays check (and every puller, as it does)
        **options,
    )


async def _serve_publishes(publisher: Any, publish: Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]) -> None:
    """Serve the slots' readers while publishing as each line asks (saying what `publish`
    returns) until told to stop, or stdin closes; then close the publisher."""
    async with anyio.create_task_group() as tg:
        tg.start_soon(publisher.serve)  # over TCP every read needs the owner's progress
        while message := await _line():
            if "publish" in message:
                _say(**await publish(message))
            elif message.get("cpu"):
                _say(cpu=time.process_time())  # the bench takes the difference around each run
            else:
                break
        tg.cancel_scope.cancel()
    await publisher.aclose()
    await publisher.transport.aclose()


async def _trainer(cfg: dict[str, Any]) -> None:
    from weightpull.layout import TensorSpec
    from weightpull.tensors import HostTensor

    from .pull import BenchConfig, _tensors, content, digest

    if cfg.get("form", "full") != "full":
        await _form_trainer(cfg)
        return
    if cfg.get("shapes"):  # a model's tensors, which tensor-parallel ranks slice
        specs = [TensorSpec(name, "bfloat16", shape) for name, shape in cfg["shapes"]]
        tensors: dict[str, Any] = {
            name: HostTensor("bfloat16", t.shape, t.data)
            for name, t in tensor_parallel.tensors(cfg["shapes"], SEED).items()
        }
        reserve: Any = specs
        want = None  # each rank checks its slice against the oracle
    else:
        data = content(cfg["size"])
        tensors = _tensors(BenchConfig(transport="nixl", size=cfg["size"], bucket_bytes=cfg["bucket"]), data)
        reserve, want = cfg["size"], digest(data)
    async with _connect(cfg) as registry:
        publisher = _publisher(cfg, registry, stream=True)
        await publisher.reserve(reserve)  # slots made ahead: replicas map them (Puller.prepare)
        _say(ready=True, digest=want)

        async def publish(message: dict[str, Any]) -> dict[str, Any]:
            result = await publisher.publish(message["publish"], tensors)
            assert result.manifest is not None
            return {"published": result.manifest.version}

        await _serve_publishes(publisher, publish)


def model_words(shapes: Sequence[tuple[str, Sequence[int]]], seed: int) -> dict[str, Any]:
    """A Qwen3-shaped model's bf16 words (uint16 numpy arrays), valued as trained weights
    are: each matrix normal with deviation 0.02, each norm 1.0 (random bits would make
    NaNs, and no fp8 cast of them a checkpoint's)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in shapes:
        if len(shape) < 2:
            out[name] = np.full(tuple(shape), 0x3F80, dtype=np.uint16)  # 1.0
            continue
        bits = (rng.standard_normal(tuple(shape), dtype=np.float32) * np.float32(0.02)).view(np.uint32)
        out[name] = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)  # rounded to nearest even
    return out


def next_words(words: dict[str, Any], changed: float, seed: int) -> dict[str, Any]:
    """The next version of `words`: each element, with probability `changed`, moved by one
    unit in the last place (its low bit flipped), at random places, as `bench delta`
    changes bf16 words (`delta.speed`), at the share of elements it measured an RL step to
    change."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return {n: w ^ (rng.random(w.shape, dtype=np.float32) < changed).astype(np.uint16) for n, w in words.items()}


async def _form_trainer(cfg: dict[str, Any]) -> None:
    """The trainer of a version in `cfg["form"]` other than full: a Qwen3-shaped model
    (`model_words`), its versions alternating the base and the next (`next_words`), in bf16
    or block fp8 (`weightpull.integrations.fp8`), published with deltas for the delta forms
    (`Publisher(deltas=True)`, which needs whole publishes). With `oracle`, it also says
    each published tensor's digest, made apart from the publisher's copy: the bytes the
    form's own cast gives, which each replica's copy must equal."""
    import numpy as np
    import torch

    from weightpull.integrations import fp8
    from weightpull.layout import TensorSpec

    from .pull import digest

    form = cfg["form"]
    quantized, deltas = form.startswith("fp8"), form in DELTA_FORMS
    shapes = [(name, tuple(shape)) for name, shape in cfg["model_shapes"]]
    versions = [model_words(shapes, MODEL_SEED)]
    versions.append(next_words(versions[0], cfg["changed"], MODEL_SEED + 1))

    def bf16(words: dict[str, Any]) -> dict[str, Any]:
        return {n: torch.from_numpy(w.view(np.int16)).view(torch.bfloat16) for n, w in words.items()}

    def tensors(words: dict[str, Any]) -> Any:
        return fp8.expand(bf16(words)) if quantized else bf16(words)

    def oracle(words: dict[str, Any]) -> dict[str, str]:
        out = {}
        for name, t in bf16(words).items():
            if quantized and fp8.quantizes(name, tuple(t.shape)):
                q, scale = fp8.quantize(t)
                out[name] = digest(q.view(torch.uint8).numpy())
                out[name + fp8.SCALE_SUFFIX] = digest(scale.view(torch.uint8).numpy())
            else:
                out[name] = digest(words[name])
        return out

    specs = [TensorSpec(name, "bfloat16", shape) for name, shape in shapes]
    async with _connect(cfg) as registry:
        publisher = _publisher(cfg, registry, stream=not deltas, deltas=deltas)  # a delta is encoded once all landed
        await publisher.reserve(fp8.specs(specs, None) if quantized else specs)
        _say(ready=True, digest=None)

        async def publish(message: dict[str, Any]) -> dict[str, Any]:
            words = versions[1 if message.get("next") else 0]
            started = time.perf_counter()
            result = await publisher.publish(message["publish"], tensors(words))
            publish_s = time.perf_counter() - started
            manifest = result.manifest
            assert manifest is not None
            delta = manifest.delta
            return {
                "published": manifest.version,
                "bytes": manifest.layout.total_bytes,
                "delta_bytes": None if delta is None else delta.nbytes,
                "delta_base": None if delta is None else delta.base,
                "changed_words": None if delta is None else delta.changed,
                "word": None if delta is None else delta.word,
                "publish_s": round(publish_s, 3),
                "oracle": await anyio.to_thread.run_sync(oracle, words) if message.get("oracle") else None,
            }

        await _serve_publishes(publisher, publish)


def verify_cpu(mirror: Any, manifest: Any) -> float:
    """CPU seconds to check every bucket of `mirror` against the publisher's digests, as a
    reader does (measured off the clock, to calibrate the model); 0 without."""
    from weightpull.digests import matches

    if manifest.digests is None:
        return 0.0
    view = mirror.host_view()
    start = time.process_time()
    for b, want in zip(manifest.layout.buckets, manifest.digests, strict=True):
        if not matches(view[b.offset : b.offset + b.nbytes], want):
            raise RuntimeError(f"bucket {b.index} does not match its digest")
    return time.process_time() - start


def busy_cpu_s() -> tuple[float, float]:
    """The machine's busy and all CPU-seconds since boot, from /proc/stat (every core):
    busy is all but idle and iowait."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    hz = os.sysconf("SC_CLK_TCK")
    total = sum(ticks[:8])  # user nice system idle iowait irq softirq steal (guest is in user)
    idle = ticks[3] + ticks[4]
    return (total - idle) / hz, total / hz


def process_cpu_s(pid: int) -> float:
    """A process's CPU seconds (user and system, every thread), read from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def _whole_puller(cfg: dict[str, Any], registry: Any, transport: Any) -> Any:
    """A replica's `Puller`: plain, or relaying (see the module's docstring)."""
    from weightpull.puller import Puller

    if not cfg["relays"]:
        return Puller(registry, transport, holder=cfg["name"], ttl=_LEASE_TTL_S)
    return Puller(
        registry,
        transport,
        holder=cfg["name"],
        ttl=_LEASE_TTL_S,
        host=cfg["host"],
        stream=True,
        relay=True,
        relay_cap=cfg["cap"],
    )


def _slice_puller(cfg: dict[str, Any], registry: Any, transport: Any) -> Any:
    """A tensor-parallel rank's `SlicePuller` of its slice (`tensor_parallel.tp_slice`): plain, or
    relaying its slice to the same rank of other replicas, which check it against the
    slice's digests (of the kind `--digest` names)."""
    from weightpull.settings import LeaseSettings, RelaySettings
    from weightpull.slice_puller import SlicePuller

    rank_slice = tensor_parallel.tp_slice(cfg["shapes"], cfg["rank"], cfg["tp"])
    lease = LeaseSettings(ttl=_LEASE_TTL_S, stall_timeout=_SLICE_STALL_S)
    if not cfg["relays"]:
        return SlicePuller(registry, transport, rank_slice, holder=cfg["name"], lease=lease)
    return SlicePuller(
        registry,
        transport,
        rank_slice,
        holder=cfg["name"],
        lease=lease,
        relaying=RelaySettings(host=cfg["host"], relay=True, relay_cap=cfg["cap"]),
        stream=True,
        digester=None if cfg["digest"] == "blake2b128" else host_wsum64,
    )


def host_wsum64(region: Any, spans: Sequence[tuple[int, int]]) -> list[str]:
    """wsum64 digests of a host region's spans: the kind a slice's relay gives and its
    readers check with `--digest wsum64` (BLAKE2b-128 otherwise, the slice's default)."""
    from weightpull.digests import WSUM64, digest

    view = region.host_view()
    return [digest(view[off : off + n], WSUM64) for off, n in spans]


def check_slice(pulled: Any, rank_slice: Any, shapes: Any) -> dict[str, Any]:
    """A rank's slice against the oracle (`tensor_parallel.expected` of the trainer's tensors, made
    again from their seed): the parameters that differ, and a digest of the whole mirror
    (equal at the same rank of every replica, padding included)."""
    from .pull import digest

    whole = tensor_parallel.tensors(shapes, SEED)
    layout = pulled.plan.mirror
    bad = [p.name for p in rank_slice.params if pulled.view(p.name) != tensor_parallel.expected(whole, p).tobytes()]
    return {"bad": bad, "digest": digest(pulled.region.host_view()[: layout.total_bytes])}


def slice_check_cpu(pulled: Any, digest_kind: str) -> float:
    """CPU seconds to digest a rank's mirror bucket by bucket, as a slice's first relay does
    before it offers it and each of its readers does before keeping its copy (measured off
    the clock, to calibrate the model)."""
    from weightpull.digests import digest

    view, start = pulled.region.host_view(), time.process_time()
    for b in pulled.plan.mirror.buckets:
        digest(view[b.offset : b.offset + b.nbytes], digest_kind)
    return time.process_time() - start


async def _replica(cfg: dict[str, Any]) -> None:
    """A whole replica (a `Puller`), or with `tp` one tensor-parallel rank of one (a
    `SlicePuller`), in its host's namespace. With `warm` (the delta forms) it first pulls
    the version the trainer holds (the base), off the clock, serving it on as a relay, and
    says it is ready once it holds it."""
    from weightpull.errors import NoSourceError
    from weightpull.transports import create_transport

    from .pull import digest

    # Every reader shares one link here: a read outlasting the driver's 10 s warning is expected.
    logging.getLogger("weightpull.drivers.nixl").setLevel(logging.ERROR)
    relay, sliced = bool(cfg["relays"]), bool(cfg.get("tp"))
    transport = create_transport("nixl", progress_interval=cfg["progress_s"])
    transport.agent  # noqa: B018  (made now, ~0.4 s, not on the clock)
    wire = [0]  # the bytes this process read (every read of its puller, from any source)
    read, read_2d_many = transport.read, transport.read_2d_many

    async def counting(remote: Any, remote_offset: int, local: Any, local_offset: int, nbytes: int) -> None:
        wire[0] += nbytes
        await read(remote, remote_offset, local, local_offset, nbytes)

    async def counting_2d(reads: Sequence[Any]) -> None:
        wire[0] += sum(r[6] * r[7] for r in reads)  # width x height
        await read_2d_many(reads)

    setattr(transport, "read", counting)  # noqa: B010  (observed only; read_many calls it)
    setattr(transport, "read_2d_many", counting_2d)  # noqa: B010  (observed only)
    async with _connect(cfg) as registry:
        puller = (_slice_puller if sliced else _whole_puller)(cfg, registry, transport)
        await puller.prepare()  # its mirror made and touched, the trainer's slots mapped: not on the clock
        placed: list[tuple[float, str]] = []  # when each lease was granted, and at which source
        acquire = registry.acquire

        async def placing(*args: Any, **kwargs: Any) -> Any:
            lease = await acquire(*args, **kwargs)
            placed.append((time.time(), lease.source))
            return lease

        setattr(registry, "acquire", placing)  # noqa: B010  (observed only)
        offered: list[float] = []  # when a relay offered its mirror: its first bucket had landed (a slice: all)
        offer = registry.offer

        async def offering(*args: Any, **kwargs: Any) -> Any:
            offered.append(time.time())
            return await offer(*args, **kwargs)

        setattr(registry, "offer", offering)  # noqa: B010  (observed only)
        cpu0 = 0.0
        pulled: Any = None

        async def fetch() -> tuple[Any, int]:
            """A pull, asked again while every source is full: (the copy, how often refused)."""
            refused = 0
            while True:
                try:
                    return await puller.pull(), refused
                except NoSourceError:  # every source is full: ask again soon
                    refused += 1
                    await anyio.sleep(ASK_AGAIN_S)

        async def pull() -> None:
            nonlocal pulled
            start = time.time()
            try:
                pulled, refused = await fetch()
            except Exception as exc:  # the bench stops at once, naming it (this process then serves on)
                _say(error=f"{type(exc).__name__}: {exc}")
                return
            end = time.time()
            handed, source = placed[-1]
            first = offered[0] if offered else None  # a relay's: its first offer
            _say(
                end=end,
                start=start,
                cpu_s=time.process_time() - cpu0,
                source=source,
                handed=handed,
                first=first,
                refused=refused,
                wire=wire[0],  # the bytes it read for this version
                patched=getattr(pulled, "base", None) is not None,  # from its delta, on the base it held
                checked=pulled.manifest.digests is not None if not sliced else True,
            )  # the copy is checked once all ended

        async def listen() -> None:
            while message := await _line():
                if message.get("cpu"):  # the run is over: this process's CPU since go, then the checks
                    said: dict[str, Any] = {"cpu": time.process_time() - cpu0}
                    if sliced:
                        if message.get("verify") and relay:  # a slice from the slots is checked by no digest
                            said["verify_cpu_s"] = slice_check_cpu(pulled, cfg["digest"])
                        said.update(check_slice(pulled, puller.rank_slice, cfg["shapes"]))
                    else:
                        if message.get("verify"):
                            said["verify_cpu_s"] = verify_cpu(pulled.region, pulled.manifest)
                        said["digest"] = digest(pulled.region.host_view()[: pulled.nbytes])
                        if cfg.get("form", "full") != "full":  # each tensor, for the oracle's
                            said["tensors"] = {s.name: digest(pulled.view(s.name)) for s in pulled.layout.specs}
                    _say(**said)
                if message.get("stop"):
                    break
            tg.cancel_scope.cancel()

        async with anyio.create_task_group() as tg:
            if relay:  # its readers' reads need this process's progress (a direct reader has none)
                tg.start_soon(transport.serve)
            if cfg.get("warm"):  # the base, off the clock (a relay offers it on while others pull it)
                try:
                    await fetch()
                except Exception as exc:
                    _say(error=f"{type(exc).__name__}: {exc}")
                    tg.cancel_scope.cancel()
                    return
                placed.clear()
                offered.clear()
            wire[0] = 0
            _say(ready=True)
            await _line()  # go
            cpu0 = time.process_time()  # every thread of this process, user and system
            tg.start_soon(pull)
            tg.start_soon(listen)  # serves until told to stop, its own pull long done
        await puller.aclose()
    await transport.aclose()


def main(argv: Sequence[str]) -> None:
    role, cfg = argv[0], json.loads(argv[1])
    anyio.run({"trainer": _trainer, "replica": _replica}[role], cfg)


# -- the run -------------------------------------------------------------------------------------


class _Proc:
    """One process inside a host, spoken to by JSON lines (read from its raw pipe, so that
    a selector sees every line)."""

    def __init__(self, children: Children, hosts: Hosts, host: int, role: str, cfg: dict[str, Any]) -> None:
        import subprocess

        argv = [sys.executable, "-m", __name__, role, json.dumps(cfg)]
        env = {**os.environ, **ENV, "PYTHONUNBUFFERED": "1"}
        self.what = f"the {role} on host {host}"
        self.proc = children.popen(hosts.command(host, argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        assert self.proc.stdout is not None
        self.fd = self.proc.stdout.fileno()
        self.buffer = b""
        self.lines: list[dict[str, Any]] = []

    def send(self, **message: Any) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write((json.dumps(message) + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise RuntimeError(f"{self.what} exited (code {self.proc.wait()})") from None

    def take(self) -> None:
        """Read what the process wrote (the pipe is readable)."""
        chunk = os.read(self.fd, 1 << 16)
        if not chunk:
            raise RuntimeError(f"{self.what} exited (code {self.proc.wait()})")
        self.buffer += chunk
        *whole, self.buffer = self.buffer.split(b"\n")
        self.lines += [json.loads(line) for line in whole if line.strip()]

    def expect(self, key: str, timeout: float = _START_TIMEOUT_S) -> dict[str, Any]:
        import selectors

        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(self.fd, selectors.EVENT_READ)
            while not self.lines:
                if not sel.select(max(0.0, deadline - time.monotonic())):
                    raise RuntimeError(f"{self.what} said nothing for {timeout:.0f} s (waiting for {key!r})")
                self.take()
        message = self.lines.pop(0)
        if key not in message:
            raise RuntimeError(f"{self.what} said {message!r}, not {key!r}")
        return message

    def stop(self) -> None:
        try:
            if self.proc.stdin:
                self.proc.stdin.close()
            self.proc.wait(15)
        except Exception:
            self.proc.kill()
            self.proc.wait(5)


class _Registry:
    """The registry server (`weightpull registry serve`, keyed) in the switch's namespace,
    on the control network; each process gets a key of its own (`client(name)`).
    `origin_cap`: the most readers of the trainer's slot at once (`--origin-cap`)."""

    def __init__(
        self, children: Children, hosts: Hosts, workdir: Path, names: Sequence[str], origin_cap: int | None = None
    ) -> None:
        import select
        import subprocess

        from weightpull.drivers.zmq_registry import keys

        self.keys = workdir / "keys"
        keys.new(self.keys, "server", "registry")
        keys.new(self.keys, "publisher", "trainer")
        for name in names:
            keys.new(self.keys, "reader", name)
        argv = [sys.executable, "-m", "weightpull", "registry", "serve", "--json"]
        argv += ["--bind", f"tcp://{hosts.hub_address}:0", "--keys", str(self.keys)]
        argv += ["--server-key", str(self.keys / "registry.key_secret")]
        if origin_cap is not None:
            argv += ["--origin-cap", str(origin_cap)]
        self.log_path = workdir / "registry.log"
        with open(self.log_path, "w") as log:
            self.proc = children.popen(hosts.hub_command(argv), stdout=subprocess.PIPE, stderr=log, text=True)
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], _START_TIMEOUT_S)
        line = self.proc.stdout.readline() if ready else ""
        try:
            self.address = json.loads(line)["listening"]
        except (ValueError, KeyError):
            self.stop()
            raise RuntimeError(f"the registry did not start: {line!r} {self.log_path.read_text()[-2000:]}") from None

    def client(self, name: str) -> dict[str, str]:
        """What a process named `name` connects with (`_connect`)."""
        return {
            "registry": self.address,
            "key": str(self.keys / f"{name}.key_secret"),
            "server_key": str(self.keys / "registry.key"),
        }

    def cpu_s(self) -> float:
        return process_cpu_s(self.proc.pid)  # `ip netns exec` execs the server: the same pid

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            self.proc.wait(15)
        except Exception:
            self.proc.kill()
            self.proc.wait(5)
        if self.proc.stdout:
            self.proc.stdout.close()


@attrs.frozen
class _Ran:
    ends: list[dict[str, Any]]  # each puller's "end" (a replica's, or a rank's): its pull's start, end, CPU, source
    checks: list[dict[str, Any]]  # each one's copy checked once all ended: its digest (a rank: its bad parameters)
    go: float
    hops: list[int]  # each one's: 1 for the trainer's slot, one more than its relay's
    trainer_cpu_s: float  # from go until the last one's end
    replica_cpu_s: list[float]  # each, from its go until the last end
    registry_cpu_s: float  # the registry server's, over the same time
    verify_cpu_s: float | None  # the first replica's check of its copy (all its ranks'), off the clock
    busy_cpu_s: float  # the machine's (every process's, not only the bench's)
    wall_s: float


def _hops(sources: dict[int, str], names: list[str]) -> list[int]:
    """Each puller's hops from the trainer's slot, from the source each read ("": the slot)."""
    index = {name: i for i, name in enumerate(names)}
    hops: dict[int, int] = {}

    def of(i: int, seen: int = 0) -> int:
        if i not in hops:
            if seen > len(names):
                raise RuntimeError(f"the replicas' sources make a cycle: {sources}")
            source = sources[i]
            hops[i] = 1 if not source else 1 + of(index[source], seen + 1)
        return hops[i]

    return [of(i) for i in range(len(names))]


def _one_run(
    procs: list[_Proc],
    names: list[str],
    trainer: _Proc,
    registry: _Registry,
    timeout: float,
    *,
    verify: int = 0,
    before_go: Callable[[], None] = lambda: None,
) -> _Ran:
    """Tell every puller (a replica, or a rank) to go, and wait until each pulled the
    version; around it, the CPU seconds each process, the registry and the machine spent.
    `verify`: the first so many pullers (the first replica's) also measure their check.
    `before_go`: called once every puller is ready (the delta forms: each holds the base),
    before they go (there: the trainer publishes the version they pull)."""
    import selectors

    for p in procs:
        p.expect("ready", timeout=_WARM_TIMEOUT_S)
    before_go()
    trainer.send(cpu=True)
    trainer_cpu = trainer.expect("cpu")["cpu"]
    registry_cpu = registry.cpu_s()
    busy, _ = busy_cpu_s()
    go = time.time()
    for p in procs:
        p.send(go=True)
    ends: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as sel:
        for i, p in enumerate(procs):
            sel.register(p.fd, selectors.EVENT_READ, i)
        while len(ends) < len(procs):
            events = sel.select(max(0.0, deadline - time.monotonic()))
            if not events:
                raise RuntimeError(f"{len(procs) - len(ends)} pullers did not finish in {timeout:.0f} s")
            for key, _ in events:
                i = key.data
                procs[i].take()
                while procs[i].lines:
                    message = procs[i].lines.pop(0)
                    if "error" in message:
                        raise RuntimeError(f"{procs[i].what}'s pull failed: {message['error']}")
                    if "end" not in message:
                        raise RuntimeError(f"{procs[i].what} said {message!r}, not 'end'")
                    ends[i] = message
    busy_end, _ = busy_cpu_s()
    registry_cpu = registry.cpu_s() - registry_cpu
    wall = time.time() - go
    trainer.send(cpu=True)
    trainer_cpu = trainer.expect("cpu")["cpu"] - trainer_cpu
    for i, p in enumerate(procs):
        p.send(cpu=True, verify=i < verify)
    cpus = [p.expect("cpu") for p in procs]
    checked = [c["verify_cpu_s"] for c in cpus if "verify_cpu_s" in c]
    for p in procs:
        p.send(stop=True)
    return _Ran(
        ends=[ends[i] for i in range(len(procs))],
        checks=cpus,
        go=go,
        hops=_hops({i: e["source"] for i, e in ends.items()}, names),
        trainer_cpu_s=trainer_cpu,
        replica_cpu_s=[c["cpu"] for c in cpus],
        registry_cpu_s=registry_cpu,
        verify_cpu_s=sum(checked) if checked else None,
        busy_cpu_s=busy_end - busy,
        wall_s=wall,
    )


def run_fanout(
    replicas: Sequence[int] = (1, 2, 4, 8),
    *,
    size: int = DEFAULT_SIZE,
    bucket: int = DEFAULT_BUCKET,
    rate: str | None = "1gbit",
    relays: bool = False,
    cap: int | None = None,
    progress_s: float = DEFAULT_PROGRESS_S,
    digest: str = DEFAULT_DIGEST,
    tp: int | None = None,
    form: str = "full",
    changed: float = DEFAULT_CHANGED,
    say: Callable[[str], None] = lambda line: None,
) -> dict[str, Any]:
    """For each N in `replicas`: the time until N replicas, told to go at once, all hold a
    version the trainer published: every one a plain `Puller` reading the trainer's slot,
    or with `relays`, each a `Puller(host=, stream=True, relay=True, relay_cap=cap)` whose
    lease the registry places at a source by its policy (`weightpull.sources`), relays
    among them forwarding buckets as they land and their readers checking the publisher's
    digests. `cap`: live readers per source (None: no cap). `progress_s`: how often the
    trainer and each relay poll NIXL for their readers' progress. `digest`: the kind the
    publisher records (`weightpull.digests`), in both modes: every puller checks it.

    With `tp`, the version is a Qwen3-shaped model of about `size` bytes (`tensor_parallel.scaled`) and
    each replica is `tp` tensor-parallel ranks, each a process of its own in the replica's
    host (sharing its link), each a `SlicePuller` of its slice (`tensor_parallel.tp_slice`): plain, or
    with `relays` placed by the registry at the trainer's slot or the same rank of another
    replica, which offers its slice once whole (`host=, stream=True, relay=True,
    relay_cap=cap`), its readers checking the slice's digests (of the kind `digest`
    names); the trainer's slot then takes `cap * tp` readers at once, as many bytes as
    `cap` whole readers. Each rank's slice is checked against an oracle of the model's
    tensors (`tensor_parallel.expected`), and the same rank of every replica must hold the same bytes.

    `form` is what the timed version is (`FORMS`): "full", the version whole (random
    bytes, as ever); or, of a Qwen3-shaped model of about `size` bytes in bf16 valued as
    trained weights are (`model_words`), whose next version changes `changed` of its
    elements by one unit (`next_words`): "delta", the next version published with its
    delta (`Publisher(deltas=True)`, whole publishes) to replicas that pulled the base
    first, off the clock (whose `Puller`s patch it: the relays too, serving the delta of
    what they hold); "fp8", the next version whole in block fp8
    (`weightpull.integrations.fp8`); "fp8-delta", the delta of that against the fp8 base,
    pulled as "delta" is. Every copy of those is checked tensor by tensor against an oracle
    (the digests of the form's own cast, made in the trainer apart from its publish). Each
    row says the bytes each replica read (`wire_bytes`) and whether it patched."""
    if not replicas or any(not isinstance(n, int) or n < 1 for n in replicas):
        raise InvalidArgumentError(f"replicas must be positive ints, got {list(replicas)!r}")
    if size <= 0 or bucket <= 0:
        raise InvalidArgumentError("size and bucket must be positive")
    if digest not in KINDS:
        raise InvalidArgumentError(f"digest must be one of {', '.join(KINDS)}, got {digest!r}")
    if tp is not None and (not isinstance(tp, int) or isinstance(tp, bool) or not 1 <= tp <= MAX_TP):
        raise InvalidArgumentError(f"tp must be an int in [1, {MAX_TP}] (ranks per replica), got {tp!r}")
    if form not in FORMS:
        raise InvalidArgumentError(f"form must be one of {', '.join(FORMS)}, got {form!r}")
    if tp is not None and form != "full":
        raise InvalidArgumentError(f"form {form!r} with tp: {TP_FORMS_UNSUPPORTED}")
    if not (isinstance(changed, (int, float)) and 0 < changed < 1):
        raise InvalidArgumentError(f"changed must be a share of the elements in (0, 1), got {changed!r}")
    most = max(replicas)
    ranks = tp or 1
    names = [f"replica{i + 1}" for i in range(most)]
    # each puller: its replica's index and the name it holds leases under (a rank's below its replica's)
    pullers = [(i, names[i] if tp is None else f"{names[i]}/rank{r}") for i in range(most) for r in range(ranks)]
    shapes = tensor_parallel.scaled(size) if tp is not None else None
    model: dict[str, Any] = {}
    if shapes is not None:
        nbytes = sum(2 * math.prod(s) for _, s in shapes)
        model = {"tp": tp, "model_bytes": nbytes, "hidden": shapes[0][1][1], "layers": tensor_parallel.LAYERS}
    model_shapes = tensor_parallel.scaled(size) if form != "full" else None
    if model_shapes is not None:
        nbytes = sum(2 * math.prod(s) for _, s in model_shapes)
        model = {"model_bytes": nbytes, "hidden": model_shapes[0][1][1], "layers": tensor_parallel.LAYERS}
    full_bytes = model.get("model_bytes", size)  # the full version's: the bytes a whole bf16 copy moves
    warm = form in DELTA_FORMS
    published: list[dict[str, Any]] = []  # what the trainer said of each timed version
    rows = []
    # Left in this order: every process in the hosts stopped (also on SIGINT or SIGTERM),
    # then the hosts deleted.
    with (
        Hosts(most + 1, rate=rate, control=True) as hosts,
        tempfile.TemporaryDirectory(prefix="wpfan-") as work,
        Children() as children,
    ):
        say(
            f"{most + 1} emulated hosts, links shaped to {rate or 'no limit'}; the trainer on host 0, "
            "the registry on the control network"
            + (f"; {tp} tensor-parallel ranks per replica" if tp is not None else "")
            + (f"; form {form}" + (f", {changed:.2%} of the elements changed" if form != "full" else ""))
        )
        # with relays the trainer's slot takes `cap` whole readers at once (cap * tp ranks), as every relay does
        origin_cap = cap * ranks if relays and cap is not None else None
        registry = _Registry(children, hosts, Path(work), names, origin_cap=origin_cap)
        procs: list[_Proc] = []
        trainer: _Proc | None = None
        try:
            config = {"size": size, "bucket": bucket, "digest": digest, "progress_s": progress_s, "shapes": shapes}
            config.update(form=form, model_shapes=model_shapes, changed=changed, warm=warm)
            trainer = _Proc(children, hosts, 0, "trainer", {**config, **registry.client("trainer")})
            want: Any = trainer.expect("ready", timeout=_PUBLISH_TIMEOUT_S)["digest"]

            def publish(version: int, *, timed: bool) -> None:
                """The trainer publishes `version`: the base, or the version timed (for
                the forms, the next version, with its oracle)."""
                nonlocal want
                trainer.send(publish=version, next=timed, oracle=timed and form != "full")
                said = trainer.expect("published", timeout=_PUBLISH_TIMEOUT_S)
                if timed and form != "full":
                    want = said["oracle"]
                    published.append(said)

            for step, n in enumerate(replicas, 1):
                if warm:  # the base, which every replica pulls before it is ready; then the version timed
                    publish(2 * step - 1, timed=False)
                else:  # a version per step: the last step's relays offer theirs
                    publish(step, timed=True)
                mine = pullers[: n * ranks]
                procs = [
                    _Proc(
                        children,
                        hosts,
                        1 + i,
                        "replica",
                        {
                            **config,
                            "relays": relays,
                            "cap": cap,
                            "name": holder,
                            "host": f"host-{1 + i}",
                            "tp": tp,
                            "rank": k % ranks,
                            **registry.client(names[i]),
                        },
                    )
                    for k, (i, holder) in enumerate(mine)
                ]
                load = loadavg()
                ran = _one_run(
                    procs,
                    [h for _, h in mine],
                    trainer,
                    registry,
                    timeout=600,
                    verify=ranks if n == 1 else 0,
                    before_go=functools.partial(publish, 2 * step, timed=True) if warm else lambda: None,
                )
                for p in procs:
                    p.stop()
                procs = []
                rows.append(_row(n, ranks, ran, want, load))
                row = rows[-1]
                say(
                    f"{n} replicas{' with relays' if relays else ''}{'' if form == 'full' else ', ' + form}: all "
                    f"serve after {row['all_serve_s']:.2f} s (first {row['first_s']:.2f} s, {row['hops']} hops; "
                    f"each read {max(row['wire_bytes']) / MiB:.2f} MiB, {sum(row['patched'])} patched, "
                    f"{'byte-exact' if row['byte_exact'] else 'NOT BYTE-EXACT'}); CPU: the bench's processes "
                    f"{row['procs_cpu_s']:.2f} s (the registry {ran.registry_cpu_s:.2f}), the machine "
                    f"{ran.busy_cpu_s:.2f} s of {os.cpu_count()} cores x {ran.wall_s:.2f} s (load before: {load})"
                )
        finally:
            for p in procs:
                p.stop()
            if trainer is not None:
                trainer.stop()
            registry.stop()
    one = rows[0]["all_serve_s"] / rows[0]["replicas"]  # per replica, from the first N
    for row in rows:
        row["vs_one"] = round(row["all_serve_s"] / one, 2)
    last = published[-1] if published else {}
    return {
        "form": form,
        # the bytes a replica read for the version timed (the most any one read, in any row)
        "wire_bytes": max(b for row in rows for b in row["wire_bytes"]),
        "full_bytes": full_bytes,  # the full bf16 version's, beside it
        "version_bytes": last.get("bytes", full_bytes),  # this form's whole version (fp8: its e4m3 and scales)
        "delta_bytes": last.get("delta_bytes"),  # its delta section, as published (None: none)
        "changed": changed if form != "full" else None,  # the share of bf16 elements the next version changed
        "changed_words": last.get("changed_words"),  # the words its delta holds
        "publish_s": last.get("publish_s"),
        "size_bytes": model.get("model_bytes", size),
        "bucket_bytes": bucket,
        "rate": rate,
        "relays": relays,
        "cap": cap,
        "origin_cap": origin_cap,
        "progress_s": progress_s,
        "digest": digest,
        "ask_again_s": ASK_AGAIN_S if relays else None,
        "cpus": os.cpu_count(),
        **model,
        "rows": rows,
    }


def _row(n: int, ranks: int, ran: _Ran, want: str | dict[str, str] | None, load: str) -> dict[str, Any]:
    """One step's figures: per replica (a replica's time is its last rank's end, its CPU
    its ranks' sum) and, where a replica has ranks, per puller. `want`: the trainer's
    digest of its bytes (full), each tensor's from the oracle (the other forms), or None
    (slices, checked by each rank)."""
    ends = [d["end"] - ran.go for d in ran.ends]
    per_replica = [max(ends[i * ranks : (i + 1) * ranks]) for i in range(n)]
    cpu = [sum(ran.replica_cpu_s[i * ranks : (i + 1) * ranks]) for i in range(n)]
    pull_cpu = [sum(d["cpu_s"] for d in ran.ends[i * ranks : (i + 1) * ranks]) for i in range(n)]
    if isinstance(want, dict):  # the forms: each tensor of each copy equal to the oracle's
        exact = all(c.get("tensors") == want for c in ran.checks)
    elif want is not None:  # whole copies: each equal to the trainer's bytes
        exact = all(c["digest"] == want for c in ran.checks)
    else:  # slices: each equal to the oracle's, and the same rank of every replica alike
        same = all(len({c["digest"] for c in ran.checks[r::ranks]}) == 1 for r in range(ranks))
        exact = same and not any(c["bad"] for c in ran.checks)
    procs_cpu = ran.trainer_cpu_s + sum(ran.replica_cpu_s) + ran.registry_cpu_s
    row: dict[str, Any] = {
        "replicas": n,
        "all_serve_s": round(max(per_replica), 3),
        "first_s": round(min(per_replica), 3),
        "hops": max(ran.hops),
        "byte_exact": exact,
        # CPU seconds from go until the last replica's end: each process's own (user+sys,
        # every thread; a replica's ranks summed), the registry's, and the machine's busy
        # time over all its cores
        "trainer_cpu_s": round(ran.trainer_cpu_s, 3),
        "replica_cpu_s": [round(c, 3) for c in cpu],
        "registry_cpu_s": round(ran.registry_cpu_s, 3),
        "pull_cpu_s": [round(c, 3) for c in pull_cpu],
        "procs_cpu_s": round(procs_cpu, 3),
        "busy_cpu_s": round(ran.busy_cpu_s, 3),
        "wall_s": round(ran.wall_s, 3),
        # since go, per puller (a replica, or each rank of one in turn): when its lease was
        # granted (placed at a source), and (relays) when it first offered its copy (a
        # whole one: its first bucket landed; a slice: all of it); its hops and source
        "handed_s": [round(d["handed"] - ran.go, 3) for d in ran.ends],
        "first_bucket_s": [None if d["first"] is None else round(d["first"] - ran.go, 3) for d in ran.ends],
        "replica_hops": ran.hops,
        "sources": [d["source"] or "trainer" for d in ran.ends],
        "refused": [d["refused"] for d in ran.ends],  # acquires refused (every source full)
        # per replica: the bytes it read for this version (its ranks' summed), whether it
        # patched it from its delta, and whether the publisher's digests were there to check
        "wire_bytes": [sum(d["wire"] for d in ran.ends[i * ranks : (i + 1) * ranks]) for i in range(n)],
        "patched": [any(d["patched"] for d in ran.ends[i * ranks : (i + 1) * ranks]) for i in range(n)],
        "digests_checked": all(d["checked"] for d in ran.ends),
        "cpus": os.cpu_count(),
        "loadavg": load,  # before the run: the machine is shared
    }
    if ranks > 1:
        row["rank_serve_s"] = [round(e, 3) for e in ends]
        row["mismatched"] = [c["bad"] for c in ran.checks if c["bad"]]
    if ran.verify_cpu_s is not None:
        row["verify_cpu_s"] = round(ran.verify_cpu_s, 3)
    return row


# -- the command ---------------------------------------------------------------------------------


def counts(most: int) -> list[int]:
    """1, 2, 4, ... up to `most` (and `most` itself)."""
    out = [1]
    while out[-1] * 2 <= most:
        out.append(out[-1] * 2)
    return out if out[-1] == most else [*out, most]


def add_parser(figures: Any) -> None:
    p = figures.add_parser(
        "fanout",
        help="the time until 1, 2, 4 ... N replicas serve one version, across emulated hosts (root, nixl)",
        description="The trainer and each replica in a network namespace of its own, every host's link "
        "shaped with tc to RATE, NIXL over TCP between them; the time until 1, 2, 4 ... N replicas, told "
        "to go at once, all serve a version of SIZE bytes, through a served registry on an unshaped control "
        "network: first every one a plain Puller reading the trainer's slot, then each a relaying Puller "
        "(host=, stream=True, relay=True) whose lease the registry places at a source by its policy, relays "
        "forwarding buckets as they land; side by side with the link's limit and their ratio, and beside what "
        "`weightpull simulate` predicts from each run's one-replica row (its link and CPU per byte, all hosts "
        "sharing this machine's cores). With --tp, each replica is TP tensor-parallel ranks in its host, each a "
        "SlicePuller of its slice of a Qwen3-shaped model of about SIZE bytes, relayed by the same rank of "
        "other replicas once whole. With --form, each form of the version in turn (full; delta, fp8, "
        "fp8-delta of a Qwen3-shaped model, the delta forms' replicas pulling the base first, off the clock, "
        "then patching it), each run saying the bytes a replica read per version beside the full version's. "
        "Needs root (ip netns), the nixl and service extras (and torch with --tp or --form other than full); "
        "it deletes every namespace it made (docs/guides/fanout.md). Also spelled "
        "`weightpull bench --replicas N --hosts emulated`.",
    )
    p.add_argument("--replicas", type=int, default=8, help=f"the most replicas, 1 to {MAX_REPLICAS} (default: 8)")
    p.add_argument("--hosts", choices=("emulated",), default="emulated", help="where the hosts are (default: emulated)")
    p.add_argument("--size", default="256M", help="bytes per version (default: 256M)")
    p.add_argument("--bucket-size", default="16M", help="bytes per bucket (default: 16M)")
    p.add_argument("--rate", default="1gbit", help="each host's link, as tc writes it (default: 1gbit)")
    p.add_argument(
        "--cap",
        type=int,
        default=1,
        help="with relays, live readers per source, the trainer's slot (the registry's --origin-cap) and each "
        "relay's (relay_cap) (default: 1, a chain); with --tp the trainer's slot takes CAP x TP ranks",
    )
    p.add_argument(
        "--tp",
        type=int,
        default=None,
        help=f"tensor-parallel ranks per replica, 1 to {MAX_TP}, each a process pulling its slice (SlicePuller) "
        f"of a Qwen3-shaped model; at most {MAX_PULLERS} ranks in all (default: whole replicas)",
    )
    p.add_argument("--no-relays", action="store_true", help="measure only the direct reads from the trainer")
    p.add_argument(
        "--digest",
        choices=KINDS,
        default=DEFAULT_DIGEST,
        help="the digests the publisher records, which every reader checks (a reader from a relay bucket by "
        "bucket; with --tp, the kind of the slices' digests, which readers from relays check): "
        "wsum64 (default) is a checksum, cheap (numpy, ~0.02 core-s per 256 MiB), catching corrupt, swapped "
        "or stale buckets but not bytes a hostile relay made to match, for replicas of one job; blake2b128 "
        "is cryptographic, catching those too, at ~1 GB/s a core (docs/guides/fanout.md)",
    )
    p.add_argument(
        "--progress-ms",
        type=float,
        default=DEFAULT_PROGRESS_S * 1e3,
        help=f"how often the trainer and each relay poll NIXL for their readers' progress, ms "
        f"(default: {DEFAULT_PROGRESS_S * 1e3:g})",
    )
    p.add_argument(
        "--form",
        default="full",
        help=f"what the version timed is, a comma list of {', '.join(FORMS)}, each measured in turn (default: full): "
        "full, the version whole (random bytes, as ever); the others a Qwen3-shaped model of about SIZE bytes in "
        "bf16, its next version changing --changed of its elements: delta, that version's delta against the base "
        "every replica pulled first, off the clock (Publisher(deltas=True), each Puller patching its base, relays "
        "serving deltas of what they hold); fp8, the version whole in block fp8 (e4m3, 128x128 scales); fp8-delta, "
        "the delta of the fp8 version against the fp8 base. Each copy is checked against an oracle, tensor by "
        "tensor; each run's JSON says its form and the bytes a replica read per version (wire_bytes). Not with --tp",
    )
    p.add_argument(
        "--changed",
        type=float,
        default=DEFAULT_CHANGED,
        help="with --form other than full, the share of bf16 elements the next version changes, each by one unit "
        f"at random places (default: {DEFAULT_CHANGED}, what `bench delta` measured an RL step at lr 1e-6 to change)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line of stdout")
    p.set_defaults(func=run_command)


def link_bytes_per_s(rate: str | None) -> float | None:
    """Bytes a second a `tc` rate carries ("1gbit": 1.25e8; "100mbps": 1e8); None when
    unshaped or not in those units."""
    import re

    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgt]?)(bit|bps)", (rate or "").strip().lower())
    if m is None:
        return None
    scale = 1000 ** " kmgt".index(m.group(2) or " ")
    return float(m.group(1)) * scale / (8 if m.group(3) == "bit" else 1)


def run_command(args: Any) -> int:
    from weightpull.integrations.simulate import validate
    from weightpull.transports import transport_class

    from .util import parse_size, say_to_stderr

    if not 1 <= args.replicas <= MAX_REPLICAS:
        raise InvalidArgumentError(f"--replicas must be in [1, {MAX_REPLICAS}], got {args.replicas}")
    if args.cap is not None and args.cap < 1:
        raise InvalidArgumentError(f"--cap must be a positive int, got {args.cap}")
    if not 0 < args.progress_ms <= 1000:
        raise InvalidArgumentError(f"--progress-ms must be in (0, 1000], got {args.progress_ms}")
    if args.tp is not None and not (1 <= args.tp <= MAX_TP and args.tp * args.replicas <= MAX_PULLERS):
        raise InvalidArgumentError(
            f"--tp must be in [1, {MAX_TP}] with --replicas x --tp at most {MAX_PULLERS} (each rank is a process "
            f"on this machine's {os.cpu_count()} cores), got --tp {args.tp} --replicas {args.replicas}"
        )
    forms = parse_forms(args.form)
    if args.tp is not None and forms != ["full"]:
        raise InvalidArgumentError(f"--form {args.form} with --tp: {TP_FORMS_UNSUPPORTED}")
    if not 0 < args.changed < 1:
        raise InvalidArgumentError(f"--changed must be a share of the elements in (0, 1), got {args.changed}")
    transport_class("nixl")  # fails early, naming the missing extra
    size, bucket = parse_size(args.size), parse_size(args.bucket_size)
    say = say_to_stderr("fanout")
    common = dict(
        size=size,
        bucket=bucket,
        rate=args.rate,
        progress_s=args.progress_ms / 1e3,
        digest=args.digest,
        tp=args.tp,
        say=say,
    )
    runs = {}  # "direct" and "relays" for the full form, as ever; "direct-delta", "relays-fp8" ... for the others
    for form in forms:
        tag = "" if form == "full" else f"-{form}"
        extra: dict[str, Any] = {} if form == "full" else {"form": form, "changed": args.changed}
        runs[f"direct{tag}"] = run_fanout(counts(args.replicas), **common, **extra)
        if not args.no_relays:
            runs[f"relays{tag}"] = run_fanout(
                counts(args.replicas),
                relays=True,
                cap=args.cap,
                **common,
                **extra,
            )
    for result in runs.values():
        if result["form"] != "full":  # the model moves whole versions: its figures are for the full form only
            for row in result["rows"]:
                row["simulated_s"] = row["simulated_error"] = row["enough_cpus_s"] = None
            continue
        simulated = {r["replicas"]: r for r in validate(result)}
        for row in result["rows"]:
            model = simulated[row["replicas"]]
            row["simulated_s"], row["simulated_error"] = model["simulated_s"], model["error"]
            row["enough_cpus_s"] = model.get("enough_cpus_s")  # the model with a core for every demand
    exact = all(r["byte_exact"] for result in runs.values() for r in result["rows"])
    if args.json:
        print(json.dumps(runs))
        return 0 if exact else 1
    lines = table(runs, args.cap) if "direct" in runs else []
    if forms != ["full"]:
        lines += ([""] if lines else []) + forms_table(runs, args.cap)
    print("\n".join(lines))
    return 0 if exact else 1


def parse_forms(text: str) -> list[str]:
    """`--form`'s comma list, each of `FORMS` once, in the order given."""
    forms = [f.strip() for f in text.split(",") if f.strip()]
    bad = [f for f in forms if f not in FORMS]
    if not forms or bad or len(set(forms)) != len(forms):
        raise InvalidArgumentError(f"--form takes a comma list of {', '.join(FORMS)}, each once, got {text!r}")
    return forms


def forms_table(runs: dict[str, Any], cap: int | None) -> list[str]:
    """Per form and N: the bytes each replica read for the version (beside the full
    version's), the time until N serve, directly and with relays, each beside the link's
    limit for those bytes and their ratio; how many replicas patched the version from its
    delta; whether every copy was byte-exact against the oracle, its digests checked."""
    first = next(iter(runs.values()))
    rate, link = first["rate"], link_bytes_per_s(first["rate"])
    lines = [
        f"every link {rate}; wire: the bytes each replica read for the version, beside the full bf16 version's; "
        "limit: direct, N copies of those bytes through the trainer's link; relays "
        f"(cap {cap}), one copy through one link; patched: replicas that patched the base they held from the "
        "delta; exact: every copy byte-exact against the oracle (the form's own cast) and its digests checked",
        "form         replicas  wire MiB  of full  direct s  limit s  ratio  patched  relays s  limit s  ratio  "
        "patched  exact",
    ]
    forms = dict.fromkeys(r["form"] for r in runs.values())
    for form in forms:
        tag = "" if form == "full" else f"-{form}"
        direct, relayed = runs.get(f"direct{tag}"), runs.get(f"relays{tag}")
        if direct is None:
            continue
        by_n = {r["replicas"]: r for r in relayed["rows"]} if relayed else {}
        for d in direct["rows"]:
            n, r = d["replicas"], by_n.get(d["replicas"])
            wire = max(d["wire_bytes"] + (r["wire_bytes"] if r else []))
            cells = [f"{form:11}", f"{n:8d}", f"{wire / MiB:8.2f}", f"{wire / direct['full_bytes']:7.2%}"]
            for row, copies in ((d, n), (r, 1)):
                if row is None:
                    cells += [f"{'-':>8}", f"{'-':>7}", f"{'-':>5}", f"{'-':>7}"]
                    continue
                limit = copies * max(row["wire_bytes"]) / link if link else None
                cells += [
                    f"{row['all_serve_s']:8.2f}",
                    f"{limit:7.2f}" if limit else f"{'-':>7}",
                    f"{row['all_serve_s'] / limit:5.2f}" if limit else f"{'-':>5}",
                    f"{sum(row['patched'])}/{n}".rjust(7),
                ]
            ok = all(x["byte_exact"] and x["digests_checked"] for x in (d, r) if x is not None)
            cells.append("yes" if ok else "NO")
            lines.append("  ".join(cells))
    return lines


def table(runs: dict[str, Any], cap: int | None) -> list[str]:
    """The runs side by side: per N, direct and relayed, each beside the link's limit, the
    model, and the CPU spent; their ratio; whether every copy was byte-exact."""
    direct = runs["direct"]
    nbytes, rate, tp = direct["size_bytes"], direct["rate"], direct.get("tp")
    link = link_bytes_per_s(rate)
    one = nbytes / link if link else None  # one copy through one link
    what = (
        f"a Qwen3-shaped model of {nbytes / MiB:.0f} MiB (hidden {direct['hidden']}), {tp} tensor-parallel ranks "
        "per replica, each pulling its slice"
        if tp
        else f"{nbytes / MiB:.0f} MiB"
    )
    relayed_how = (
        f"each rank placed by the registry at the trainer's slot (cap {cap} x {tp}) or the same rank of another "
        f"replica (cap {cap}), which offers its slice once whole; readers from relays check the slice's "
        f"{direct['digest']} digests"
        if tp
        else f"the registry places each at a source by its policy (cap {cap}), relays forward buckets as they land"
    )
    lines = [
        f"{what} in {direct['bucket_bytes'] / MiB:.0f} MiB buckets, every link {rate}"
        + (f" (one copy through one link: {one:.2f} s)" if one else "")
        + f"; direct: every {'rank' if tp else 'replica'} reads the trainer's slot; relays: {relayed_how}; "
        f"limit: N copies through the trainer's link; simulated: the model calibrated on the one-replica row, "
        f"hosts sharing {direct['cpus']} cores; cpu s: the bench's processes / the machine's busy CPU-seconds",
        "replicas  direct s  limit s  simulated  error  cpu s        relays s  simulated  error  cpu s        "
        "relays/direct  hops  byte-exact",
    ]
    relayed = {r["replicas"]: r for r in runs.get("relays", {"rows": []})["rows"]}

    def cols(r: dict[str, Any]) -> list[str]:
        cpu = f"{r['procs_cpu_s']:.1f}/{r['busy_cpu_s']:.1f}"
        return [f"{r['all_serve_s']:8.2f}", f"{r['simulated_s']:9.2f}", f"{r['simulated_error']:+5.0%}", f"{cpu:11}"]

    for d in direct["rows"]:
        r = relayed.get(d["replicas"])
        row = [f"{d['replicas']:8d}", *cols(d)]
        row.insert(2, f"{d['replicas'] * one:7.2f}" if one else f"{'-':>7}")
        if r:
            row += [*cols(r), f"{r['all_serve_s'] / d['all_serve_s']:13.2f}", f"{r['hops']:4d}"]
        else:
            row += [f"{'-':>8}", f"{'-':>9}", f"{'-':>5}", f"{'-':11}", f"{'-':>13}", f"{'-':>4}"]
        row.append("yes" if d["byte_exact"] and (r is None or r["byte_exact"]) else "NO")
        lines.append("  ".join(row))
    return lines


if __name__ == "__main__":
    main(sys.argv[1:])
