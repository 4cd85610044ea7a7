"""The `weightpull` command line."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

import anyio

from . import __version__
from .transports import list_transports


def _demo(args: argparse.Namespace) -> int:
    if args.replica:  # one of the demo's replica processes, started by its trainer
        from .demo import replica_main

        return replica_main(args.replica)
    if args.engine == "vllm":
        return _demo_vllm(args)
    from .demo import DemoConfig, default_transport, run_demo

    cfg = DemoConfig(
        transport=args.transport or default_transport(),
        size_mib=args.size_mib,
        versions=args.versions,
        replicas=args.replicas,
        tear=not args.no_tear,
        ttl=args.ttl,
        registry=args.registry,
    )
    try:
        summary = anyio.run(run_demo, cfg)
    except KeyboardInterrupt:  # the replica processes are gone already
        print("interrupted", file=sys.stderr)
        return 130
    if args.json:
        print(json.dumps(summary))
    return 0 if summary["ok"] else 1


def _demo_vllm(args: argparse.Namespace) -> int:
    from weightpull.integrations.vllm.demo import VllmDemoConfig, run

    cfg = VllmDemoConfig(transport=args.transport or "nixl", registry=args.registry, versions=args.versions,
                         replicas=args.replicas, tear=not args.no_tear, ttl=args.ttl)
    summary = run(cfg)
    if args.json:
        print(json.dumps(summary))
    return 0 if summary["ok"] else 1


def _drivers(args: argparse.Namespace) -> int:
    infos = list_transports()
    if args.json:
        print(json.dumps([{"name": i.name, "origin": i.origin, "target": i.target, "extra": i.extra,
                           "available": i.available, "reason": i.reason} for i in infos]))
        return 0
    for i in infos:
        state = "available" if i.available else f"unavailable: {i.reason}"
        print(f"{i.name:<10} {i.origin:<12} {state}")
    return 0


def _bench(args: argparse.Namespace) -> int:
    if args.size is None:
        return _model_bench(args)
    from .bench import BenchConfig, _options, parse_size, run_bench, summary_lines
    from .errors import WeightpullError

    def say(line: str) -> None:
        print(f"[bench] {line}", file=sys.stderr, flush=True)

    if args.preset:
        return _fail("--preset measures a model-shaped set; --size a single stream of bytes: pass one")
    try:
        cfg = BenchConfig(transport=args.transport or "fake", size=parse_size(args.size), repeat=args.repeat,
                          bucket_bytes=parse_size(args.bucket_size), slot=args.slot, mirror=args.mirror,
                          options=_options(args.option))
        result = anyio.run(run_bench, cfg, say)
    except WeightpullError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print("\n".join(summary_lines(result)), file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(result))
    return 0 if result["byte_exact"] else 1


def _model_bench(args: argparse.Namespace) -> int:
    from .errors import WeightpullError

    try:
        from weightpull.integrations import bench
    except ImportError as exc:
        return _fail(f"the bench needs torch: pip install 'weightpull[torch]' ({exc})")
    try:
        result = anyio.run(lambda: bench.run(args.preset, [args.transport] if args.transport else None,
                                             args.versions, not args.no_baselines))
    except (WeightpullError, ValueError, RuntimeError) as exc:
        return _fail(exc)
    print("\n".join(bench.table(result)), file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(result))
    return 0 if bench.ok(result) else 1


def _address(args: argparse.Namespace) -> str | None:
    from .registry import REGISTRY_ENV

    return args.registry or os.environ.get(REGISTRY_ENV) or None


def _fail(exc: BaseException) -> int:
    print(f"error: {exc}", file=sys.stderr)
    return 1


def _registry_serve(args: argparse.Namespace) -> int:
    from .errors import WeightpullError

    try:
        from weightpull.drivers.zmq_registry.server import DEFAULT_BIND, RegistryServer, run_server
        from weightpull.drivers.zmq_registry.wire import SECRET_ENV, load_secret
    except ImportError as exc:
        return _fail(f"serving the registry needs pyzmq: pip install 'weightpull[service]' ({exc})")
    try:
        secret = load_secret(args.secret_file)
        server = RegistryServer(args.bind or DEFAULT_BIND, secret=secret)
        if secret is None:
            print(f"warning: no secret (${SECRET_ENV} or --secret-file): serving on loopback only, and any "
                  "local process can publish, lease and read state", file=sys.stderr)

        def ready(endpoint: str) -> None:
            print(f"weightpull registry listening on {endpoint} (run {server.epoch})", flush=True)

        anyio.run(run_server, server, ready)
    except WeightpullError as exc:
        return _fail(exc)
    return 0


def _registry_bench(args: argparse.Namespace) -> int:
    from .errors import DriverUnavailableError, WeightpullError

    try:
        from weightpull.drivers.zmq_registry import bench
        from weightpull.drivers.zmq_registry.wire import load_secret
    except ImportError as exc:
        return _fail(DriverUnavailableError(f"the bench needs pyzmq: pip install 'weightpull[service]' ({exc})"))

    def measure(address: str, secret: bytes | None) -> bench.BenchResult:
        return anyio.run(lambda: bench.run_bench(address, clients=args.clients, seconds=args.seconds, secret=secret))

    try:
        if args.clients < 1 or args.seconds <= 0:
            return _fail("--clients must be at least 1 and --seconds positive")
        address = _address(args)
        if address:
            result = measure(address, load_secret(args.secret_file))
        else:
            with bench.own_server() as (address, secret):
                anyio.run(bench.publish_one, address, secret)
                result = measure(address, secret)
    except WeightpullError as exc:
        return _fail(exc)
    print(json.dumps(result.to_dict()) if args.json else "\n".join(result.lines()))
    return 0


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
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def _status(args: argparse.Namespace) -> int:
    from .errors import WeightpullError
    from .registry import REGISTRY_ENV, connect_registry

    address = _address(args)
    if not address:
        return _fail(f"status reads a served registry: pass --registry ADDRESS or set ${REGISTRY_ENV}")

    async def fetch():
        from weightpull.drivers.zmq_registry.wire import load_secret

        reg = connect_registry(address, secret=load_secret(args.secret_file), retry_for=args.timeout)
        try:
            return await reg.status(), reg.epoch
        finally:
            await reg.aclose()

    try:
        status, run = anyio.run(fetch)
    except WeightpullError as exc:
        return _fail(exc)
    if args.json:
        print(json.dumps({"registry": address, "run": run, **status.to_dict()}))
        return 0
    newest = "none" if status.newest_ready is None else f"v{status.newest_ready}"
    lines = [f"registry {address} (run {run}); newest READY: {newest}", "versions:"]
    rows = [[f"v{v.version}", str(v.state), v.publisher, str(v.slot), _size(v.nbytes), f"{v.age:.1f} s",
             str(v.live_leases), v.reason] for v in status.versions]
    lines += _table([["VERSION", "STATE", "PUBLISHER", "SLOT", "SIZE", "AGE", "LEASES", "REASON"], *rows]) if rows else ["  (none)"]
    lines.append("leases:")
    rows = [[x.holder, f"v{x.version}", f"{x.expires_in:.1f} s", x.id] for x in status.leases]
    lines += _table([["HOLDER", "VERSION", "EXPIRES IN", "LEASE"], *rows]) if rows else ["  (none)"]
    lines.append("serving:")
    rows = [[replica, f"v{version}"] for replica, version in sorted(status.serving.items())]
    lines += _table([["REPLICA", "VERSION"], *rows]) if rows else ["  (none)"]
    print("\n".join(lines))
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="weightpull", description="Move versioned model weights from a trainer to inference replicas, by pull.")
    p.add_argument("--version", action="version", version=f"weightpull {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="log the library's debug messages to stderr")
    sub = p.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="publish versions of a synthetic model and pull them from replicas, checked bit-exact",
                          description="A trainer publishes versions of a synthetic fp32 model as bf16; replicas pull at different "
                          "paces (one renews its lease, one skips versions), one read is torn on purpose and must be rejected, "
                          "and every applied copy is checked bit-exact. Progress and a summary go to stderr; exits 1 if a check fails.")
    demo.add_argument("--transport", help="transport driver: fake runs everything in one process; any other runs each "
                      "replica in a process of its own (default: nixl where it loads, else fake)")
    demo.add_argument("--engine", choices=("none", "vllm"), default="none",
                      help="vllm: the replicas are vLLM engines fed by the dispatcher, with a greedy-output check "
                      "(docs/vllm.md; --size-mib does not apply) (default: none)")
    demo.add_argument("--size-mib", type=int, default=256, help="MiB published per version, after the bf16 cast (default: 256)")
    demo.add_argument("--versions", type=int, default=6, help="versions the trainer publishes (default: 6)")
    demo.add_argument("--replicas", type=int, default=2, help="replica pullers, at least 2 (default: 2)")
    demo.add_argument("--ttl", type=float, default=2.0, help="lease TTL in seconds; the replica torn on purpose uses a quarter of it (default: 2.0)")
    demo.add_argument("--no-tear", action="store_true", help="do not tear a read on purpose")
    demo.add_argument("--json", action="store_true", help="print one JSON summary as the last line of stdout")
    demo.add_argument("--registry", help="address of a served registry (default: $WEIGHTPULL_REGISTRY, else one in the "
                      "trainer's process, served on loopback to replica processes)")
    demo.add_argument("--replica", help=argparse.SUPPRESS)  # SPEC: run as a replica process of the demo
    demo.set_defaults(func=_demo)

    drivers = sub.add_parser("drivers", help="list transport drivers, and whether each loads here")
    drivers.add_argument("--json", action="store_true", help="print the list as JSON")
    drivers.set_defaults(func=_drivers)

    pull_bench = sub.add_parser("bench", help="trainer block, pull, apply pause and publish-to-serving, beside the limits and baselines",
                                description="With --preset (the default): a tensor set shaped like a real model goes from a trainer "
                                "to a replica over each installed transport (or --transport), VERSIONS times after one per trainer slot to warm up: "
                                "the trainer's blocking time per publish, the pull bandwidth, the replica's apply pause and the time "
                                "from publish to serving, beside the copy limits measured in the same run and the pushes a user would "
                                "pick instead (torch.distributed broadcast; verl's CUDA IPC push on GPU). On a GPU, a driver that "
                                "reads GPU memory at device speed (cuda_ipc) runs with GPU slots, then with host slots. With --size: one version of "
                                "SIZE bytes pulled REPEAT times against the transport's raw read and the copy limit. Every copy is "
                                "checked; exits 1 if one is wrong. GB/s are 10^9 bytes/s. Progress goes to stderr (docs/benchmarks.md).")
    pull_bench.add_argument("--transport", help="one transport driver (default: every one that loads here; with --size, fake)")
    pull_bench.add_argument("--preset", help="tensor set: tiny, 0.6b (Qwen3-0.6B's shapes) or 8b (Qwen3-8B's, 16.4 GB bf16) "
                            "(default: 8b with a GPU, else 0.6b)")
    pull_bench.add_argument("--versions", type=int, default=3, help="measured versions per transport (after one per trainer slot) and updates per "
                            "baseline (after one) (default: 3)")
    pull_bench.add_argument("--no-baselines", action="store_true", help="leave out the baselines")
    pull_bench.add_argument("--size", help="bytes per version, instead of a preset: 256M, 1G, ...")
    pull_bench.add_argument("--repeat", type=int, default=5, help="with --size: timed pulls, after one to warm up (default: 5)")
    pull_bench.add_argument("--bucket-size", default="64M", help="bytes per bucket, each one read (default: 64M)")
    pull_bench.add_argument("--slot", choices=("cpu", "cuda"), default="cpu", help="where the publisher's slot lives (default: cpu)")
    pull_bench.add_argument("--mirror", choices=("cpu", "cuda", "staged"), default="cpu",
                            help="the puller's mirror: host memory, GPU memory read into directly, or GPU memory "
                            "through a pinned host shadow (HostStaged) (default: cpu)")
    pull_bench.add_argument("-o", "--option", action="append", metavar="KEY=VALUE", help="a transport option, e.g. threads=4")
    pull_bench.add_argument("--json", action="store_true", help="print one JSON object as the last line of stdout")
    pull_bench.set_defaults(func=_bench)

    registry = sub.add_parser("registry", help="serve the registry over ZeroMQ, or benchmark a served one")
    rsub = registry.add_subparsers(dest="registry_command", required=True)
    serve = rsub.add_parser("serve", help="serve a registry to publishers and replicas in other processes and hosts",
                            description="Serve the registry over ZeroMQ; prints one line saying where it listens once "
                            "ready. Requests and replies are signed with the secret from $WEIGHTPULL_SECRET or "
                            "--secret-file; without one it serves loopback addresses only. State lives in memory: "
                            "after a restart, clients re-announce what they stand by (docs/registry-service.md).")
    serve.add_argument("--bind", help="ZeroMQ endpoint to listen on (default: tcp://127.0.0.1:5555; port 0 picks a free one)")
    serve.add_argument("--secret-file", help="file holding the shared secret (default: $WEIGHTPULL_SECRET)")
    serve.set_defaults(func=_registry_serve)

    bench = rsub.add_parser("bench", help="lease acquire/release round trips per second and p99 latency",
                            description="Concurrent clients loop lease acquire+release on the newest READY version. "
                            "With --registry (or $WEIGHTPULL_REGISTRY) it only leases what is there; without, it "
                            "starts its own server process.")
    bench.add_argument("--clients", type=int, default=8, help="concurrent clients (default: 8)")
    bench.add_argument("--seconds", type=float, default=3.0, help="measured time (default: 3)")
    bench.add_argument("--registry", help="address of a served registry (default: $WEIGHTPULL_REGISTRY, else its own)")
    bench.add_argument("--secret-file", help="file holding the shared secret (default: $WEIGHTPULL_SECRET)")
    bench.add_argument("--json", action="store_true", help="print the figures as one JSON line")
    bench.set_defaults(func=_registry_bench)

    status = sub.add_parser("status", help="a served registry's versions, live leases and what each replica serves")
    status.add_argument("--registry", help="address of the served registry (default: $WEIGHTPULL_REGISTRY)")
    status.add_argument("--secret-file", help="file holding the shared secret (default: $WEIGHTPULL_SECRET)")
    status.add_argument("--timeout", type=float, default=5.0, help="seconds to keep trying to reach it (default: 5)")
    status.add_argument("--json", action="store_true", help="print the status as JSON")
    status.set_defaults(func=_status)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    return args.func(args)
