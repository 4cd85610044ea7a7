"""One reader key for a group of replicas: a name prefix (`reader rollout-*`). Each replica
acts under a name of its own that extends the prefix (`rollout-7`), never outside it, never
as a publisher; its liveness and serving reports are per concrete name. Bad patterns are
refused with typed errors, overlapping keys are refused, and exact names work as before:
in the principal, the registry machine, the keys directory, the CLI and over the wire."""

from __future__ import annotations

import json
import re

import pytest

from weightpull import Manifest, plan_layout
from weightpull.clock import FakeClock
from weightpull.errors import InvalidArgumentError, PermissionDeniedError
from weightpull.layout import TensorSpec
from weightpull.principals import Principal, Role, check_principal_pattern
from weightpull.registry_machine import RegistryMachine

zmq = pytest.importorskip("zmq")
from weightpull.drivers.zmq_registry import keys  # noqa: E402
from weightpull.drivers.zmq_registry.client import ZmqRegistry  # noqa: E402

from .served import ServedRegistry, cli, make_keys  # noqa: E402

GROUP = Principal.reader("rollout-*")


def manifest(version: int, publisher: str = "trainer") -> Manifest:
    return Manifest(version, plan_layout([TensorSpec("w", "uint8", (8,))]), "fake", b"{}", 0, publisher)


# -- the principal -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("*", "at least one character before its '\\*'"),
        ("roll*out", "one '\\*', at its end"),
        ("a**", "one '\\*', at its end"),
        ("rollout/x*", "1-63 letters"),
        ("-rollout*", "1-63 letters"),
        ("roll out*", "1-63 letters"),
        ("r" * 64 + "*", "1-63 letters"),
    ],
)
def test_a_bad_prefix_is_refused_with_a_typed_error_naming_the_rule(name, why):
    with pytest.raises(InvalidArgumentError, match=why):
        Principal.reader(name)
    with pytest.raises(InvalidArgumentError, match=why):
        keys.new("/nonexistent-never-made", "reader", name)  # refused before anything is written


@pytest.mark.parametrize("role", [Role.PUBLISHER, Role.ADMIN])
def test_only_a_reader_may_be_a_prefix(role):
    with pytest.raises(InvalidArgumentError, match="only a reader's name may be a prefix"):
        Principal(role, "trainer-*")
    assert check_principal_pattern("trainer-0", role) == "trainer-0"  # exact names as ever


def test_a_prefix_owns_each_name_extending_it_and_nothing_else():
    assert GROUP.is_prefix and not Principal.reader("rollout-7").is_prefix
    for owned in ("rollout-7", "rollout-7/puller-1", "rollout-abc.d_e"):
        assert GROUP.owns(owned), owned
    for other in ("rollout-", "rollout-*", "rollout", "eval-1", "xrollout-7", "rollout-7 x", "rollout-/a"):
        assert not GROUP.owns(other), other
    exact = Principal.reader("rollout-7")
    assert exact.owns("rollout-7/m") and not exact.owns("rollout-8")  # exact names unchanged
    assert Principal.from_dict(GROUP.to_dict()) == GROUP


# -- the registry machine ----------------------------------------------------------------


def test_replicas_sharing_a_prefix_key_act_under_their_own_names_and_live_apart():
    clock = FakeClock()
    m = RegistryMachine(clock, liveness_ttl=10.0)
    trainer = Principal.publisher("trainer")
    m.begin(1, publisher="trainer", slot=0, by=trainer)
    m.commit(manifest(1), by=trainer)

    lease = m.acquire(ttl=30.0, holder="rollout-1/puller-a", by=GROUP)
    m.report_serving("rollout-1", 1, by=GROUP)
    m.report_serving("rollout-2", 1, by=GROUP)
    status = m.status()
    assert status.serving == {"rollout-1": 1, "rollout-2": 1}
    assert "rollout-*" not in status.alive and {"rollout-1", "rollout-2"} <= set(status.alive)

    for name in ("eval-1", "rollout-", "trainer"):  # outside the prefix: refused, each with the rule
        with pytest.raises(PermissionDeniedError, match="reader rollout-\\* may not"):
            m.acquire(ttl=30.0, holder=name, by=GROUP)
        with pytest.raises(PermissionDeniedError):
            m.report_serving(name, 1, by=GROUP)
        with pytest.raises(PermissionDeniedError):
            m.keepalive([name], by=GROUP)
    with pytest.raises(PermissionDeniedError, match="readers cannot begin"):
        m.begin(2, publisher="rollout-1", slot=1, by=GROUP)
    with pytest.raises(PermissionDeniedError, match="held by 'rollout-1/puller-a'"):
        m.renew(lease, by=Principal.reader("eval-1"))

    # rollout-2 keeps beating, rollout-1 goes quiet: only rollout-1 leaves serving.
    for _ in range(3):
        clock.advance(4.0)
        m.keepalive(["rollout-2"], by=GROUP)
        m.keepalive(by=trainer)
    status = m.status()
    assert status.serving == {"rollout-2": 1}
    lapsed = {lapse.name for lapse in status.lapsed}
    assert "rollout-1" in lapsed and "rollout-2" not in lapsed and "rollout-*" not in lapsed
    m.renew(m.acquire(ttl=30.0, holder="rollout-3", by=GROUP), by=GROUP)  # a lease keeps its name alive too
    assert "rollout-3" in m.status().alive


# -- the keys directory and the CLI ----------------------------------------------------------


