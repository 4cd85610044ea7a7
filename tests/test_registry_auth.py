"""Principals at a served registry: CURVE keys made by `weightpull keys`, refused when
unknown or revoked (while the server runs), each authority rule enforced over the wire
with a typed error, liveness that withdraws a dead publisher's version, the development
mode, and the deprecated shared secret."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time

import anyio
import pytest

from weightpull import Lease, Manifest, NoReadyVersionError, VersionState, plan_layout
from weightpull.errors import AuthenticationError, InvalidArgumentError, PermissionDeniedError, VersionNotFoundError
from weightpull.layout import TensorSpec
from weightpull.principals import ADMIN, Principal

zmq = pytest.importorskip("zmq")
from weightpull.drivers.zmq_registry import keys, wire  # noqa: E402
from weightpull.drivers.zmq_registry.client import ZmqRegistry  # noqa: E402
from weightpull.drivers.zmq_registry.server import RegistryServer  # noqa: E402

from .served import SECRET, ServedRegistry, cli, env, make_keys  # noqa: E402

pytestmark = pytest.mark.anyio

PRINCIPALS = (
    ("publisher", "trainer"),
    ("publisher", "rival"),
    ("reader", "replica-0"),
    ("reader", "replica-1"),
    ("admin", "ops"),
)


@pytest.fixture
def keyed(tmp_path):
    served = ServedRegistry(tmp_path, keys=make_keys(tmp_path / "keys", *PRINCIPALS))
    served.start()
    yield served
    if served.alive():
        served.stop()


def client(served: ServedRegistry, name: str, **kw) -> ZmqRegistry:
    kw.setdefault("timeout", 0.5)
    kw.setdefault("retry_for", 5.0)
    kw.setdefault("heartbeat", None)
    return ZmqRegistry(served.address, **served.key(name), **kw)


def manifest(version: int, slot: int = 0, publisher: str = "trainer") -> Manifest:
    return Manifest(version, plan_layout([TensorSpec("w", "uint8", (8,))]), "fake", b"{}", slot, publisher)


# -- keys ------------------------------------------------------------------------------


def test_keys_new_list_and_revoke(tmp_path):
    d = tmp_path / "k"
    made = cli("keys", "new", "--role", "reader", "--name", "replica-0", "--dir", str(d), "--json")
    assert made.returncode == 0, made.stderr
    paths = json.loads(made.stdout)
    public, secret = d / "replica-0.key", d / "replica-0.key_secret"
    assert (paths["public"], paths["secret"]) == (str(public), str(secret))
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    pub, sec = keys.load(public), keys.load(secret)
    assert sec.secret is not None and pub.secret is None and pub.public == sec.public
    assert pub.principal == sec.principal == Principal.reader("replica-0")
    assert zmq.auth.load_certificate(str(secret)) == (sec.public, sec.secret)  # zmq reads it as ever

    again = cli("keys", "new", "--role", "reader", "--name", "replica-0", "--dir", str(d))
    assert again.returncode == 2 and "refusing to overwrite" in again.stderr
    other_role = cli("keys", "new", "--role", "admin", "--name", "replica-0", "--dir", str(d))
    assert other_role.returncode == 2 and "as reader replica-0" in other_role.stderr
    bad = cli("keys", "new", "--role", "reader", "--name", "a/b", "--dir", str(d))
    assert bad.returncode == 2 and "a principal's name" in bad.stderr
    assert keys.load(secret).secret == sec.secret  # untouched by the refusals

    cli("keys", "new", "--role", "server", "--name", "registry", "--dir", str(d))
    listed = json.loads(cli("keys", "list", "--dir", str(d), "--json").stdout)
    assert [(r["name"], r["role"], r["revoked"]) for r in listed] == [
        ("registry", "server", False),
        ("replica-0", "reader", False),
    ]
    assert keys.authorized(d) == {pub.public: Principal.reader("replica-0")}  # not the server's own

    revoked = cli("keys", "revoke", "--name", "replica-0", "--dir", str(d))
    assert revoked.returncode == 0 and not public.exists() and (d / "revoked" / "replica-0.key").exists()
    assert keys.authorized(d) == {}
    human = cli("keys", "list", "--dir", str(d)).stdout
    assert "replica-0" in human and "revoked" in human
    reuse = cli("keys", "new", "--role", "reader", "--name", "replica-0", "--dir", str(d))
    assert reuse.returncode == 2 and "(revoked)" in reuse.stderr
    missing = cli("keys", "revoke", "--name", "nobody", "--dir", str(d))
    assert missing.returncode == 2 and "no key named 'nobody'" in missing.stderr


# -- who may connect -----------------------------------------------------------------------


async def test_a_client_acts_as_the_principal_its_key_names(keyed):
    for name, principal in (
        ("trainer", Principal.publisher("trainer")),
        ("replica-0", Principal.reader("replica-0")),
        ("ops", Principal.admin("ops")),
    ):
        reg = client(keyed, name)
        assert reg.principal == principal
        await reg.ping()
        await reg.aclose()
    assert ZmqRegistry("tcp://127.0.0.1:1").principal == ADMIN  # no key: an admin (to a dev server)


async def test_unknown_keys_a_wrong_server_key_and_a_missing_key_are_refused_at_once(keyed, tmp_path):
    stranger = make_keys(tmp_path / "elsewhere", ("reader", "stranger"))
    cases = [
        (
            {"key": stranger / "stranger.key_secret", "server_key": keyed.keys / "registry.key"},
            "refused the key of reader stranger",
        ),
        (
            {"key": keyed.keys / "ops.key_secret", "server_key": stranger / "registry.key"},
            "the server key .* is likely not this server's",
        ),
        ({}, "takes keys and this client has none"),
    ]
    for options, match in cases:
        reg = ZmqRegistry(keyed.address, timeout=2.0, retry_for=10.0, **options)
        started = time.monotonic()
        with pytest.raises(AuthenticationError, match=match):
            await reg.status()
        assert time.monotonic() - started < 2.0  # told, not timed out
        await reg.aclose()
    log = keyed.log()
    # Each refusal named in the server's log: which key and why, even those that fail before ZAP.
    assert f"by key {keys.load(stranger / 'stranger.key').public[:8].decode()}...: unknown key" in log
    assert "a client whose server key is not this server's public key" in log
    assert "a client without a key" in log or "hung up during the handshake" in log  # whichever side saw it first

    shown = await anyio.to_thread.run_sync(
        lambda: cli(
            "status",
            "--registry",
            keyed.address,
            "--key",
            str(stranger / "stranger.key_secret"),
            "--server-key",
            str(keyed.keys / "registry.key"),
            secret=None,
        )
    )
    assert shown.returncode == 1 and "refused the key of reader stranger" in shown.stderr


async def test_a_keyed_client_of_a_server_without_keys_is_told_so(tmp_path):
    served = ServedRegistry(tmp_path, secret=None)  # --insecure-dev
    served.start()
    k = make_keys(tmp_path / "keys", ("admin", "ops"))
    try:
        reg = ZmqRegistry(served.address, key=k / "ops.key_secret", server_key=k / "registry.key", retry_for=5.0)
        with pytest.raises(AuthenticationError, match="takes no keys"):
            await reg.status()
        await reg.aclose()
    finally:
        served.stop()


async def test_keys_added_and_revoked_take_effect_while_the_server_runs(keyed):
    keys.new(keyed.keys, "reader", "late")
    late = client(keyed, "late")
    await late.ping()  # added after the server started: admitted at its handshake
    reader = client(keyed, "replica-0")
    await reader.ping()  # connected, its socket kept for the next call
    shown = await anyio.to_thread.run_sync(
        lambda: cli("keys", "revoke", "--name", "replica-0", "--dir", str(keyed.keys))
    )
    assert shown.returncode == 0
    with pytest.raises(AuthenticationError, match="no longer authorized"):
        await reader.acquire(ttl=5.0, holder="replica-0")  # on the connection made before
    await reader.aclose()
    moved = keyed.keys / "revoked"
    again = ZmqRegistry(
        keyed.address, key=moved / "replica-0.key_secret", server_key=keyed.keys / "registry.key", timeout=2.0
    )
    with pytest.raises(AuthenticationError, match="refused the key of reader replica-0"):
        await again.ping()  # a new connection: refused at the handshake
    await again.aclose()
    await late.ping()  # the others are untouched
    await late.aclose()


async def test_traffic_is_encrypted_so_a_plain_zmq_client_cannot_talk_to_it(keyed):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, 1000)  # once its handshake failed, the socket has no peer to queue for
    sock.connect(keyed.address)
    request = wire.Request("raw-1", "status", {}, None)
    for key in (b"", SECRET):  # well formed, in the development and the secret framing
        with contextlib.suppress(zmq.Again):  # no peer left to send to: refused all the same
            sock.send_multipart(wire.encode_request(key, request.retry(None)))
    assert sock.poll(1500) == 0  # no reply: no handshake, so nothing reached the registry
    sock.close()
    assert "refused a message" not in keyed.log()


# -- authority, over the wire ----------------------------------------------------------------------


async def test_each_authority_rule_holds_over_the_wire(keyed):
    trainer, rival = client(keyed, "trainer"), client(keyed, "rival")
    reader, other_reader, admin = client(keyed, "replica-0"), client(keyed, "replica-1"), client(keyed, "ops")
    assert await trainer.begin(1, publisher="trainer", slot=0) == 1
    await trainer.commit(manifest(1))
    assert await trainer.begin(2, publisher="trainer/rank1", slot=1) == 2  # a name below its own
    lease = await reader.acquire(ttl=30.0, holder="replica-0")
    await reader.report_serving("replica-0", 1)
    (listed,) = (await other_reader.status()).leases  # its id is there for anyone to read

    async def refused(call, rule: str) -> None:
        with pytest.raises(PermissionDeniedError, match=rule) as info:
            await call
        assert isinstance(info.value, PermissionError)  # typed across the wire

    readers_cannot = "readers cannot begin or end versions"
    await refused(reader.begin(3, publisher="replica-0", slot=0), readers_cannot)
    await refused(reader.abort(2, "no"), readers_cannot)
    await refused(reader.retire(1), readers_cannot)
    await refused(reader.reclaim(1), readers_cannot)
    stolen = Lease(listed.id, listed.version, listed.holder, 30.0, 0.0)
    await refused(other_reader.renew(stolen), "held by 'replica-0'")
    await refused(other_reader.release(stolen), "held by 'replica-0'")
    await refused(other_reader.acquire(ttl=5.0, holder="replica-0"), "only under its own names")
    await refused(other_reader.report_serving("replica-0", 7), "only what it serves itself")
    await refused(rival.begin(3, publisher="trainer", slot=5), "only under its own name")
    await refused(rival.abort(2, "sabotage"), "belongs to publisher 'trainer'")
    await refused(rival.retire(1), "belongs to publisher 'trainer'")
    await refused(rival.commit(manifest(2, slot=1, publisher="trainer/rank1")), "belongs to publisher 'trainer'")
    await refused(rival.acquire(ttl=5.0, holder="replica-1"), "only under its own names")
    await refused(rival.keepalive(("trainer",)), "only its own names")

    status = await admin.status()
    assert [(v.version, v.state) for v in status.versions] == [(1, VersionState.READY), (2, VersionState.WRITING)]
    assert status.serving == {"replica-0": 1} and [x.id for x in status.leases] == [lease.id]
    assert "refused" in keyed.log() and "PermissionDeniedError" not in keyed.log()  # the machine logs its rule

    # A rival asking for the trainer's next number gets another: it cannot make it fail.
    assert await rival.begin(3, publisher="rival", slot=0) == 3
    assert await trainer.begin(3, publisher="trainer", slot=2) == 4

    # The owner, and an admin for anyone, may.
    assert (await other_reader.acquire(ttl=5.0, holder="replica-1/rank0")).holder == "replica-1/rank0"
    await reader.renew(lease)
    await admin.release(lease)
    await admin.report_serving("replica-1", 1)
    await trainer.commit(manifest(2, slot=1, publisher="trainer/rank1"))
    await admin.abort(3, "by the operator")
    await admin.retire(2)
    assert {v.version: v.state for v in (await admin.status()).versions}[2] is VersionState.RETIRED
    for reg in (trainer, rival, reader, other_reader, admin):
        await reg.aclose()


async def test_a_second_publisher_cannot_take_the_trainers_readers(keyed):
    """The case as a user met it: the trainer's v2 is READY; a rival with a publisher key
    begins and commits a version of its own (far ahead in number), then retires it. The
    trainer's v2 stays READY throughout, a reader that names the trainer keeps reading
    the trainer's bytes and never sees the rival's, one that names no one follows the
    default line (the rival's while its version is the last announced: the docs say to
    name the publisher) and falls back to the trainer's once the rival's goes, and the
    trainer's next number is its own. Before lines, the rival's commit retired v2 and its
    retire left nothing READY for anyone."""
    from weightpull import Publisher, Puller
    from weightpull.drivers.fake import FakeFabric, FakeTransport

    from .conftest import host_tensors

    fabric = FakeFabric()
    async with (
        client(keyed, "trainer") as trainer,
        client(keyed, "rival") as rival,
        client(keyed, "replica-0") as reader,
        client(keyed, "replica-1") as other,
    ):
        publisher = Publisher(trainer, FakeTransport(fabric=fabric), rollout_dtype=None, num_slots=3)
        await publisher.publish(1, host_tensors(1))
        await publisher.publish(2, host_tensors(2))
        named = Puller(reader, FakeTransport(fabric=fabric), holder="replica-0", publisher="trainer")
        unnamed = Puller(other, FakeTransport(fabric=fabric), holder="replica-1")
        assert (await unnamed.pull()).version == 2

        bogus = await rival.begin(10**9, publisher="rival", slot=0)
        await rival.commit(Manifest(bogus, plan_layout([TensorSpec("w", "uint8", (8,))]), "fake", b"{}", 0, "rival"))
        status = await reader.status()
        assert {v.version: v.state for v in status.versions} == {
            1: VersionState.RETIRED,
            2: VersionState.READY,
            bogus: VersionState.READY,
        }
        pulled = await named.pull()
        assert pulled.version == 2 and bytes(pulled.view("t1")) == host_tensors(2)["t1"].data
        with pytest.raises(VersionNotFoundError, match="'trainer' has no version"):
            await named.pull(bogus)  # not even by its number
        assert (await other.newest()).version == bogus  # the default line: the last announced

        await rival.retire(bogus)
        assert (await reader.newest()).version == 2  # the default line falls back to the trainer's
        assert (await reader.newest(publisher="trainer")).version == 2
        assert (await publisher.publish(3, host_tensors(3))).version == 3  # its numbers are its own
        assert (await named.pull()).version == (await unnamed.pull()).version == 3
        await publisher.aclose()
    assert "withdrawn" not in keyed.log()


# -- liveness ---------------------------------------------------------------------------------

PUBLISHING = textwrap.dedent("""
    import anyio, sys
    from weightpull import Manifest, plan_layout
    from weightpull.layout import TensorSpec
    from weightpull.drivers.zmq_registry.client import ZmqRegistry

    async def main():
        async with ZmqRegistry(sys.argv[1], heartbeat=0.2) as reg:  # $WEIGHTPULL_KEY: publisher trainer
            assert str(reg.principal) == "publisher trainer"
            layout = plan_layout([TensorSpec("w", "uint8", (8,))])
            number = await reg.begin(1, publisher="trainer", slot=0)
            await reg.commit(Manifest(number, layout, "fake", b"{}", 0, "trainer", step=1))
            print(number, flush=True)
            await anyio.sleep_forever()  # idle between publishes; its heartbeat keeps it alive

    anyio.run(main)
