"""The grouped settings of Puller, SlicePuller and Publisher: every rule raises
InvalidArgumentError naming the argument (all the rules one object breaks, together),
the flat keyword arguments and the settings objects behave the same, and a flat
argument that contradicts the settings object beside it is refused."""

from __future__ import annotations

import pytest

from weightpull import InvalidArgumentError, Publisher, Puller, TornReadError
from weightpull.drivers.fake import FakeFaults
from weightpull.errors import NoFreeSlotError
from weightpull.leasing import LeaseClient, LeaseSettings
from weightpull.publisher import SlotSettings, WhenFull
from weightpull.relaying import RelayServer, RelaySettings
from weightpull.settings import PublisherSettings, PullerSettings
from weightpull.slice_puller import SlicePuller

from .conftest import autojump, host_tensors
from .test_slice_puller import SPECS
from .test_slices import _slice

RANK = _slice(SPECS, 0, 1, 2)


def digester(region, spans):
    return ["wsum64:0"] * len(spans)


@pytest.mark.parametrize(
    ("kw", "named"),
    [
        ({"ttl": 0.0}, "ttl must be positive"),
        ({"ttl": -1.0}, "ttl must be positive"),
        ({"ttl": "10"}, "ttl must be positive"),
        ({"stall_timeout": 0.0}, "stall_timeout must be positive or None"),
        ({"stall_timeout": -3}, "stall_timeout must be positive or None"),
        ({"ttl": 5.0, "renew_every": 5.0}, r"renew_every must be in \(0, ttl=5.0\)"),
        ({"ttl": 5.0, "renew_every": -1.0}, r"renew_every must be in \(0, ttl=5.0\)"),
        ({"renew_every": "often"}, "renew_every must be a number of seconds"),
    ],
)
def test_each_lease_rule_names_its_argument(kw, named):
    with pytest.raises(InvalidArgumentError, match=named):
        LeaseSettings(**kw)


def test_every_lease_rule_broken_is_named_at_once():
    with pytest.raises(InvalidArgumentError, match="LeaseSettings: 2 problems") as caught:
        LeaseSettings(ttl=5.0, renew_every=6.0, stall_timeout=0.0)
    assert "renew_every" in str(caught.value) and "stall_timeout" in str(caught.value)


def test_the_renewal_interval_is_a_third_of_the_ttl_unless_set():
    assert LeaseSettings(ttl=9.0).renew_interval == 3.0
    assert LeaseSettings(ttl=9.0, renew_every=1.0).renew_interval == 1.0
    assert LeaseSettings(stall_timeout=None).stall_timeout is None


@pytest.mark.parametrize(
    ("kw", "named"),
    [
        ({"host": ""}, "host must be a non-empty string"),
        ({"host": 3}, "host must be a non-empty string"),
        ({"relay": True}, r"relay=True\) with host= and stream=True"),
        ({"spare_mirror": True}, "a spare mirror is for a relay's readers: it needs host="),
    ],
)
def test_each_relay_rule_names_its_argument(kw, named):
    with pytest.raises(InvalidArgumentError, match=named):
        RelaySettings(**kw)


def test_every_relay_rule_broken_is_named_at_once():
    with pytest.raises(InvalidArgumentError, match="RelaySettings: 2 problems") as caught:
        RelaySettings(relay=True, spare_mirror=True)
    assert "relay=True" in str(caught.value) and "spare mirror" in str(caught.value)


@pytest.mark.parametrize(
    ("kw", "named"),
    [
        ({"device": "cuda:0", "verify_digests": True}, "or on 'cuda:0' by digester="),
        ({"device": "cuda:0", "relaying": RelaySettings(host="h")}, "reading from relays .host=. checks every bucket"),
        ({"relaying": RelaySettings(host="h", relay=True)}, r"relay=True\) with host= and stream=True"),
    ],
)
def test_each_rule_across_a_pullers_settings_names_its_arguments(kw, named):
    with pytest.raises(InvalidArgumentError, match=named):
        PullerSettings(**kw)
    fixed = dict(kw, digester=digester, stream=True)  # the fix each message names
    assert PullerSettings(**fixed)


