"""The registry's public records: a lease, and the status of versions and leases.

They cross the process boundary to a served registry's clients, so each reads itself
back from a plain dict through the strict schema (`weightpull.schema`).
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs
from cattrs.gen import make_dict_unstructure_fn, override

from . import schema
from .states import VersionState


@attrs.frozen
class Lease(schema.Record):
    """A reader's claim on one version, valid until `expires_at` on the registry's clock.

    Attributes:
        id: The lease's id, for renewing and releasing it.
        version: The version it holds.
        holder: The reader's holder name.
        ttl: Seconds it lasts from each grant or renewal.
        expires_at: When it lapses, on the registry's clock.
        source: "" to read the version's own slot, else the relay whose mirror holds it.
        descriptor: That relay mirror's descriptor ("" for the version's own slot).
    """

    id: str
    version: int
    holder: str
    ttl: float
    expires_at: float
    # Where to read it: "" for the version's own slot (its manifest's source), else the
    # relay (its holder name) whose mirror holds it, and that mirror's descriptor.
    source: str = ""
    descriptor: bytes = b""


@attrs.frozen
class VersionInfo(schema.Record):
    """One version as the registry's status shows it.

    Attributes:
        version: Its number.
        state: Where it stands (`VersionState`).
        publisher: Who published it.
        slot: The publisher's slot it lies in.
        nbytes: Its size, once known.
        age: Seconds since it began.
        live_leases: Leases held on it now.
        reason: Why it was aborted or retired, if said.
        committed: Of a STREAMING version, the buckets committed so far.
        slots: Of a sharded version, (publisher, slot) of every shard begun.
        step: The step its publisher gave it (`Manifest.step`: the number it asked
            for, its training step, say), once its manifest is known.
        delta: Of a version published with a delta (`Manifest.delta`): (the version
            it is the changes from, the delta section's bytes); None for any other.
    """

    version: int
    state: VersionState
    publisher: str
    slot: int
    nbytes: int | None
    age: float
    live_leases: int
    reason: str = ""
    committed: int | None = None  # of a STREAMING version: buckets committed so far
    # Of a sharded version: (publisher, slot) of every shard begun, the first being
    # `publisher` and `slot` above; empty for a version one publisher writes.
    slots: tuple[tuple[str, int], ...] = ()
    step: int | None = None  # the step its publisher gave (its manifest's), if any
    delta: tuple[int, int] | None = None  # (base, section bytes) of a version with a delta


@attrs.frozen
class Progress(schema.Record):
    """How far a version's copy has come: of its `buckets`, the first `committed` may be
    read (all of them once it is READY or RETIRED; none while plain WRITING)."""

    version: int
    state: VersionState
    committed: int
    buckets: int
    reason: str = ""
    # "" for the version itself; else the relay whose copy this is: its `committed` is the
    # buckets the relay holds, and it is READY only once it holds every one of a READY version.
    source: str = ""


@attrs.frozen
class Reservation(schema.Record):
    """What a publisher registered before its first version: its slots' descriptors over
    `transport`, and how many bytes each of its versions will take in a reader's mirror
    (0: not known). Readers map the slots and size their mirror from it ahead of v1."""

    publisher: str
    transport: str
    sources: tuple[bytes, ...]
    nbytes: int = 0


@attrs.frozen
class LeaseInfo(schema.Record):
    """One live lease as the registry's status shows it.

    Attributes:
        id: The lease's id.
        version: The version it holds.
        holder: The reader's holder name.
        expires_in: Seconds it has left.
        source: The relay it reads from ("" for the version's own slot).
    """

    id: str
    version: int
    holder: str
    expires_in: float
    source: str = ""  # the relay it reads from ("": the version's own slot)


@attrs.frozen
class OfferInfo(schema.Record):
    """A relay's offer of a version: of its `buckets`, the first `landed` are in the
    relay's mirror; `leases` read from it now, at most `cap` at once (None: no cap)."""

    version: int
    holder: str
    host: str
    landed: int
    buckets: int
    leases: int
    cap: int | None = None


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


@attrs.frozen
class PullReport(schema.Record):
    """How a replica's last pull went, as it reports it with `report_serving`: `nbytes`
    in `seconds`, from `source` ("" for the version's own slot, else the relay's name)."""

    seconds: float
    nbytes: int
    source: str = ""

    @property
    def gbps(self) -> float:
        """Its rate in GB/s (0 for a pull that took no time)."""
        return _gbps(self.nbytes, self.seconds)


@attrs.frozen
class PullInfo(schema.Record):
    """A replica's last pull as the registry's status shows it: of `version`, reported
    `ago` seconds back on the registry's clock, `nbytes` in `seconds` from `source` ("" for
    the version's own slot)."""

    version: int
    ago: float
    seconds: float
    nbytes: int
    source: str = ""

    @property
    def gbps(self) -> float:
        """Its rate in GB/s (0 for a pull that took no time)."""
        return _gbps(self.nbytes, self.seconds)


@attrs.frozen
class LapseInfo(schema.Record):
    """A principal whose liveness lapsed lately: `ago` seconds back, and what that ended
    (`ended`: "withdrew v3", "aborted v4", "replica r1 stopped serving v2"; empty if nothing)."""

    name: str
    ago: float
    ended: tuple[str, ...] = ()


@attrs.frozen
class RegistryStatus(schema.Record):
    """What `Registry.status` returns: every version, lease, replica and relay offer.

    Attributes:
        newest_ready: The default line's newest READY version, if any.
        versions: Every version the registry holds.
        leases: Every live lease.
        serving: Each live replica's name and the version it serves.
        alive: Each principal's seconds of liveness left (<= 0: lapsed); empty for a
            registry that judges no liveness.
        offers: Relays' offers, by version then holder.
        pulls: Each live replica's last pull, where it reported one (`report_serving`'s
            `pull`).
        lapsed: The principals whose liveness lapsed in the last `LAPSE_WINDOW` seconds
            (at most `MAX_LAPSES`), newest first.
    """

    newest_ready: int | None
    versions: tuple[VersionInfo, ...]
    leases: tuple[LeaseInfo, ...]
    serving: Mapping[str, int]  # replica -> the version it serves (live replicas only)
    # principal name -> seconds its liveness has left (<= 0: lapsed); empty when the
    # registry judges no liveness (an embedded one)
    alive: Mapping[str, float] = attrs.Factory(dict)
    offers: tuple[OfferInfo, ...] = ()  # relays' offers, by version then holder
    pulls: Mapping[str, PullInfo] = attrs.Factory(dict)  # replica -> its last pull, where reported
    lapsed: tuple[LapseInfo, ...] = ()  # principals lapsed lately, newest first


# `alive` is sent only when the registry judges liveness, `offers` only when a relay
# offers, `pulls` only once a replica reported one, `lapsed` only after a lapse, a
# version's `step` only when its publisher gave one, its `delta` only when it has one, `committed` only for a streaming version, `slots` only for a sharded one, and a
# progress's or a lease's `source` only for a relay's copy: records without them read as
# ever, and older peers never see them.
schema.converter.register_unstructure_hook_factory(
    lambda t: t is RegistryStatus,
    lambda t: make_dict_unstructure_fn(
        t,
        schema.converter,
        alive=override(omit_if_default=True),
        offers=override(omit_if_default=True),
        pulls=override(omit_if_default=True),
        lapsed=override(omit_if_default=True),
    ),
)
schema.converter.register_unstructure_hook_factory(
    lambda t: t is Progress,
    lambda t: make_dict_unstructure_fn(t, schema.converter, source=override(omit_if_default=True)),
)
schema.converter.register_unstructure_hook_factory(
    lambda t: t is Lease,
    lambda t: make_dict_unstructure_fn(
        t, schema.converter, source=override(omit_if_default=True), descriptor=override(omit_if_default=True)
    ),
)
schema.converter.register_unstructure_hook_factory(
    lambda t: t is VersionInfo,
    lambda t: make_dict_unstructure_fn(
        t,
        schema.converter,
        committed=override(omit_if_default=True),
        slots=override(omit_if_default=True),
        step=override(omit_if_default=True),
        delta=override(omit_if_default=True),
    ),
)
schema.converter.register_unstructure_hook_factory(
    lambda t: t in (PullReport, PullInfo),
    lambda t: make_dict_unstructure_fn(t, schema.converter, source=override(omit_if_default=True)),
)
schema.converter.register_unstructure_hook_factory(
    lambda t: t is LapseInfo,
    lambda t: make_dict_unstructure_fn(t, schema.converter, ended=override(omit_if_default=True)),
)
schema.converter.register_unstructure_hook_factory(
    lambda t: t is LeaseInfo,
    lambda t: make_dict_unstructure_fn(t, schema.converter, source=override(omit_if_default=True)),
)
