"""`weightpull simulate`: the fan-out model (weightpull.simulate) at scale, and its check
against a measured fan-out.

Predicts the time until N replicas serve a model, with and without relays, for the
models in `MODELS` at a host bandwidth (400 Gbit/s by default), and draws it beside the
published figures of other systems (`--plot`, with matplotlib: the `plot` extra).
`validate` calibrates the model on a measured fan-out's one-replica row (whole replicas,
or tensor-parallel ones, each rank a slice) and predicts the rest of the measured run: its link from the time, and, where the run measured CPU, what
each byte costs the sender's and the reader's CPU (and the reader's check of its copy),
all hosts sharing the run's cores. The predictions at scale leave CPU out: real hosts
each have their own cores, which a link of 400 Gbit/s with RDMA barely uses.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

import attrs

from weightpull.errors import InvalidArgumentError
from weightpull.simulate import Failure, Scenario, one_read_s, simulate

MiB = 1 << 20
GiB = 1 << 30


@attrs.frozen
class Model:
    label: str
    nbytes: int  # the whole model, as the replicas hold it
    hosts: int  # hosts one replica spans; each receives nbytes / hosts (its ranks' slice)
    bucket_bytes: int

    @property
    def slice_bytes(self) -> int:
        return -(-self.nbytes // self.hosts)


MODELS = {
    # Qwen3-8B's shape in bf16 (DESIGN.md: 16.4 GB), one replica per host.
    "8b": Model("8B bf16 (16.4 GB), 1 host per replica", 16_400_000_000, 1, 256 * MiB),
    # A 1T-parameter MoE in fp8 (Kimi-K2's released form, ~1 TB), one replica on 16 hosts of 8
    # GPUs (128 GPUs, as in Perplexity's figure), each host reading its ranks' 1/16.
    "1t": Model("1T fp8 (1 TB), 16 hosts (128 GPUs) per replica", 1_000_000_000_000, 16, GiB),
}

# Published figures of other systems, as issue 15 cites them: (label, replicas, seconds).
# None: the source gives no replica count comparable to ours; drawn as a level line.
PUBLISHED = (
    ("Perplexity: 1T to 128 GPUs", 1, 1.3),
    ("vLLM RDT: Kimi-K2 256->128 H100", 1, 7.5),
    ("checkpoint-engine: Kimi-K2", None, 16.0),
)
DEFAULT_REPLICAS = (1, 3, 10, 30, 100, 300, 1000, 3000, 10000)


@attrs.frozen
class Params:
    bandwidth: float  # bytes/s a host sends (and receives)
    latency: float = 10e-6
    bucket_overhead: float = 100e-6
    cap: int = 2
    publish_s: float = 0.0
    detect_s: float = 1.0
    failures: tuple[Failure, ...] = ()


def scenario(model: Model, replicas: int, p: Params, *, relays: bool) -> Scenario:
    return Scenario(
        replicas=replicas,
        nbytes=model.slice_bytes,
        bucket_bytes=model.bucket_bytes,
        bandwidth=p.bandwidth,
        latency=p.latency,
        bucket_overhead=p.bucket_overhead,
        publish_s=p.publish_s,
        relays=relays,
        cap=p.cap if relays else None,
        failures=tuple(f for f in p.failures if f.replica <= replicas),
        detect_s=p.detect_s,
    )


def predict(models: Sequence[str], replicas: Sequence[int], p: Params) -> list[dict[str, Any]]:
    rows = []
    for key in models:
        model = MODELS[key]
        one = one_read_s(scenario(model, 1, p, relays=False))
        for n in replicas:
            direct = simulate(scenario(model, n, p, relays=False))
            relayed = simulate(scenario(model, n, p, relays=True))
            rows.append(
                {
                    "model": key,
                    "replicas": n,
                    "one_s": round(one, 4),
                    "direct_s": round(direct.all_serve_s, 4),
                    "relays_s": round(relayed.all_serve_s, 4),
                    "relay_hops": relayed.max_hops,
                    "restarts": relayed.restarts,
                }
            )
    return rows


@attrs.frozen
class Calibration:
    """What the model takes from a measured run's one-replica row."""

    bandwidth: float  # bytes/s: the one copy's bytes over its time less its check
    cpus: int | None = None  # cores every emulated host shares; None: not measured
    send_cpu: float = 0.0  # core-seconds per byte: the trainer's CPU over the copy
    recv_cpu: float = 0.0  # the reader's, less its check
    verify_cpu: float = 0.0  # the reader's check of its copy (measured apart, off the clock)