def test_keys_new_makes_a_prefix_key_with_shell_safe_files_and_refuses_overlaps(tmp_path):
    d = tmp_path / "keys"
    made = cli("keys", "new", "--role", "reader", "--name", "rollout-*", "--dir", str(d), "--json")
    assert made.returncode == 0, made.stderr
    paths = json.loads(made.stdout)
    assert paths["public"] == str(d / "rollout-+.key") and paths["secret"] == str(d / "rollout-+.key_secret")
    assert keys.load(d / "rollout-+.key").principal == GROUP
    human = cli("keys", "new", "--role", "reader", "--name", "eval-*", "--dir", str(d))
    assert human.returncode == 0 and "acts under a name of its own after 'eval-'" in human.stdout

    for role, name, clash in (
        ("reader", "rollout-7", "reader rollout-\\*"),  # covered by the prefix
        ("publisher", "rollout-x", "reader rollout-\\*"),
        ("reader", "rollout-a*", "reader rollout-\\*"),  # a narrower prefix
        ("reader", "roll*", "reader rollout-\\*"),  # a wider one
    ):
        with pytest.raises(InvalidArgumentError, match=f"{clash} .*would own names in common"):
            keys.new(d, role, name)
    keys.new(d, "reader", "replica-0")
    with pytest.raises(InvalidArgumentError, match="replica-0"):
        keys.new(d, "reader", "replica-*")  # a prefix over an exact name there
    for bad, why in (("*", "at least one character"), ("a*b", "one '\\*', at its end")):
        shown = cli("keys", "new", "--role", "reader", "--name", bad, "--dir", str(d), "--json")
        assert shown.returncode == 2
        error = json.loads(shown.stdout)["error"]
        assert error["type"] == "InvalidArgumentError" and re.search(why, error["message"])
    publisher = cli("keys", "new", "--role", "publisher", "--name", "trainer-*", "--dir", str(d))
    assert publisher.returncode == 2 and "only a reader's name may be a prefix" in publisher.stderr

    listed = {r["name"]: r for r in json.loads(cli("keys", "list", "--dir", str(d), "--json").stdout)}
    assert listed["rollout-*"]["role"] == "reader" and listed["rollout-*"]["secret"] is True
    assert set(keys.authorized(d).values()) == {GROUP, Principal.reader("eval-*"), Principal.reader("replica-0")}

    revoked = cli("keys", "revoke", "--name", "rollout-*", "--dir", str(d))
    assert revoked.returncode == 0 and (d / "revoked" / "rollout-+.key").exists()
    assert GROUP not in keys.authorized(d).values()


def test_a_prefix_placed_by_hand_over_another_keys_names_is_left_out(tmp_path):
    d = make_keys(tmp_path / "keys", ("reader", "rollout-7"))
    other = make_keys(tmp_path / "other", ("reader", "rollout-*"))
    (d / "rollout-+.key").write_bytes((other / "rollout-+.key").read_bytes())  # bypassing `keys new`
    admitted, refused = keys.scan(d)
    assert list(admitted.values()) == [Principal.reader("rollout-7")]
    (why,) = [r.why for r in refused.values() if "rollout-+" in r.known_as]
    assert "owns names that rollout-7" in why


# -- over the wire --------------------------------------------------------------------------


@pytest.mark.anyio
async def test_an_autoscaled_group_shares_one_key_over_the_wire(tmp_path, monkeypatch):
    served = ServedRegistry(
        tmp_path, keys=make_keys(tmp_path / "keys", ("publisher", "trainer"), ("reader", "rollout-*"))
    )
    served.start()
    group = {"key": str(served.keys / "rollout-+.key_secret"), "server_key": str(served.keys / "registry.key")}
    opts = {"timeout": 1.0, "retry_for": 5.0, "heartbeat": None}
    try:
        trainer = ZmqRegistry(served.address, **served.key("trainer"), **opts)
        await trainer.begin(1, publisher="trainer", slot=0)
        await trainer.commit(manifest(1))

        one = ZmqRegistry(served.address, **group, name="rollout-1", **opts)
        monkeypatch.setenv(keys.NAME_ENV, "rollout-2")
        two = ZmqRegistry(served.address, **group, **opts)
        monkeypatch.delenv(keys.NAME_ENV)
        fresh = ZmqRegistry(served.address, **group, **opts)
        assert one.principal == Principal.reader("rollout-1") and two.principal == Principal.reader("rollout-2")
        assert fresh.principal.name.startswith("rollout-") and len(fresh.principal.name) == len("rollout-") + 8
        assert one.key_principal == GROUP

        for reg in (one, two, fresh):
            lease = await reg.acquire(ttl=10.0, holder=f"{reg.principal.name}/puller")
            await reg.report_serving(reg.principal.name, 1)
            await reg.release(lease)
        status = await trainer.status()
        assert status.serving == {r.principal.name: 1 for r in (one, two, fresh)}
        assert "rollout-*" not in status.alive

        with pytest.raises(PermissionDeniedError, match="reader rollout-\\* may not acquire"):
            await one.acquire(ttl=10.0, holder="trainer")
        with pytest.raises(PermissionDeniedError, match="readers cannot begin"):
            await one.begin(2, publisher="rollout-1", slot=1)
        for reg in (trainer, one, two, fresh):
            await reg.aclose()

        with pytest.raises(InvalidArgumentError, match="must be the prefix 'rollout-' then"):
            ZmqRegistry(served.address, **group, name="eval-1")
        with pytest.raises(InvalidArgumentError, match="acts as: drop it"):
            ZmqRegistry(served.address, **served.key("trainer"), name="rollout-1")
    finally:
        served.stop()
