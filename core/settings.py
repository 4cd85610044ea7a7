"""The settings of a `Puller`, a `SlicePuller` and a `Publisher`, grouped, and every rule
they must keep checked here, in one place: each settings class checks its own fields
as it is made, the `PullerSettings`/`PublisherSettings` that a puller or publisher
makes of all it was given check the rules across groups, and their `check_fit` the rules
that join them to the registry and driver given. Every rule broken is named in one
`InvalidArgumentError`, with the argument, what was wrong and the fix.

The old flat keyword arguments (`Puller(ttl=5.0)`) stay as good as the grouped form
(`Puller(lease=LeaseSettings(ttl=5.0))`): `merge` makes the one of the other, and
refuses a flat argument that contradicts the settings object given beside it.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import attrs

from . import plugins
from .digests import BLAKE2B128, KINDS, WSUM64
from .errors import InvalidArgumentError
from .registry import Registry, RelayingRegistry, StreamingRegistry
from .transport import Region

DEFAULT_STALL_TIMEOUT = 30.0
# How long a publish waits for a slot before it gives up: under `WhenFull.WAIT` (then
# `SlotWaitTimeoutError`), and under the default `WhenFull.WAIT_THEN_SKIP` (then it skips
# the version, with a warning): longer than a reader on the trainer's host takes to finish
# the version before (an 8B model's 16 GB at 55 GB/s: 0.3 s), short beside a training step.
DEFAULT_WAIT_TIMEOUT = 60.0
# A reader's TTL must cover this many round trips to the registry, measured at its first
# acquire: a renewal is asked a third of the TTL after the last grant, and must land
# before the TTL ends (so the least would be 1.5), with room for a round trip slower than
# the least measured.
MIN_TTL_ROUND_TRIPS = 5
DEFAULT_SKIP_AFTER = 1.0
_TORCH_DIGESTER = plugins.Named(plugins.DIGESTERS, "torch")  # an entry point: the core names no integration
_TORCH_PATCHER = plugins.Named(plugins.PATCHERS, "torch")

# What computes the wsum64 digests of a slot on a device, where it lies: given the slot
# and each bucket's (offset, nbytes), each bucket's digest (``wsum64:<hex>``). Called in a
# worker thread once the version's copies landed. The torch integration's is
# `weightpull.integrations.torch_digests.wsum64_digests`.
Digester = Callable[[Region, Sequence[tuple[int, int]]], Sequence[str]]


# What patches a mirror on a device where it lies, from the delta section past the version
# in it (`weightpull.delta`'s format): given the mirror, the version's bytes, the section's
# bytes, the word, and the region that holds the base apart (None: the mirror holds it).
# Called in a worker thread; a malformed section raises `DigestMismatchError` before any
# write. The torch integration's is `weightpull.integrations.torch_delta.patch_region`.
Patcher = Callable[[Region, int, int, int, Region | None], None]


def patcher_hint() -> str:
    """The patcher a message names where a mirror on a device could patch deltas: the
    torch integration's."""
    return str(_TORCH_PATCHER)


def digester_hint() -> str:
    """The digester a message names as the fix where a device needs one (wsum64 digests
    computed, or checked, where a slot or mirror lies): the torch integration's."""
    return str(_TORCH_DIGESTER)


def refuse(problems: Sequence[str], what: str) -> None:
    """One `InvalidArgumentError` naming every problem of `what`, if there is any."""
    if len(problems) == 1:
        raise InvalidArgumentError(problems[0])
    if problems:
        raise InvalidArgumentError(f"{what}: {len(problems)} problems: " + "; ".join(problems))


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def non_finite(name: str, value: object, fix: str) -> str | None:
    """The problem of a number that is not finite (nan, inf), named as such with the
    argument the user passed; None for any other value (its own range check judges it)."""
    if not _number(value) or math.isfinite(value):  # type: ignore[arg-type]
        return None
    what = "not a number" if math.isnan(value) else "infinite"  # type: ignore[arg-type]
    return f"{name} must be a finite number of seconds, got {value!r} ({what}): {fix}"