def calibrate(measured: dict[str, Any]) -> Calibration:
    """The model's figures from the one-replica row of a measured run alone (never from
    the rows it is checked against). A run without CPU figures calibrates the link only."""
    base = min(measured["rows"], key=lambda r: r["replicas"])
    if base["replicas"] != 1:
        raise InvalidArgumentError("a measured fan-out to validate against needs its one-replica row")
    nbytes, seconds = measured["size_bytes"], base["all_serve_s"]
    cpus = measured.get("cpus") or base.get("cpus")
    if cpus is None or "trainer_cpu_s" not in base or "replica_cpu_s" not in base:
        return Calibration(bandwidth=nbytes / seconds)
    check = base.get("verify_cpu_s") or 0.0  # CPU seconds, over every rank of the replica
    parts = measured.get("tp") or 1
    check_s = check / parts * max(1.0, parts / cpus)  # the ranks' checks at once, each on a core while they last
    if check_s >= seconds:
        raise InvalidArgumentError(f"the one-replica check took {check} s of CPU, the whole copy {seconds} s")
    return Calibration(
        bandwidth=nbytes / (seconds - check_s),  # the check comes after the last byte
        cpus=int(cpus),
        send_cpu=base["trainer_cpu_s"] / nbytes,
        recv_cpu=max(0.0, base["replica_cpu_s"][0] - check) / nbytes,
        verify_cpu=check / nbytes,
    )


def validate(measured: dict[str, Any]) -> list[dict[str, Any]]:
    """Each row of a measured fan-out (`bench fanout`'s JSON) beside the model's
    prediction, calibrated on the run's one-replica row alone (`calibrate`): its link and,
    when measured, its CPU per byte, every host sharing the run's cores. A run of
    tensor-parallel replicas (`tp`) is modelled as such: each replica's ranks are slices
    of their own layouts sharing its host's link (`parts`), relayed once whole, the
    trainer's slot taking the run's `origin_cap`. Each row also says the CPU the model
    demanded (core-seconds) beside what the run's processes spent."""
    rows = measured["rows"]
    cal = calibrate(measured)
    parts = measured.get("tp") or 1  # a replica's tensor-parallel ranks: their slices, relayed once whole
    out = []
    for row in rows:
        s = Scenario(
            replicas=row["replicas"],
            nbytes=measured["size_bytes"],
            bucket_bytes=measured["bucket_bytes"],
            bandwidth=cal.bandwidth,
            relays=bool(measured.get("relays")),
            forward=parts == 1,
            cap=measured.get("cap"),
            origin_cap=measured.get("origin_cap", measured.get("cap")),
            parts=parts,
            cpus=cal.cpus,
            send_cpu=cal.send_cpu,
            recv_cpu=cal.recv_cpu,
            verify_cpu=cal.verify_cpu,
        )
        predicted = simulate(s).all_serve_s
        result = {
            "replicas": row["replicas"],
            "measured_s": row["all_serve_s"],
            "simulated_s": round(predicted, 3),
            "error": round(predicted / row["all_serve_s"] - 1, 3),
        }
        if cal.cpus is not None:
            per_copy = measured["size_bytes"] * (cal.send_cpu + cal.recv_cpu + cal.verify_cpu)
            result.update(
                cpus=cal.cpus,
                # the CPU the model gives the copies, beside what the run's processes spent
                demand_cpu_s=round(row["replicas"] * per_copy, 3),
                measured_cpu_s=row.get("procs_cpu_s"),
                busy_cpu_s=row.get("busy_cpu_s"),
                # as many cores as the processes want: what separate hosts would give
                enough_cpus_s=round(simulate(attrs.evolve(s, cpus=None)).all_serve_s, 3),
            )
        out.append(result)
    return out