""")


async def test_a_publisher_killed_while_idle_has_its_version_withdrawn_after_the_liveness_ttl(tmp_path):
    ttl = 1.5
    served = ServedRegistry(tmp_path, keys=make_keys(tmp_path / "keys", *PRINCIPALS), args=("--liveness-ttl", str(ttl)))
    served.start()
    trainer_env = env(
        None,
        WEIGHTPULL_KEY=str(served.keys / "trainer.key_secret"),
        WEIGHTPULL_SERVER_KEY=str(served.keys / "registry.key"),
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", PUBLISHING, served.address], env=trainer_env, stdout=subprocess.PIPE, text=True
    )
    reader = client(served, "replica-0")
    try:
        assert (await anyio.to_thread.run_sync(proc.stdout.readline)).strip() == "1"
        await anyio.sleep(2 * ttl)  # alive past the TTL: its heartbeat renews it
        assert (await reader.acquire(ttl=5.0, holder="replica-0")).version == 1
        status = await reader.status()
        assert status.newest_ready == 1 and status.alive["trainer"] > 0

        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        await anyio.sleep(ttl + 0.5)
        status = await reader.status()
        (v1,) = status.versions
        assert v1.state is VersionState.RETIRED and status.newest_ready is None
        assert "publisher 'trainer' lapsed" in v1.reason and v1.reason.startswith("withdrawn")
        assert status.alive["trainer"] <= 0
        with pytest.raises(NoReadyVersionError, match="v1 was withdrawn: publisher 'trainer' lapsed"):
            await reader.acquire(ttl=5.0, holder="replica-0")

        shown = await anyio.to_thread.run_sync(
            lambda: cli("status", "--registry", served.address, *_key_args(served, "ops"), secret=None)
        )
        assert shown.returncode == 0, shown.stderr
        assert "withdrawn: publisher 'trainer' lapsed" in shown.stdout and "LAPSED" in shown.stdout
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()
        await reader.aclose()
        served.stop()


def _key_args(served: ServedRegistry, name: str) -> tuple[str, ...]:
    options = served.key(name)
    return ("--key", options["key"], "--server-key", options["server_key"])


async def test_a_reader_that_stops_leaves_serving_after_the_ttl_and_one_that_beats_stays(tmp_path):
    ttl = 1.0
    served = ServedRegistry(tmp_path, keys=make_keys(tmp_path / "keys", *PRINCIPALS), args=("--liveness-ttl", str(ttl)))
    served.start()
    try:
        beating, silent = client(served, "replica-0", heartbeat=0.2), client(served, "replica-1")
        await beating.report_serving("replica-0", 1)
        await silent.report_serving("replica-1", 1)
        await anyio.sleep(2 * ttl)
        assert (await beating.status()).serving == {"replica-0": 1}
        await silent.aclose()
        await beating.aclose()
    finally:
        served.stop()


# -- the development mode and the deprecated secret -------------------------------------------------


def test_the_development_mode_binds_loopback_only():
    with pytest.raises(InvalidArgumentError, match="loopback addresses only"):
        RegistryServer("tcp://0.0.0.0:0", insecure_dev=True)
    with pytest.raises(InvalidArgumentError, match="pick one way"):
        RegistryServer("tcp://127.0.0.1:0", insecure_dev=True, secret=b"s")
    assert RegistryServer("tcp://127.0.0.1:0", insecure_dev=True).mode == "dev"


async def test_the_deprecated_secret_still_works_and_warns(tmp_path):
    with pytest.warns(DeprecationWarning, match="shared secret is deprecated"):
        RegistryServer("tcp://0.0.0.0:0", secret=b"s")  # not loopback: a secret still allows it
    served = ServedRegistry(tmp_path)  # $WEIGHTPULL_SECRET
    served.start()
    try:
        assert "warning: a shared secret" in served.log() and "deprecated" in served.log()
        with pytest.warns(DeprecationWarning, match="deprecated"):
            reg = ZmqRegistry(served.address, secret=SECRET, heartbeat=None)
        assert reg.principal == ADMIN
        assert await reg.begin(1, publisher="anyone", slot=0) == 1  # as admin: any name
        await reg.commit(manifest(1, publisher="anyone"))
        assert (await reg.acquire(ttl=5.0, holder="whoever")).version == 1
        await reg.aclose()
        os.environ.pop("WEIGHTPULL_KEY", None)
        with pytest.warns(DeprecationWarning):
            ZmqRegistry(served.address, secret=b"wrong")
    finally:
        served.stop()
