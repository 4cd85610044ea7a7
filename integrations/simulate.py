"""`weightpull simulate`: the fan-out model (weightpull.simulate) at scale, and its check
against a measured fan-out.

Predicts the time until N replicas serve a model, with and without relays, for the
models in `MODELS` at a host bandwidth (400 Gbit/s by default), and draws it beside the
published figures of other systems (`--plot`, with matplotlib: the `plot` extra). With
`--form`, each model's versions as published whole in bf16 or fp8, or as deltas of
either (the wire bytes from the fractions measured in docs/guides/bytes.md), beside the
goals of issue [bytes] for the 1T model (`GOALS`).
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


FORMS = ("full", "delta", "fp8", "fp8-delta")  # how a version is published: whole or a delta, bf16 or fp8
DELTAS = ("delta", "fp8-delta")

# The measured fractions (docs/guides/bytes.md, `python -m weightpull.integrations.bench.delta`):
# the bytes a version moves as a share of its bf16 bytes, one RL step of a small Qwen3 at lr 1e-6.
DELTA_FRACTION = 0.0381  # a bf16 delta (sparse16: offsets and values), "bf16 ... its delta (mean) 3.81%"
FP8_DELTA_FRACTION = 0.0142  # an fp8 delta of the same steps, "fp8 ... 0.209 MB (1.42%)" of the bf16 bytes
FP8_FRACTION = 0.576  # block fp8 with its scales, Qwen3-8B (bench fp8_cast on the H200: 9.44 GB of 16.38 GB)

# What a replica does once a delta arrives (docs/guides/bytes.md, "after the bytes"): it
# patches its copy of the base and checks the whole version against the publisher's digests
# (wsum64). Rates in bytes of the whole version a second, at the measured fractions above (a
# patch's time scales with the words changed: 1.90% of bf16 words, 0.95% of fp8), measured
# with the library's own functions on the H200 machine, 2 GiB, best of 3 (`python -m
# weightpull.integrations.bench.patch --size 2G --threads 16 --device cuda:0`,
# docs/results/patch-h200-gpu-2026-12-03.txt): in a host mirror (`weightpull.delta.patch`,
# `DigestChecker`), on its 16 cores, a thread each, the default;
PATCH_RATE = {"delta": 39.5e9, "fp8-delta": 37.4e9}
CHECK_RATE = 18.2e9
# in a mirror on a GPU, there (`Puller(patcher=, digester=)`: torch_delta, torch_digests), each
# of a host's GPUs patching and checking its own rank's share, side by side: 8 GiB, about a
# 1T host's GPU's share (docs/results/patch-h200-8g-2026-12-03.txt).
GPU_PATCH_RATE = {"delta": 1670e9, "fp8-delta": 1677e9}
GPU_CHECK_RATE = 1141e9
PATCH_ON = ("host", "gpu")  # where a replica's mirror lies, so where it patches and checks


@attrs.frozen
class Model:
    label: str
    nbytes: int  # the whole model in its preset's form (`form`), as the replicas hold it
    hosts: int  # hosts one replica spans; each receives nbytes / hosts (its ranks' slice)
    bucket_bytes: int
    form: str = "full"  # the form `nbytes` counts, the default: "full" (bf16) or "fp8"
    bf16_bytes: int = 0  # the whole model in bf16; 0: `nbytes` (a bf16 preset)
    fp8_fraction: float = FP8_FRACTION  # its fp8 form's bytes over its bf16 bytes
    gpus: int = 1  # GPUs a host, each its rank's share of the host's bytes


@attrs.frozen
class Fractions:
    """A delta version's bytes as a share of the version's bf16 bytes (`--delta-fraction`,
    `--fp8-delta-fraction`), measured by default."""

    delta: float = DELTA_FRACTION
    fp8_delta: float = FP8_DELTA_FRACTION


@attrs.frozen
class Rates:
    """The rates of what a replica that patches does before it serves or relays its copy
    (`--patch-on`, `--patch-rate`, `--check-rate`): the patch of its copy of the base,
    given at the measured fractions (None: measured, per form), and the check of the
    whole version after it. Bytes a second of the version's bytes where they are patched:
    a host's whole version (`on` "host"), or a GPU's share of it ("gpu": each of the
    host's GPUs patching its own at once)."""

    patch: float | None = None
    check: float | None = None
    on: str = "host"

    def __attrs_post_init__(self) -> None:
        if self.on not in PATCH_ON:
            raise InvalidArgumentError(f"a replica patches on one of {', '.join(PATCH_ON)}, got {self.on!r}")

    def patch_for(self, form: str) -> float:
        if self.patch is not None:
            return self.patch
        return (PATCH_RATE if self.on == "host" else GPU_PATCH_RATE)[form]

    @property
    def check_rate(self) -> float:
        if self.check is not None:
            return self.check
        return CHECK_RATE if self.on == "host" else GPU_CHECK_RATE


def host_version_bytes(model: Model, form: str) -> int:
    """The bytes of the whole version a delta of `form` makes on one host: what its patch
    and its check go over (bf16 for `delta`, fp8 for `fp8-delta`)."""
    return -(-wire_bytes(model, "full" if form == "delta" else "fp8") // model.hosts)


def patched_bytes(model: Model, form: str, on: str) -> int:
    """The bytes one patch goes over: a host's whole version, or a GPU's share of it."""
    return -(-host_version_bytes(model, form) // (model.gpus if on == "gpu" else 1))


def apply_seconds(model: Model, form: str, fractions: Fractions, rates: Rates) -> tuple[float, float]:
    """(patch, check) seconds a host of `model` spends on a delta of `form` before it serves:
    its patch (its time scales with the words changed, so with the delta's fraction over the
    measured one) and the check of its whole version (on the GPUs: each its share, at once).
    (0, 0) for a whole form."""
    if form not in DELTAS:
        return 0.0, 0.0
    nbytes = patched_bytes(model, form, rates.on)
    share = (
        fractions.delta / DELTA_FRACTION if form == "delta" else fractions.fp8_delta / FP8_DELTA_FRACTION
    )  # of the words changed at the rate's measured fraction
    return nbytes / rates.patch_for(form) * share, nbytes / rates.check_rate


def wire_bytes(model: Model, form: str, fractions: Fractions = Fractions()) -> int:
    """The bytes each replica reads per version of `model` in `form` (all its hosts): its
    preset's own in its preset's form; else the bf16 bytes times the form's fraction. A
    delta is read by a replica that holds its base."""
    if form not in FORMS:
        raise InvalidArgumentError(f"a form is one of {', '.join(FORMS)}, got {form!r}")
    if form == model.form:
        return model.nbytes
    bf16 = model.bf16_bytes or model.nbytes
    share = {"full": 1.0, "fp8": model.fp8_fraction, "delta": fractions.delta, "fp8-delta": fractions.fp8_delta}
    return round(bf16 * share[form])


MODELS = {
    # Qwen3-8B's shape in bf16 (DESIGN.md: 16.4 GB), one replica per host.
    "8b": Model("8B bf16 (16.4 GB), 1 host per replica", 16_400_000_000, 1, 256 * MiB),
    # A 1T-parameter MoE in fp8 (Kimi-K2's released form, ~1 TB: half its 2 TB in bf16, the
    # linear weights nearly all of it), one replica on 16 hosts of 8 GPUs (128 GPUs, as in
    # Perplexity's figure), each host reading its ranks' 1/16.
    "1t": Model(
        "1T fp8 (1 TB), 16 hosts (128 GPUs) per replica",
        1_000_000_000_000,
        16,
        GiB,
        form="fp8",
        bf16_bytes=2_000_000_000_000,
        fp8_fraction=0.5,
        gpus=8,
    ),
}

# Issue [bytes]'s goals for the 1T model at 400 Gbit/s per host: (replicas, what, seconds).
GOALS = ((1, "128 GPUs", 1.0), (10_000, "10,000 replicas", 1.5))

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


def scenario(
    model: Model,
    replicas: int,
    p: Params,
    *,
    relays: bool,
    form: str | None = None,
    fractions: Fractions = Fractions(),
    rates: Rates | None = None,
) -> Scenario:
    """One host's slice of `model` (in `form`; None: its preset's) fanned out to `replicas`.
    A delta is one section past the version in the slot, read in pieces of the layout's
    bucket size (`Manifest.delta_pieces`), so its reads are its bytes over the bucket size,
    each paying the read's latency and the bucket's overhead. A relay holding the base
    patches the delta, checks the whole version and only then offers it (`Puller._patched`:
    the copy lands at once), so deltas are relayed whole, not forwarded bucket by bucket.
    A model on several hosts patches each host's slice from its own delta: each host a
    `Puller` of a version of its own, as the slices here are each their own fan-out (a
    `SlicePuller` reads its slice's bytes and never a delta section). With `rates`, each
    reader of a delta patches and checks its host's whole version before it serves or
    relays it (`apply_s`); None: bytes and reads only."""
    form = form or model.form
    apply_s = sum(apply_seconds(model, form, fractions, rates)) if rates is not None else 0.0
    return Scenario(
        replicas=replicas,
        nbytes=-(-wire_bytes(model, form, fractions) // model.hosts),
        bucket_bytes=model.bucket_bytes,
        forward=form not in DELTAS,
        bandwidth=p.bandwidth,
        latency=p.latency,
        bucket_overhead=p.bucket_overhead,
        publish_s=p.publish_s,
        relays=relays,
        cap=p.cap if relays else None,
        failures=tuple(f for f in p.failures if f.replica <= replicas),
        detect_s=p.detect_s,
        apply_s=apply_s,
    )


def predict(
    models: Sequence[str],
    replicas: Sequence[int],
    p: Params,
    forms: Sequence[str] | None = None,
    fractions: Fractions = Fractions(),
    rates: Rates | None = None,
) -> list[dict[str, Any]]:
    """A row per model, form and replica count. `forms` None: each model in its preset's
    form, the rows without the form's keys (as before forms). With `rates`, a delta form's
    times hold each hop's patch and check (its row's `patch_s` and `check_s`, per host)."""
    rows = []
    for key in models:
        model = MODELS[key]
        for form in forms or (None,):
            kw: dict[str, Any] = {"form": form, "fractions": fractions, "rates": rates}
            one = one_read_s(scenario(model, 1, p, relays=False, **kw))
            for n in replicas:
                direct = simulate(scenario(model, n, p, relays=False, **kw))
                relayed = simulate(scenario(model, n, p, relays=True, **kw))
                row: dict[str, Any] = {"model": key, "replicas": n}
                if form is not None:
                    row.update(form=form, wire_bytes=wire_bytes(model, form, fractions))
                if form in DELTAS and rates is not None:
                    patch_s, check_s = apply_seconds(model, form, fractions, rates)
                    row.update(patch_s=round(patch_s, 4), check_s=round(check_s, 4))
                row.update(
                    one_s=round(one, 4),
                    direct_s=round(direct.all_serve_s, 4),
                    relays_s=round(relayed.all_serve_s, 4),
                    relay_hops=relayed.max_hops,
                    restarts=relayed.restarts,
                )
                rows.append(row)
    return rows


def _seconds(model: Model, n: int, p: Params, form: str, fractions: Fractions, apply_s: float) -> float:
    """Until `n` replicas serve `form` (one: its hosts reading alone; more: with relays),
    each hop spending `apply_s` on its copy before it serves."""
    s = attrs.evolve(scenario(model, n, p, relays=n > 1, form=form, fractions=fractions), apply_s=apply_s)
    return one_read_s(s) if n == 1 else simulate(s).all_serve_s


def need_rate(
    model: Model,
    n: int,
    p: Params,
    form: str,
    fractions: Fractions,
    goal: float,
    free: float | None = None,
    on: str = "host",
) -> float | None:
    """The least rate, bytes a second of what one patch goes over (a host's whole version;
    `on` "gpu": a GPU's share), at which a patch and the check after it together (1 / rate
    = 1 / patch + 1 / check) let `n` replicas of a delta `form` serve within `goal` s; None
    where the wire alone misses it (`free`: that time, if known). One replica: exact (its
    hosts apply once, after their reads); more: by bisection on the model, to 1%."""
    nbytes = patched_bytes(model, form, on)
    if free is None:
        free = _seconds(model, n, p, form, fractions, 0.0)
    if free > goal:
        return None
    if n == 1:
        return nbytes / (goal - free) if goal > free else None
    lo, hi = 0.0, goal - free  # lo meets the goal; hi, an apply as long as all the slack, at least one hop's
    if _seconds(model, n, p, form, fractions, hi) <= goal:
        return nbytes / hi
    for _ in range(40):
        if lo > 0 and hi - lo <= 0.01 * lo:
            break
        mid = (lo + hi) / 2
        if _seconds(model, n, p, form, fractions, mid) <= goal:
            lo = mid
        else:
            hi = mid
    return nbytes / lo if lo > 0 else None


def goals(
    rows: list[dict[str, Any]], p: Params, fractions: Fractions = Fractions(), rates: Rates | None = None
) -> list[dict[str, Any]]:
    """For each form of the 1T model among `rows`: its time to each of `GOALS` (one
    replica: its 128 GPUs reading alone; 10,000: with relays), taken from the rows where
    they hold that count, else simulated here, beside the goal. With `rates`, a delta
    form's times hold each hop's patch and check, and each goal says that time on the wire
    alone (`wire_s`), the rate of patch and check together it has (`rate_gbs`) and the
    least that meets the goal (`need_gbs`; None: the wire alone misses it)."""
    out = []
    model = MODELS["1t"]
    for form in dict.fromkeys(r.get("form") or model.form for r in rows if r["model"] == "1t"):
        held = {r["replicas"]: r for r in rows if r["model"] == "1t" and (r.get("form") or model.form) == form}
        patch_s, check_s = apply_seconds(model, form, fractions, rates) if rates is not None else (0.0, 0.0)
        for n, what, goal in GOALS:
            if n in held:
                seconds = held[n]["one_s"] if n == 1 else held[n]["relays_s"]
            else:
                seconds = _seconds(model, n, p, form, fractions, patch_s + check_s)
            seconds = round(seconds, 4)
            g: dict[str, Any] = {"form": form, "to": what, "replicas": n, "s": seconds, "goal_s": goal}
            g["met"] = seconds <= goal
            if form in DELTAS and rates is not None:
                wire_s = _seconds(model, n, p, form, fractions, 0.0)
                need = need_rate(model, n, p, form, fractions, goal, wire_s, rates.on)
                g.update(
                    wire_s=round(wire_s, 4),
                    patch_s=round(patch_s, 4),
                    check_s=round(check_s, 4),
                    rate_gbs=round(patched_bytes(model, form, rates.on) / (patch_s + check_s) / 1e9, 2),
                    need_gbs=None if need is None else round(need / 1e9, 1),
                )
            out.append(g)
    return out


@attrs.frozen
class Calibration:
    """What the model takes from a measured run's one-replica row."""

    bandwidth: float  # bytes/s: the one copy's bytes over its time less its check
    cpus: int | None = None  # cores every emulated host shares; None: not measured
    send_cpu: float = 0.0  # core-seconds per byte: the trainer's CPU over the copy
    recv_cpu: float = 0.0  # the reader's, less its check
    verify_cpu: float = 0.0  # the reader's check of its copy (measured apart, off the clock)


def run_form(measured: dict[str, Any]) -> str:
    """The form a measured run published its versions in (its `form`; absent: "full")."""
    form = measured.get("form") or "full"
    if form not in FORMS:
        raise InvalidArgumentError(f"a measured run's form is one of {', '.join(FORMS)}, got {form!r}")
    return str(form)


def run_bytes(measured: dict[str, Any]) -> int:
    """What each replica of a measured run read per version: its `wire_bytes` (a delta's
    section, an fp8 version's bytes); absent: the version's `size_bytes`."""
    nbytes = measured.get("wire_bytes")
    if nbytes is None:
        return int(measured["size_bytes"])
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 1:
        raise InvalidArgumentError(f"a measured run's wire_bytes must be a positive int, got {nbytes!r}")
    return nbytes


def calibrate(measured: dict[str, Any]) -> Calibration:
    """The model's figures from the one-replica row of a measured run alone (never from
    the rows it is checked against). A run without CPU figures calibrates the link only.
    A run that says its `wire_bytes` is calibrated on those: the bytes its copy moved."""
    base = min(measured["rows"], key=lambda r: r["replicas"])
    if base["replicas"] != 1:
        raise InvalidArgumentError("a measured fan-out to validate against needs its one-replica row")
    nbytes, seconds = run_bytes(measured), base["all_serve_s"]
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
    demanded (core-seconds) beside what the run's processes spent. A run that says its
    `form` and `wire_bytes` (a delta, fp8) moves those bytes per replica, in pieces of its
    bucket size; a delta is relayed once patched (whole), as `scenario` models it."""
    rows = measured["rows"]
    cal = calibrate(measured)
    form, nbytes = run_form(measured), run_bytes(measured)
    parts = measured.get("tp") or 1  # a replica's tensor-parallel ranks: their slices, relayed once whole
    out = []
    for row in rows:
        s = Scenario(
            replicas=row["replicas"],
            nbytes=nbytes,
            bucket_bytes=measured["bucket_bytes"],
            bandwidth=cal.bandwidth,
            relays=bool(measured.get("relays")),
            forward=parts == 1 and form not in DELTAS,
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
        if "form" in measured or "wire_bytes" in measured:
            result.update(form=form, wire_bytes=nbytes)
        if cal.cpus is not None:
            per_copy = nbytes * (cal.send_cpu + cal.recv_cpu + cal.verify_cpu)
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
    for key, form in dict.fromkeys((r["model"], r.get("form")) for r in rows):
        mine = [r for r in rows if r["model"] == key and r.get("form") == form]
        ns = [r["replicas"] for r in mine]
        label = MODELS[key].label if form is None else f"{key} {form}"
        relayed = "forwarded" if form not in DELTAS else "once patched"
        ax.plot(ns, [r["direct_s"] for r in mine], "--", color=colors.get(key), label=f"{label}: no relays")
        ax.plot(
            ns,
            [r["relays_s"] for r in mine],
            "-" + {"delta": "s", "fp8": "^", "fp8-delta": "D"}.get(form or "", "o"),  # a marker per form
            color=colors.get(key),
            label=f"{key if form is None else label}: relays (cap {p.cap}, {relayed})",
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


def _forms(text: str) -> tuple[str, ...]:
    forms = tuple(dict.fromkeys(FORMS if text == "all" else text.split(",")))
    bad = [f for f in forms if f not in FORMS]
    if bad or not forms:
        raise argparse.ArgumentTypeError(f"forms are comma-separated of {', '.join(FORMS)}, or all; got {text!r}")
    return forms


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a share of the bf16 bytes in (0, 1], got {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a share of the bf16 bytes in (0, 1], got {text!r}")
    return value


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a rate in GB/s, a finite number > 0, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a rate in GB/s, a finite number > 0, got {text!r}")
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
        "without relays (all read the trainer) and with; CPUs never bind (real hosts have their own); with --form, "
        "versions published whole or as deltas, in bf16 or fp8, beside the 1T goals. "
        "Validate it against a measured run with --measured (docs/guides/fanout.md).",
    )
    p.add_argument("--model", choices=(*MODELS, "both"), default="both", help="the model (default: both)")
    p.add_argument(
        "--replicas",
        type=_replicas,
        default=DEFAULT_REPLICAS,
        help="comma-separated replica counts (default: 1,3,10,30,100,300,1000,3000,10000)",
    )
    p.add_argument(
        "--form",
        type=_forms,
        metavar="FORM[,FORM...]",
        help="how each version is published, comma-separated or all: full (bf16), delta (bf16, read by replicas "
        "holding the base), fp8 (block fp8 with scales), fp8-delta; prints the 1T goals beside them "
        "(default: each model as its preset counts it, 8B bf16 and 1T fp8, no goals)",
    )
    p.add_argument(
        "--delta-fraction",
        type=_fraction,
        metavar="F",
        help=f"a delta's bytes as a share of the version's bf16 bytes (default: {DELTA_FRACTION}, measured: "
        "docs/guides/bytes.md)",
    )
    p.add_argument(
        "--fp8-delta-fraction",
        type=_fraction,
        metavar="F",
        help=f"an fp8 delta's bytes as a share of the version's bf16 bytes (default: {FP8_DELTA_FRACTION}, measured)",
    )
    p.add_argument(
        "--patch-on",
        choices=PATCH_ON,
        help="with a delta form: where each replica's mirror lies, so where it patches and checks: host (the "
        "default: a host mirror, on the host's cores) or gpu (each of a host's GPUs its rank's share, at once: "
        "Puller(patcher=, digester=))",
    )
    p.add_argument(
        "--patch-rate",
        type=_rate,
        metavar="GB/s",
        help="with a delta form: the patch of a copy of the base, GB/s of the version's bytes it goes over (a host's "
        "whole version; a GPU's share with --patch-on gpu) at the measured fractions (its time scales with the "
        "delta's fraction), once per hop before the copy serves (default, measured on the H200 machine: host "
        f"delta {PATCH_RATE['delta'] / 1e9:g}, fp8-delta {PATCH_RATE['fp8-delta'] / 1e9:g} on its 16 cores; gpu "
        f"{GPU_PATCH_RATE['delta'] / 1e9:g} and {GPU_PATCH_RATE['fp8-delta'] / 1e9:g})",
    )
    p.add_argument(
        "--check-rate",
        type=_rate,
        metavar="GB/s",
        help="with a delta form: the check of the whole version against its digests after the patch, GB/s, once "
        f"per hop, as --patch-rate counts them (default, wsum64 measured on the H200 machine: host "
        f"{CHECK_RATE / 1e9:g} on its 16 cores, gpu {GPU_CHECK_RATE / 1e9:g})",
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
        "with each row's error; a run that says its form and wire_bytes (a delta, fp8) moves those bytes per replica",
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
            form = (
                f" ({rows[0]['form']}, {rows[0]['wire_bytes'] / 2**20:.2f} MiB a replica)"
                if rows and "wire_bytes" in rows[0]
                else ""
            )
            print(f"{name}{form}: the model calibrated on the one-replica row alone")
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
    forms = args.form
    for option, value, form in (
        ("--delta-fraction", args.delta_fraction, "delta"),
        ("--fp8-delta-fraction", args.fp8_delta_fraction, "fp8-delta"),
    ):
        if value is not None and form not in (forms or ()):
            raise InvalidArgumentError(f"{option} applies to --form {form}, which was not asked for")
    for option, value in (
        ("--patch-rate", args.patch_rate),
        ("--check-rate", args.check_rate),
        ("--patch-on", args.patch_on),
    ):
        if value is not None and not set(forms or ()) & set(DELTAS):
            raise InvalidArgumentError(f"{option} applies to --form delta or fp8-delta, neither of which was asked for")
    rates = Rates(
        patch=None if args.patch_rate is None else args.patch_rate * 1e9,
        check=None if args.check_rate is None else args.check_rate * 1e9,
        on=args.patch_on or "host",
    )
    fractions = Fractions(
        delta=args.delta_fraction or DELTA_FRACTION, fp8_delta=args.fp8_delta_fraction or FP8_DELTA_FRACTION
    )
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
    rows = predict(models, args.replicas, params, forms, fractions, rates if forms else None)
    met = goals(rows, params, fractions, rates) if forms and "1t" in models else []
    if args.plot:
        plot(rows, args.plot, params, args.gbit)
    if args.json:
        out: dict[str, Any] = {"gbit": args.gbit, "cap": args.cap, "rows": rows}
        if forms:
            out.update(fractions=attrs.asdict(fractions), goals=met)
            if set(forms) & set(DELTAS):
                out.update(
                    patch_on=rates.on,
                    patch_rate_gbs={f: rates.patch_for(f) / 1e9 for f in DELTAS if f in forms},
                    check_rate_gbs=rates.check_rate / 1e9,
                )
        print(json.dumps(out))
        return 0
    print(
        f"{args.gbit:g} Gbit/s per host x {args.efficiency:g}, {args.latency_us:g} us per read, "
        f"{args.overhead_us:g} us per bucket; relays: cap {args.cap}, buckets forwarded as they arrive"
        + ("; deltas relayed once patched (whole)" if forms and set(forms) & set(DELTAS) else "")
    )
    if forms:
        fp8 = ", ".join(f"{MODELS[k].fp8_fraction:g} ({k})" for k in models)
        print(
            f"wire bytes a replica reads, of the version's bf16 bytes: fp8 {fp8}; delta {fractions.delta:g}; "
            f"fp8-delta {fractions.fp8_delta:g} "
            + (
                "(measured: docs/guides/bytes.md)"
                if args.delta_fraction is None and args.fp8_delta_fraction is None
                else "(the deltas' as given)"
            )
        )
        if set(forms) & set(DELTAS):
            patch = ", ".join(f"{f} {rates.patch_for(f) / 1e9:g}" for f in DELTAS if f in forms)
            measured = "measured on the H200 machine's 16 cores" if rates.on == "host" else "measured on an H200"
            where = "its host's copy" if rates.on == "host" else "on each GPU its rank's share of its host's copy"
            print(
                f"deltas: each hop patches {where} of the base ({patch} GB/s: "
                f"{'given' if args.patch_rate is not None else measured + ', at the measured fractions'}) "
                f"and checks it ({rates.check_rate / 1e9:g} GB/s: "
                f"{'given' if args.check_rate is not None else 'wsum64, ' + measured}) before it serves or relays it"
            )
        print("model  form       wire GB  replicas  one alone s  no relays s  relays s  hops")
    else:
        print("model  replicas  one alone s  no relays s  relays s  hops")
    for r in rows:
        form = f"{r['form']:9}  {r['wire_bytes'] / 1e9:7.2f}  " if forms else ""
        print(
            f"{r['model']:5}  {form}{r['replicas']:8d}  {r['one_s']:11.3f}  {r['direct_s']:11.3f}  "
            f"{r['relays_s']:8.3f}  {r['relay_hops']:4d}"
        )
    if met:
        print(
            f"1T goals (issue [bytes], at 400 Gbit/s per host; this run: {args.gbit:g} Gbit/s, relays cap {args.cap}):"
        )
        for g in met:
            verdict = "met" if g["met"] else "NOT met"
            line = f"  {g['form']:9}  to {g['to']:15}  {g['s']:7.3f} s  goal <= {g['goal_s']:g} s  {verdict}"
            if "need_gbs" in g:
                need = (
                    "the wire alone misses it"
                    if g["need_gbs"] is None
                    else f"needs patch + check >= {g['need_gbs']:g} GB/s together"
                )
                line += (
                    f"  (wire {g['wire_s']:.3f} s, then per hop patch {g['patch_s']:.3f} s + check "
                    f"{g['check_s']:.3f} s: {g['rate_gbs']:g} GB/s together; {need})"
                )
            print(line)
        if any(f in DELTAS for f in forms):
            whose = "each host's" if rates.on == "host" else "each GPU's share of each host's"
            print(
                f"  deltas: patch and check of {whose} "
                "whole version included, per hop; the whole forms' own checks left out (bytes and reads only)"
            )
        else:
            print("  bytes and reads only: a whole copy's check left out")
    if args.plot:
        print(f"plot: {args.plot}")
    return 0