def test_every_rule_a_puller_breaks_is_named_at_once(world):
    with pytest.raises(InvalidArgumentError, match="Puller: 3 problems") as caught:
        Puller(world.registry, world.transport(), device="cuda:0", verify_digests=True, host="h", relay=True)
    message = str(caught.value)
    assert "verify_digests" in message and "reading from relays" in message and "stream=True" in message


@pytest.mark.parametrize(
    ("kw", "named"),
    [
        ({"num_slots": 1}, "num_slots must be an int >= 2"),
        ({"num_slots": 2.0}, "num_slots must be an int >= 2"),
        ({"num_slots": True}, "num_slots must be an int >= 2"),
        ({"when_full": "later"}, "when_full must be one of wait, skip, fail, wait_then_skip; got 'later'"),
        ({"wait_timeout": -1.0}, "wait_timeout must be >= 0"),
        ({"poll_interval": 0.0}, "poll_interval must be > 0"),
    ],
)
def test_each_slot_rule_names_its_argument(kw, named, world):
    with pytest.raises(InvalidArgumentError, match=named):
        SlotSettings(**kw)
    with pytest.raises(InvalidArgumentError, match=named):  # the flat form, the same rule
        world.publisher(**kw)


def test_every_slot_rule_broken_is_named_at_once():
    with pytest.raises(InvalidArgumentError, match="SlotSettings: 4 problems"):
        SlotSettings(num_slots=1, when_full="x", wait_timeout=-1, poll_interval=0)
    assert SlotSettings(when_full="skip").when_full is WhenFull.SKIP


@pytest.mark.parametrize(
    ("kw", "named"),
    [
        ({"digests": "md5"}, "digests must be a bool or one of blake2b128, wsum64"),
        ({"digests": True, "device": "cuda:0"}, "host slots only, not on 'cuda:0': pass digests='wsum64'"),
        ({"digests": "wsum64", "device": "cuda:0"}, "pass digester=weightpull.integrations.torch_digests"),
    ],
)
def test_each_rule_across_a_publishers_settings_names_its_arguments(kw, named):
    with pytest.raises(InvalidArgumentError, match=named):
        PublisherSettings(**kw)


def test_a_publishers_rules_across_groups_are_named_with_its_slots(world):
    with pytest.raises(InvalidArgumentError, match="num_slots"):  # the group's own rule first
        world.publisher(num_slots=1, digests="md5")
    assert PublisherSettings(digests="wsum64", device="cuda:0", digester=digester).digest_kind == "wsum64"


def flat_or_grouped(world, form, **lease):
    if form == "flat":
        return Puller(
            world.registry, world.transport(faults=FakeFaults(tear_reads=1, freeze=6.0)), clock=world.clock, **lease
        )
    return Puller(
        world.registry,
        world.transport(faults=FakeFaults(tear_reads=1, freeze=6.0)),
        clock=world.clock,
        lease=LeaseSettings(**lease),
    )


@pytest.mark.anyio
@pytest.mark.parametrize("form", ["flat", "grouped"])
async def test_flat_and_grouped_lease_settings_hold_leases_alike(world, form):
    """ttl=5 s: a read frozen 6 s is torn, in either form; with a TTL of 10 s it holds."""
    await world.publisher().publish(1, host_tensors(1))
    short = flat_or_grouped(world, form, ttl=5.0)
    assert short.settings == flat_or_grouped(world, "flat", ttl=5.0).settings
    assert (short.ttl, short.renew_every, short.stall_timeout) == (5.0, 5.0 / 3, 30.0)
    async with autojump(world.clock):
        with pytest.raises(TornReadError, match="lapsed"):
            await short.pull()
        long = flat_or_grouped(world, form, ttl=20.0, stall_timeout=None)
        assert (await long.pull()).renewals > 0