def plot(rows: list[dict[str, Any]], path: str, p: Params, gbit: float) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError(f"--plot draws with matplotlib: pip install 'weightpull[plot]' ({exc})") from None
    fig, ax = plt.subplots(figsize=(8, 5.5), dpi=120)
    colors = {"8b": "tab:blue", "1t": "tab:red"}
    for key in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == key]
        ns = [r["replicas"] for r in mine]
        ax.plot(ns, [r["direct_s"] for r in mine], "--", color=colors.get(key), label=f"{MODELS[key].label}: no relays")
        ax.plot(
            ns,
            [r["relays_s"] for r in mine],
            "-o",
            color=colors.get(key),
            label=f"{key}: relays (cap {p.cap}, forwarded)",
        )
    for i, (label, n, seconds) in enumerate(PUBLISHED):
        if n is None:
            ax.axhline(seconds, color="gray", linestyle=":", linewidth=1)
            ax.annotate(f"{label} {seconds:g} s (replicas n/a)", (10, seconds), fontsize=7, color="gray", va="bottom")
        else:
            ax.plot(
                [n],
                [seconds],
                marker="*",
                markersize=11,
                linestyle="none",
                color=("tab:green", "tab:purple")[i % 2],
                label=f"{label}: {seconds:g} s",
            )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("replicas")
    ax.set_ylabel("seconds until every replica serves")
    ax.set_title(
        f"weightpull simulate: {gbit:g} Gbit/s per host, {p.latency * 1e6:g} us latency, "
        f"{p.bucket_overhead * 1e6:g} us per bucket",
        fontsize=9,
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# -- the command -----------------------------------------------------------------------------


def _replicas(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"replicas are comma-separated positive ints, got {text!r}") from None
    if not values or any(v < 1 or v > 100_000 for v in values):
        raise argparse.ArgumentTypeError(f"replicas are ints in [1, 100000], got {text!r}")
    return values


def _failure(text: str) -> Failure:
    try:
        replica, at = text.split("@")
        return Failure(int(replica), float(at))
    except (ValueError, InvalidArgumentError):
        raise argparse.ArgumentTypeError(f"a failure is REPLICA@SECONDS (e.g. 3@0.5), got {text!r}") from None


def _non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


def _positive(text: str) -> float:
    value = _non_negative(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def _cap(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"the cap is a positive int, got {text!r}")
    return value


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "simulate",
        help="predict the time until N replicas serve a model, with and without relays (a discrete-event model)",
        description="A discrete-event model of fan-out (weightpull.simulate): the trainer's slot and, with "
        "relays, every replica that holds the version serve it; each host's link is shared by its readers; "
        "buckets are forwarded as they arrive; sources are chosen by the registry's policy "
        "(weightpull.sources). Prints the time until every replica serves the 8B and 1T models for each N, "
        "without relays (all read the trainer) and with; CPUs never bind (real hosts have their own). "
        "Validate it against a measured run with --measured (docs/guides/fanout.md).",
    )
    p.add_argument("--model", choices=(*MODELS, "both"), default="both", help="the model (default: both)")
    p.add_argument(
        "--replicas",
        type=_replicas,
        default=DEFAULT_REPLICAS,
        help="comma-separated replica counts (default: 1,3,10,30,100,300,1000,3000,10000)",
    )
    p.add_argument("--gbit", type=_positive, default=400.0, help="each host's link, Gbit/s (default: 400)")
    p.add_argument(
        "--efficiency",
        type=_positive,
        default=0.93,
        help="the share of the link that carries payload (default: 0.93, as measured on the emulated hosts)",
    )
    p.add_argument("--latency-us", type=_non_negative, default=10.0, help="per read, microseconds (default: 10)")
    p.add_argument(
        "--overhead-us", type=_non_negative, default=100.0, help="per bucket read, microseconds (default: 100)"
    )
    p.add_argument("--cap", type=_cap, default=2, help="live leases per source with relays (default: 2)")
    p.add_argument(
        "--publish-s", type=_non_negative, default=0.0, help="the trainer's streamed copy into its slot (default: 0)"
    )
    p.add_argument(
        "--fail", type=_failure, action="append", default=[], metavar="REPLICA@SECONDS", help="a replica dies then"
    )
    p.add_argument(
        "--detect-s", type=_non_negative, default=1.0, help="until a reader notices its source died (default: 1)"
    )
    p.add_argument(
        "--measured",
        metavar="FILE",
        help="a `bench fanout --json` result: each of its runs beside the model calibrated on that run's "
        "one-replica row (its link and, where measured, its CPU per byte, all hosts sharing the run's cores), "
        "with each row's error",
    )
    p.add_argument("--plot", metavar="PNG", help="draw the prediction beside published figures (needs matplotlib)")
    p.add_argument("--json", action="store_true", help="print the rows as one JSON object, the last line of stdout")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.measured:
        with open(args.measured) as f:
            measured = json.load(f)
        runs = measured if "rows" not in measured else {"direct": measured}  # both runs, or one
        checked = {name: validate(run) for name, run in runs.items()}
        if args.json:
            print(json.dumps({"validation": checked}))  # each run's rows, by its name
            return 0
        for name, rows in checked.items():
            print(f"{name}: the model calibrated on the one-replica row alone")
            print("replicas  measured s  simulated s   error  cpu demand s  cpu measured s  enough cpus s")
            for r in rows:
                cpu = (
                    f"  {r['demand_cpu_s']:12.2f}  {r['measured_cpu_s'] or 0:14.2f}  {r['enough_cpus_s']:13.3f}"
                    if "cpus" in r
                    else ""
                )
                print(f"{r['replicas']:8d}  {r['measured_s']:10.3f}  {r['simulated_s']:11.3f}  {r['error']:+6.1%}{cpu}")
        return 0
    if args.efficiency > 1:
        raise InvalidArgumentError(f"--efficiency is a share of the link, at most 1, got {args.efficiency}")
    params = Params(
        bandwidth=args.gbit * 1e9 / 8 * args.efficiency,
        latency=args.latency_us * 1e-6,
        bucket_overhead=args.overhead_us * 1e-6,
        cap=args.cap,
        publish_s=args.publish_s,
        detect_s=args.detect_s,
        failures=tuple(args.fail),
    )
    models = list(MODELS) if args.model == "both" else [args.model]
    rows = predict(models, args.replicas, params)
    if args.plot:
        plot(rows, args.plot, params, args.gbit)
    if args.json:
        print(json.dumps({"gbit": args.gbit, "cap": args.cap, "rows": rows}))
        return 0
    print(
        f"{args.gbit:g} Gbit/s per host x {args.efficiency:g}, {args.latency_us:g} us per read, "
        f"{args.overhead_us:g} us per bucket; relays: cap {args.cap}, buckets forwarded as they arrive"
    )
    print("model  replicas  one alone s  no relays s  relays s  hops")
    for r in rows:
        print(
            f"{r['model']:5}  {r['replicas']:8d}  {r['one_s']:11.3f}  {r['direct_s']:11.3f}  "
            f"{r['relays_s']:8.3f}  {r['relay_hops']:4d}"
        )
    if args.plot:
        print(f"plot: {args.plot}")
    return 0