@attrs.frozen
class LeaseSettings:
    """How a reader holds its lease on the version it reads.

    Args:
        ttl: Seconds of the registry's clock a lease lives without a renewal. Positive
            and finite; at the first acquire, a TTL below `MIN_TTL_ROUND_TRIPS` round
            trips to the registry is refused (`weightpull.leasing.LeaseClient`).
        renew_every: Seconds of the registry's clock between renewals while a read
            runs; None: a third of `ttl`. Must be in (0, ttl), or every read longer
            than the TTL is torn.
        stall_timeout: A read in which no bucket lands for this many seconds of the
            registry's clock ends with `NoProgressError`; None waits forever. It must
            exceed the time one bucket takes.

    Raises:
        InvalidArgumentError: naming each argument out of range, and the fix.
    """

    ttl: float = 10.0
    renew_every: float | None = None
    stall_timeout: float | None = DEFAULT_STALL_TIMEOUT

    def __attrs_post_init__(self) -> None:
        problems = []
        # A number that is not finite is named as such, under the name passed: never
        # blamed on renew_every, which a TTL's third makes when it is not given.
        ttl_bad = non_finite("ttl", self.ttl, "pass the lease's lifetime in seconds (default 10)")
        stall_bad = non_finite("stall_timeout", self.stall_timeout, "pass None to wait forever")
        renew_bad = non_finite("renew_every", self.renew_every, "leave it None (a third of ttl)")
        ttl_ok = ttl_bad is None and _number(self.ttl) and self.ttl > 0
        if ttl_bad is not None:
            problems.append(ttl_bad)
        elif not ttl_ok:
            problems.append(f"ttl must be positive, got {self.ttl!r}: pass the lease's lifetime in seconds")
        if stall_bad is not None:
            problems.append(stall_bad)
        elif self.stall_timeout is not None and not (_number(self.stall_timeout) and self.stall_timeout > 0):
            problems.append(
                f"stall_timeout must be positive or None, got {self.stall_timeout!r}: "
                "pass the seconds a read may go without progress, or None to wait forever"
            )
        if renew_bad is not None:
            problems.append(renew_bad)
        elif self.renew_every is not None and not _number(self.renew_every):
            problems.append(f"renew_every must be a number of seconds or None, got {self.renew_every!r}")
        elif ttl_ok and not 0 < self.renew_interval < self.ttl:  # else every read longer than the TTL is torn
            problems.append(
                f"renew_every must be in (0, ttl={self.ttl}), got {self.renew_every!r}: "
                "renew well within the TTL, or leave it None (a third of it)"
            )
        refuse(problems, "LeaseSettings")

    @property
    def renew_interval(self) -> float:
        """The seconds between renewals: `renew_every`, or a third of the TTL."""
        return self.renew_every or self.ttl / 3


@attrs.frozen
class RelaySettings:
    """How a puller reads from relays and serves as one (see `Puller`).

    Args:
        host: This replica's host name: each lease is then placed at a source the
            registry picks (the version's slot or a relay's mirror, the same host's
            first). None reads from the slot alone.
        relay: Offer the mirror to other replicas while each pull fills it (needs
            `host`, and a puller with `stream=True`).
        relay_cap: The most leases the offer takes at once; None: no cap.
        spare_mirror: Keep a second mirror, so that readers of this relay never hold
            up its next pull (needs `host`).

    Raises:
        InvalidArgumentError: naming each argument that is wrong, and the fix.
    """

    host: str | None = None
    relay: bool = False
    relay_cap: int | None = None
    spare_mirror: bool = False

    def __attrs_post_init__(self) -> None:
        problems = []
        if self.host is not None and (not isinstance(self.host, str) or not self.host):
            problems.append(f"host must be a non-empty string, got {self.host!r}: pass this replica's host name")
        if self.relay and self.host is None:
            problems.append(
                "a puller relays a version while pulling it (relay=True) with host= and stream=True: pass host="
            )
        if self.spare_mirror and self.host is None:
            problems.append("a spare mirror is for a relay's readers: it needs host=")
        refuse(problems, "RelaySettings")


