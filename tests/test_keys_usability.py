"""What a served registry's client and server say when a connection goes wrong: a call to
an address where nothing listens fails within `connect_timeout` (not the 37 s of retries
meant for a restart) and asks whether `registry serve` runs there; a key path from the
environment is named as coming from it; a secret certificate given where the server's
public one belongs is refused, naming the file to pass; and the server logs each refused
handshake (which key, why) at most once a minute per key and reason, on its clock."""

from __future__ import annotations

import json
import logging
import socket
import time

import anyio
import pytest

from weightpull.clock import FakeClock
from weightpull.errors import AuthenticationError, InvalidArgumentError, RegistryUnavailableError
from weightpull.registry import InProcessRegistry, connect_registry

zmq = pytest.importorskip("zmq")
from weightpull.drivers.zmq_registry import keys  # noqa: E402
from weightpull.drivers.zmq_registry.client import DEFAULT_CONNECT_TIMEOUT, ZmqRegistry  # noqa: E402
from weightpull.drivers.zmq_registry.server import REFUSAL_LOG_EVERY, RefusalLog, RegistryServer  # noqa: E402

from .served import cli, make_keys  # noqa: E402

HINT = "is `weightpull registry serve` running there?"


def free_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
def no_env(monkeypatch):
    for name in ("WEIGHTPULL_KEY", "WEIGHTPULL_SERVER_KEY", "WEIGHTPULL_SECRET", "WEIGHTPULL_NAME"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


# -- nothing listening ---------------------------------------------------------------------


@pytest.mark.anyio
async def test_a_call_to_nothing_fails_within_the_connect_timeout_with_the_hint(no_env):
    assert DEFAULT_CONNECT_TIMEOUT == 5.0  # what the docs promise
    address = free_address()
    reg = connect_registry(address, heartbeat=None)  # the defaults: retry_for 30 s
    started = time.monotonic()
    with pytest.raises(RegistryUnavailableError, match="within 5 s \\(it never answered this client\\)") as err:
        await reg.wait_for_version(1, timeout=60.0)  # a long poll: 3 attempts of 12 s before
    took = time.monotonic() - started
    assert 4.5 < took < 7.0, took
    assert HINT in str(err.value) and address in str(err.value)
    await reg.aclose()


@pytest.mark.anyio
async def test_a_longer_connect_timeout_waits_for_a_server_that_starts_late(no_env):
    address = free_address()
    short = ZmqRegistry(address, timeout=0.3, connect_timeout=0.5, heartbeat=None)
    started = time.monotonic()
    with pytest.raises(RegistryUnavailableError, match=HINT.replace("`", ".").replace("?", ".")):
        await short.ping()
    assert time.monotonic() - started < 1.5
    await short.aclose()

    patient = ZmqRegistry(address, timeout=0.3, connect_timeout=None, retry_for=10.0, heartbeat=None)
    server = RegistryServer(address, insecure_dev=True)
    async with anyio.create_task_group() as tg:

        async def late() -> None:
            await anyio.sleep(1.0)
            await tg.start(server.serve)

        tg.start_soon(late)
        assert await patient.ping() == server.epoch  # connect_timeout=None: retry_for applies
        tg.cancel_scope.cancel()
    await patient.aclose()
    with pytest.raises(InvalidArgumentError, match="connect_timeout must be positive"):
        ZmqRegistry(address, connect_timeout=0)


def test_the_cli_says_the_hint_once(no_env):
    proc = cli("status", "--registry", free_address(), "--timeout", "0.3", secret=None)
    assert proc.returncode == 1 and proc.stderr.count(HINT) == 1, proc.stderr


# -- where a key came from, and which file it must be ----------------------------------------


def test_a_key_path_from_the_environment_is_named_as_coming_from_it(tmp_path, no_env):
    k = make_keys(tmp_path / "keys", ("reader", "replica-0"))
    no_env.setenv("WEIGHTPULL_KEY", str(tmp_path / "missing.key_secret"))
    with pytest.raises(InvalidArgumentError, match="missing.key_secret' \\(from \\$WEIGHTPULL_KEY\\): No such file"):
        ZmqRegistry("tcp://127.0.0.1:1")
    no_env.setenv("WEIGHTPULL_KEY", str(k / "replica-0.key"))  # the public half
    with pytest.raises(InvalidArgumentError, match="\\(from \\$WEIGHTPULL_KEY\\) holds no secret key"):
        ZmqRegistry("tcp://127.0.0.1:1")
    no_env.setenv("WEIGHTPULL_KEY", str(k / "replica-0.key_secret"))
    no_env.setenv("WEIGHTPULL_SERVER_KEY", str(k / "replica-0.key"))
    with pytest.raises(InvalidArgumentError, match="\\(from \\$WEIGHTPULL_SERVER_KEY\\) is the key of reader"):
        ZmqRegistry("tcp://127.0.0.1:1")
    with pytest.raises(InvalidArgumentError) as given:  # given as key=: no variable named
        ZmqRegistry("tcp://127.0.0.1:1", key=tmp_path / "missing.key_secret")
    assert "$WEIGHTPULL" not in str(given.value)

    shown = cli(
        "status", "--registry", "tcp://127.0.0.1:1", "--json", secret=None,
        extra_env={"WEIGHTPULL_KEY": str(tmp_path / "missing.key_secret")},
    )  # fmt: skip
    assert shown.returncode == 2
    assert "(from $WEIGHTPULL_KEY)" in json.loads(shown.stdout)["error"]["message"]


def test_a_secret_certificate_as_the_server_key_is_refused_naming_the_public_one(tmp_path, no_env):
    k = make_keys(tmp_path / "keys", ("reader", "replica-0"))
    with pytest.raises(InvalidArgumentError) as err:
        ZmqRegistry("tcp://127.0.0.1:1", key=k / "replica-0.key_secret", server_key=k / "registry.key_secret")
    message = str(err.value)
    assert "registry.key_secret" in message and "secret certificate of server registry" in message
    assert f"pass {k / 'registry.key'} " in message
    shown = cli(
        "status", "--registry", "tcp://127.0.0.1:1", "--key", str(k / "replica-0.key_secret"),
        "--server-key", str(k / "registry.key_secret"), secret=None,
    )  # fmt: skip
    assert shown.returncode == 2 and f"pass {k / 'registry.key'}" in shown.stderr
    no_env.setenv("WEIGHTPULL_KEY", str(k / "replica-0.key_secret"))
    no_env.setenv("WEIGHTPULL_SERVER_KEY", str(k / "registry.key_secret"))
    with pytest.raises(InvalidArgumentError, match="\\(from \\$WEIGHTPULL_SERVER_KEY\\) is the secret certificate"):
        ZmqRegistry("tcp://127.0.0.1:1")
    ZmqRegistry("tcp://127.0.0.1:1", server_key=k / "registry.key")  # the public one: taken


# -- the server's log of refused handshakes ----------------------------------------------------


def test_the_refusal_log_says_each_key_and_reason_once_a_minute_and_counts_the_rest(caplog):
    clock = FakeClock()
    refusals = RefusalLog(clock.now)
    with caplog.at_level(logging.WARNING, "weightpull.registry.server"):
        assert refusals.refused("k1", "unknown", "refused k1: unknown")
        for _ in range(5):
            assert not refusals.refused("k1", "unknown", "refused k1: unknown")
        assert refusals.refused("k1", "revoked", "refused k1: revoked")  # another reason: its own line
        assert refusals.refused("k2", "unknown", "refused k2: unknown")  # another key too
        clock.advance(REFUSAL_LOG_EVERY - 1)
        assert not refusals.refused("k1", "unknown", "refused k1: unknown")
        clock.advance(1)
        assert refusals.refused("k1", "unknown", "refused k1: unknown")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "refused k1: unknown",
        "refused k1: revoked",
        "refused k2: unknown",
        "refused k1: unknown (6 more since 60 s ago, not logged)",
    ]


