"""The `weightpull` command line."""

from __future__ import annotations

import argparse
import json
import logging
import sys

import anyio

from . import __version__
from .transports import list_transports


def _demo(args: argparse.Namespace) -> int:
    from .demo import DemoConfig, run_demo

    cfg = DemoConfig(
        transport=args.transport,
        size_mib=args.size_mib,
        versions=args.versions,
        replicas=args.replicas,
        tear=not args.no_tear,
        ttl=args.ttl,
    )
    summary = anyio.run(run_demo, cfg)
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


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="weightpull", description="Move versioned model weights from a trainer to inference replicas, by pull.")
    p.add_argument("--version", action="version", version=f"weightpull {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="log the library's debug messages to stderr")
    sub = p.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="publish versions of a synthetic model and pull them from replicas, checked bit-exact",
                          description="A trainer publishes versions of a synthetic fp32 model as bf16; replicas pull at different "
                          "paces (one renews its lease, one skips versions), one read is torn on purpose and must be rejected, "
                          "and every applied copy is checked bit-exact. Progress and a summary go to stderr; exits 1 if a check fails.")
    demo.add_argument("--transport", default="fake", help="transport driver (default: fake)")
    demo.add_argument("--size-mib", type=int, default=256, help="MiB published per version, after the bf16 cast (default: 256)")
    demo.add_argument("--versions", type=int, default=6, help="versions the trainer publishes (default: 6)")
    demo.add_argument("--replicas", type=int, default=2, help="replica pullers, at least 2 (default: 2)")
    demo.add_argument("--ttl", type=float, default=2.0, help="lease TTL in seconds; the replica torn on purpose uses a quarter of it (default: 2.0)")
    demo.add_argument("--no-tear", action="store_true", help="do not tear a read on purpose")
    demo.add_argument("--json", action="store_true", help="print one JSON summary as the last line of stdout")
    demo.set_defaults(func=_demo)

    drivers = sub.add_parser("drivers", help="list transport drivers, and whether each loads here")
    drivers.add_argument("--json", action="store_true", help="print the list as JSON")
    drivers.set_defaults(func=_drivers)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    return args.func(args)