@attrs.frozen
class PullerSettings:
    """Everything a `Puller` was given that a rule joins, checked together: what
    `Puller` makes of its arguments (`Puller.settings`).

    Args:
        lease: How the lease is held (`LeaseSettings`).
        relaying: Relays read from and served (`RelaySettings`).
        device: Where the mirror lies: "cpu", or a GPU ("cuda:0").
        stream: Read versions still being written.
        verify_digests: Check the publisher's digests: None where the mirror allows,
            True insists (on a GPU, with `digester`), False never (but relays' bytes).
        digester: Checks wsum64 digests where a GPU mirror lies (`Digester`).

    Raises:
        InvalidArgumentError: naming every rule broken, and the fix.
    """

    lease: LeaseSettings = attrs.field(factory=LeaseSettings)
    relaying: RelaySettings = attrs.field(factory=RelaySettings)
    device: str = "cpu"
    stream: bool = False
    verify_digests: bool | None = None
    digester: Digester | None = None

    def __attrs_post_init__(self) -> None:
        problems = []
        on_host = self.device == "cpu"
        if self.verify_digests and not on_host and self.digester is None:
            problems.append(
                f"digests are verified on host mirrors, or on {self.device!r} by digester= "
                f"({digester_hint()}); leave verify_digests unset to skip them there"
            )
        if self.relaying.host is not None and not on_host and self.digester is None:
            problems.append(
                f"reading from relays (host=) checks every bucket against the publisher's digests: a mirror "
                f"on {self.device!r} checks them with digester={digester_hint()}"
            )
        if self.relaying.relay and not self.stream:
            problems.append("a puller relays a version while pulling it (relay=True) with host= and stream=True")
        refuse(problems, "Puller")

    def check_fit(self, registry: Registry, *, staged: bool) -> None:
        """The rules that join these settings to the registry and the driver a puller
        is made with (`staged`: its mirror is fed through host staging).

        Raises:
            InvalidArgumentError: naming every rule broken, and the fix.
        """
        problems = []
        if self.stream and not isinstance(registry, StreamingRegistry):
            problems.append(f"{type(registry).__name__} cannot stream versions (stream=True)")
        if self.relaying.host is not None and not isinstance(registry, RelayingRegistry):
            problems.append(f"{type(registry).__name__} hands out no sources (host=)")
        if self.relaying.relay and staged:
            problems.append(
                f"a relay offers its mirror to other replicas, and a mirror on {self.device!r} fed through host "
                f"staging cannot be exported: relay from a host mirror, or over a driver that reads into "
                f"{self.device!r} (staging=False)"
            )
        refuse(problems, "Puller")


class WhenFull(enum.Enum):
    """What `publish` does when every slot holds a leased or newest version.

    The default, WAIT_THEN_SKIP, keeps the promise that the trainer never waits for the
    slowest replica: a publish waits for a slot at most `wait_timeout` (1 s unless
    given), then skips its version with a warning, counted in `publish/skipped`; it never
    raises for want of a slot. A sharded publish waits as WAIT does instead, since one
    shard's skip aborts the version for its siblings."""

    WAIT = "wait"  # poll until a slot frees, at most `wait_timeout` (60 s unless given), then SlotWaitTimeoutError
    SKIP = "skip"  # publish nothing; the next version supersedes this one
    FAIL = "fail"  # raise NoFreeSlotError at once
    WAIT_THEN_SKIP = "wait_then_skip"  # poll as WAIT, at most `wait_timeout` (1 s unless given), then skip


def _when_full(value: object) -> object:
    try:
        return WhenFull(value)
    except ValueError:
        return value  # refused, with the others, by SlotSettings


@attrs.frozen
class SlotSettings:
    """A publisher's slots, and what it does when none is free.

    Args:
        num_slots: Slots to write versions into; at least 2 (one always holds the
            newest READY version).
        when_full: `WhenFull` (or its value: "wait_then_skip", "wait", "skip", "fail")
            when every slot holds a leased or the newest version; the default waits at
            most `wait_timeout`, then skips the version with a warning.
        wait_timeout: Seconds to wait for a slot, with WAIT_THEN_SKIP (then skip) or
            WAIT (then `SlotWaitTimeoutError`); finite, >= 0. None: 1 s with
            WAIT_THEN_SKIP (`DEFAULT_SKIP_AFTER`), 60 s with WAIT or a sharded publish
            (`DEFAULT_WAIT_TIMEOUT`).
        poll_interval: Seconds between looks for a free slot while waiting; finite, > 0.

    Raises:
        InvalidArgumentError: naming each argument that is wrong, and the fix.
    """

    num_slots: int = 2
    when_full: WhenFull = attrs.field(default=WhenFull.WAIT_THEN_SKIP, converter=_when_full)
    wait_timeout: float | None = None
    poll_interval: float = 0.05

    def __attrs_post_init__(self) -> None:
        problems = []
        if not isinstance(self.num_slots, int) or isinstance(self.num_slots, bool) or self.num_slots < 2:
            problems.append(
                f"num_slots must be an int >= 2 (one always holds the newest READY version), got {self.num_slots!r}"
            )
        if not isinstance(self.when_full, WhenFull):
            names = ", ".join(w.value for w in WhenFull)
            problems.append(f"when_full must be one of {names}; got {self.when_full!r}")
        wait_bad = non_finite("wait_timeout", self.wait_timeout, "a publish must not wait forever: pass a bound")
        poll_bad = non_finite("poll_interval", self.poll_interval, "pass the seconds between looks for a slot")
        if wait_bad is not None:
            problems.append(wait_bad)
        elif self.wait_timeout is not None and not (_number(self.wait_timeout) and self.wait_timeout >= 0):
            problems.append(f"wait_timeout must be >= 0 seconds or None, got {self.wait_timeout!r}")
        if poll_bad is not None:
            problems.append(poll_bad)
        elif not (_number(self.poll_interval) and self.poll_interval > 0):
            problems.append(f"poll_interval must be > 0 seconds, got {self.poll_interval!r}")
        refuse(problems, "SlotSettings")

    def wait_bound(self, *, sharded: bool = False) -> float:
        """The seconds a publish waits for a slot at most: `wait_timeout`, or the
        default of `when_full` (a sharded publish waits as WAIT does)."""
        if self.wait_timeout is not None:
            return self.wait_timeout
        if self.when_full is WhenFull.WAIT_THEN_SKIP and not sharded:
            return DEFAULT_SKIP_AFTER
        return DEFAULT_WAIT_TIMEOUT