@pytest.mark.anyio
@pytest.mark.parametrize("form", ["flat", "grouped"])
async def test_flat_and_grouped_slot_settings_publish_alike(world, form):
    kw = {"num_slots": 2, "when_full": "fail"}
    publisher = world.publisher(**kw) if form == "flat" else world.publisher(slot_settings=SlotSettings(**kw))
    assert len(publisher.slots) == 2 and publisher.when_full is WhenFull.FAIL
    await publisher.publish(1, host_tensors(1))
    reader = world.puller()
    lease = await world.registry.acquire(1, ttl=60.0, holder=reader.holder)
    await publisher.publish(2, host_tensors(2))
    with pytest.raises(NoFreeSlotError):  # v1 leased, v2 the newest: no slot for v3
        await publisher.publish(3, host_tensors(3))
    await world.registry.release(lease)


def test_flat_and_grouped_relay_settings_are_one(world):
    flat = Puller(world.registry, world.transport(), host="h", stream=True, relay=True, relay_cap=3)
    grouped = Puller(
        world.registry, world.transport(), stream=True, relaying=RelaySettings(host="h", relay=True, relay_cap=3)
    )
    assert flat.settings == grouped.settings
    assert (grouped.host, grouped.relay, grouped.relay_cap, grouped.spare_mirror) == ("h", True, 3, False)
    assert isinstance(grouped.relays, RelayServer) and isinstance(grouped.leases, LeaseClient)


def test_a_flat_argument_that_contradicts_its_settings_object_is_refused(world):
    transport = world.transport()
    with pytest.raises(InvalidArgumentError, match=r"ttl=6.0 contradicts lease=LeaseSettings\(ttl=5.0"):
        Puller(world.registry, transport, lease=LeaseSettings(ttl=5.0), ttl=6.0)
    with pytest.raises(InvalidArgumentError, match="relay_cap=2 contradicts relaying="):
        Puller(world.registry, transport, relaying=RelaySettings(host="h"), relay_cap=2)
    with pytest.raises(InvalidArgumentError, match="num_slots=3 contradicts slot_settings="):
        world.publisher(slot_settings=SlotSettings(num_slots=2), num_slots=3)
    with pytest.raises(InvalidArgumentError, match="stall_timeout=None contradicts lease="):
        SlicePuller(world.registry, transport, RANK, lease=LeaseSettings(), stall_timeout=None)
    # The same value twice says nothing new: taken.
    assert Puller(world.registry, transport, lease=LeaseSettings(ttl=5.0), ttl=5.0).ttl == 5.0
    with pytest.raises(InvalidArgumentError, match="lease must be a LeaseSettings, got float"):
        Puller(world.registry, transport, lease=5.0)


def test_an_argument_no_one_takes_is_a_type_error(world):
    with pytest.raises(TypeError, match="'tll'"):
        Puller(world.registry, world.transport(), tll=5.0)
    with pytest.raises(TypeError, match="'ttl'"):
        Publisher(world.registry, world.transport(), ttl=5.0)
    with pytest.raises(TypeError, match="'spare_mirror'"):  # a slice's relay keeps no spare mirror
        SlicePuller(world.registry, world.transport(), RANK, host="h", spare_mirror=True)


def test_a_slice_puller_takes_its_lease_settings_either_way(world):
    transport = world.transport()
    flat = SlicePuller(world.registry, transport, RANK, ttl=6.0, renew_every=1.0)
    grouped = SlicePuller(world.registry, transport, RANK, lease=LeaseSettings(6.0, 1.0))
    assert (flat.ttl, flat.renew_every) == (grouped.ttl, grouped.renew_every) == (6.0, 1.0)
    assert flat.leases.settings == grouped.leases.settings
    with pytest.raises(InvalidArgumentError, match="renew_every"):
        SlicePuller(world.registry, transport, RANK, ttl=5.0, renew_every=5.0)


def test_the_rules_joining_a_pullers_settings_to_its_registry_are_named_at_once(world):
    class Plain:  # a Registry of someone else's that knows neither streams nor relays
        pass

    with pytest.raises(InvalidArgumentError, match="Puller: 2 problems") as caught:
        Puller(Plain(), world.transport(), stream=True, host="h")
    assert "Plain cannot stream versions (stream=True)" in str(caught.value)
    assert "Plain hands out no sources (host=)" in str(caught.value)
    with pytest.raises(InvalidArgumentError, match="Plain cannot stream versions"):
        Publisher(Plain(), world.transport(), stream=True)