@pytest.mark.anyio
async def test_the_server_logs_a_refused_handshake_naming_the_key_and_why_once_a_minute(tmp_path, caplog, no_env):
    k = make_keys(tmp_path / "keys", ("reader", "replica-0"), ("reader", "gone"))
    keys.revoke(k, "gone")
    stranger = make_keys(tmp_path / "elsewhere", ("reader", "stranger"))
    clock = FakeClock()
    server = RegistryServer(
        free_address(), keys=k, server_key=k / "registry.key_secret", registry=InProcessRegistry(clock)
    )
    gone = keys.load(k / "revoked" / "gone.key")
    with caplog.at_level(logging.WARNING, "weightpull.registry.server"):
        async with anyio.create_task_group() as tg:
            address = await tg.start(server.serve)

            async def refused(key, server_key=k / "registry.key") -> None:
                reg = ZmqRegistry(address, key=key, server_key=server_key, timeout=1.0, heartbeat=None)
                with pytest.raises(AuthenticationError):
                    await reg.ping()
                await reg.aclose()

            for _ in range(3):
                await refused(k / "revoked" / "gone.key_secret")
                await refused(stranger / "stranger.key_secret")
                await refused(k / "replica-0.key_secret", stranger / "registry.key")  # not this server's key
            clock.advance(REFUSAL_LOG_EVERY)
            await refused(k / "revoked" / "gone.key_secret")
            await anyio.sleep(0.2)  # the monitor's events arrive after the client gave up
            tg.cancel_scope.cancel()
    lines = [r.getMessage() for r in caplog.records if r.name == "weightpull.registry.server"]
    revoked = [line for line in lines if f"by key {gone.public[:8].decode()}..." in line]
    assert len(revoked) == 2, lines  # three refusals in the first minute, one line; the next minute's
    assert f"({k / 'revoked' / 'gone.key'}, reader gone): revoked" in revoked[0]
    assert "(2 more since 60 s ago, not logged)" in revoked[1]
    assert len([line for line in lines if "unknown key: no certificate in" in line]) == 1
    own = keys.load(k / "registry.key").public  # a weightpull client refuses to use it; another may try
    assert server.ring is not None and "the server's own key, not a client's" in server.ring.why_refused(own)[1]
    with pytest.raises(InvalidArgumentError, match="is the server's own key, not a client's: pass this client's"):
        ZmqRegistry(address, key=k / "registry.key_secret", server_key=k / "registry.key")
    wrong = [line for line in lines if "server key is not this server's public key" in line]
    assert len(wrong) == 1 and f"pass {k / 'registry.key'} as --server-key" in wrong[0]
    assert server.refused >= 9