@attrs.frozen
class PublisherSettings:
    """Everything a `Publisher` was given that a rule joins, checked together: what
    `Publisher` makes of its arguments (`Publisher.settings`).

    Args:
        slots: The slots and the policy when none is free (`SlotSettings`).
        digests: False records no digests; True BLAKE2b-128 of a host slot as bare hex;
            "blake2b128" or "wsum64" that kind.
        digester: Computes wsum64 digests where a device slot lies (`Digester`).
        device: Where the slots lie: "cpu", or a GPU ("cuda:0").

    Raises:
        InvalidArgumentError: naming every rule broken, and the fix.
    """

    slots: SlotSettings = attrs.field(factory=SlotSettings)
    digests: bool | str = False
    digester: Digester | None = None
    device: str = "cpu"

    def __attrs_post_init__(self) -> None:
        problems = []
        if not isinstance(self.digests, bool) and self.digests not in KINDS:
            problems.append(f"digests must be a bool or one of {', '.join(KINDS)}; got {self.digests!r}")
        elif self.digest_kind == BLAKE2B128 and self.device != "cpu":
            problems.append(
                f"{BLAKE2B128} digests are computed on host slots only, not on {self.device!r}: "
                f"pass digests={WSUM64!r} (computed on the slot's device) or device='cpu'"
            )
        elif self.digest_kind == WSUM64 and self.device != "cpu" and self.digester is None:
            problems.append(
                f"{WSUM64} digests of a slot on {self.device!r} are computed there: pass "
                f"digester={digester_hint()} (SnapshotPublisher does)"
            )
        refuse(problems, "Publisher")

    def check_fit(self, registry: Registry, *, stream: bool) -> None:
        """The rules that join these settings to the registry a publisher is made with.

        Raises:
            InvalidArgumentError: the registry cannot stream (`stream`).
        """
        if stream and not isinstance(registry, StreamingRegistry):
            raise InvalidArgumentError(f"{type(registry).__name__} cannot stream versions (stream=True)")

    @property
    def digest_kind(self) -> str | None:
        """The kind of digest recorded; None: none."""
        if self.digests is True:
            return BLAKE2B128
        return self.digests or None


S = TypeVar("S", LeaseSettings, RelaySettings, SlotSettings)


def merge(given: S | None, kind: type[S], flat: Mapping[str, Any], argument: str) -> S:
    """The settings object of a group, from the object given (`argument=`) and the flat
    keyword arguments of the same group given beside it (`flat`: only those passed). A
    flat argument that differs from the object's field is refused: say it once."""
    fields = {f.name for f in attrs.fields(kind)}
    unknown = sorted(set(flat) - fields)
    if unknown:  # a bug of the caller's, not the user's
        raise TypeError(f"{kind.__name__} has no {', '.join(unknown)}")
    if given is None:
        return kind(**flat)
    if not isinstance(given, kind):
        raise InvalidArgumentError(f"{argument} must be a {kind.__name__}, got {type(given).__name__}")
    clashes = [f"{k}={v!r}" for k, v in flat.items() if getattr(given, k) != v]
    if clashes:
        raise InvalidArgumentError(
            f"{', '.join(clashes)} contradicts {argument}={given!r}: give each setting once, "
            f"in {argument}= or as a keyword argument"
        )
    return given
