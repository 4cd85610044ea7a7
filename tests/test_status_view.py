"""The status a trainer's operator reads: each version's step, each replica's last pull
(when, GB/s, from which source) and the principals that lapsed lately, kept bounded; its
new fields are left out until used, so records of an earlier release read as ever; and
`weightpull status` shows them, as tables or `--compact`, once or `--watch`ed."""

from __future__ import annotations

import signal
import subprocess
import sys

import anyio
import pytest

from weightpull import FakeClock, InProcessRegistry, Manifest, RegistryStatus, plan_layout
from weightpull.errors import InvalidArgumentError
from weightpull.layout import TensorSpec
from weightpull.records import PullReport, VersionInfo
from weightpull.registry_machine import LAPSE_WINDOW, MAX_LAPSES
from weightpull.states import VersionState

from .served import SECRET, ServedRegistry, cli, env

pytestmark = pytest.mark.anyio

TTL = 0.5
SERVED_TTL = 1.5  # over the wire, on a loaded machine: a beat every TTL/6 must not miss a whole TTL
LAYOUT = plan_layout([TensorSpec("w", "uint8", (8,))])


async def publish(reg, version: int, publisher: str = "trainer", step: int | None = None) -> None:
    number = await reg.begin(version, publisher=publisher, slot=version % 2)
    await reg.commit(Manifest(number, LAYOUT, "fake", b"{}", version % 2, publisher, step=step))


async def test_the_status_shows_steps_pulls_and_recent_lapses():
    clock = FakeClock()
    reg = InProcessRegistry(clock, liveness_ttl=TTL)
    await publish(reg, 1, step=100)
    await publish(reg, 2)  # no step given
    await reg.report_serving("r0", 1, pull=PullReport(0.5, 2_000_000_000, "relay-a"))
    await reg.report_serving("r1", 1)
    clock.advance(0.25)
    status = await reg.status()
    assert [(v.version, v.step) for v in status.versions] == [(1, 100), (2, None)]
    (pull,) = status.pulls.values()
    assert list(status.pulls) == ["r0"] and pull.version == 1 and pull.source == "relay-a"
    assert pull.ago == pytest.approx(0.25) and pull.gbps == pytest.approx(4.0)
    assert status.lapsed == ()

    clock.advance(TTL)  # all lapse: the trainer, and both replicas
    status = await reg.status()
    assert status.serving == {} and status.pulls == {}
    lapses = {x.name: x for x in status.lapsed}
    assert set(lapses) == {"trainer", "r0", "r1"}
    assert lapses["trainer"].ended == ("withdrew v2",) and lapses["r0"].ended == ("replica 'r0' stopped serving v1",)
    assert lapses["trainer"].ago == pytest.approx(0.25)

    clock.advance(LAPSE_WINDOW)  # old lapses leave the status
    assert (await reg.status()).lapsed == ()


async def test_the_lapses_kept_are_bounded():
    clock = FakeClock()
    reg = InProcessRegistry(clock, liveness_ttl=TTL)
    for i in range(MAX_LAPSES + 10):
        await reg.report_serving(f"r{i}", 1)
    clock.advance(TTL)
    assert len((await reg.status()).lapsed) == MAX_LAPSES


@pytest.mark.parametrize(
    "pull",
    [PullReport(-1.0, 10), PullReport(float("nan"), 10), PullReport(1.0, -1), PullReport(1.0, 10, "x" * 300), "fast"],
)
async def test_a_bad_pull_report_is_refused_and_nothing_is_recorded(pull):
    reg = InProcessRegistry(FakeClock())
    with pytest.raises(InvalidArgumentError, match="pull"):
        await reg.report_serving("r0", 1, pull=pull)
    status = await reg.status()
    assert status.serving == {} and status.pulls == {}


def test_the_new_fields_are_left_out_until_used_and_older_records_read_as_ever():
    old = {"newest_ready": None, "versions": [], "leases": [], "serving": {"r0": 1}}
    status = RegistryStatus.from_dict(old)
    assert status.pulls == {} and status.lapsed == () and status.to_dict() == old
    assert "step" not in VersionInfo(1, VersionState.READY, "trainer", 0, 8, 1.0, 0).to_dict()
    stepped = VersionInfo(1, VersionState.READY, "trainer", 0, 8, 1.0, 0, step=7)
    assert VersionInfo.from_dict(stepped.to_dict()) == stepped
    assert "delta" not in stepped.to_dict()
    patched = VersionInfo(2, VersionState.READY, "trainer", 1, 8, 1.0, 0, delta=(1, 40))
    assert patched.to_dict()["delta"] == [1, 40] and VersionInfo.from_dict(patched.to_dict()) == patched


# -- through the served registry and the command line -----------------------------------------------


def _status(served: ServedRegistry, *args: str) -> subprocess.CompletedProcess:
    shown = cli("status", "--registry", served.address, *args, timeout=60)
    assert shown.returncode == 0, shown.stderr
    return shown.stdout


async def test_weightpull_status_shows_them_as_tables_and_compact_and_watched(tmp_path):
    from weightpull.drivers.zmq_registry.client import ZmqRegistry

    served = ServedRegistry(tmp_path, args=("--liveness-ttl", str(SERVED_TTL)))
    served.start()
    try:
        with pytest.warns(DeprecationWarning):
            trainer = ZmqRegistry(served.address, secret=SECRET, heartbeat=None)
            replica = ZmqRegistry(served.address, secret=SECRET, heartbeat=SERVED_TTL / 6)
        async with replica:
            await publish(trainer, 3, step=300)
            await replica.report_serving("r0", 3, pull=PullReport(0.25, 1_000_000_000))
            await trainer.aclose()
            await anyio.sleep(2 * SERVED_TTL)  # the trainer, silent, lapses; the replica beats on
            status = await replica.status()
            assert status.pulls["r0"].gbps == pytest.approx(4.0) and status.versions[0].step == 300
            assert [x.name for x in status.lapsed] == ["trainer"]

            tables = await anyio.to_thread.run_sync(lambda: _status(served))
            assert "STEP" in tables and " 300 " in tables
            (row,) = [line for line in tables.splitlines() if line.startswith("  r0 ") and " ago " in line]
            assert row.split()[1:3] == ["v3", "v3"] and row.split()[-2:] == ["4.00", "slot"] and " s ago " in row
            assert "lapsed lately:" in tables and "withdrew v3" in tables

            compact = await anyio.to_thread.run_sync(lambda: _status(served, "--compact"))
            lines = compact.splitlines()[1:]
            assert lines[0].startswith("  r0: serving v3; pulled v3 ") and lines[0].endswith("at 4.00 GB/s from slot")
            assert lines[1].startswith("  LAPSED trainer ") and lines[1].endswith(": withdrew v3")

            watch = subprocess.Popen(
                [sys.executable, "-m", "weightpull", "status", "--registry", served.address, "--watch", "0.2"]
                + ["--compact"],
                env=env(),
                stdout=subprocess.PIPE,
                text=True,
                # A pytest-xdist worker ignores SIGINT and a child inherits that: give it Ctrl-C back.
                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
            )
            try:
                first = [await anyio.to_thread.run_sync(watch.stdout.readline) for _ in range(3)]
                assert first[1].startswith("  r0: serving v3") and first[2].startswith("  LAPSED trainer")
                watch.send_signal(signal.SIGINT)
                assert await anyio.to_thread.run_sync(lambda: watch.wait(20)) == 0  # Ctrl-C ends a watch
            finally:
                if watch.poll() is None:
                    watch.kill()
                watch.stdout.close()
    finally:
        served.stop()


def test_compact_and_json_together_is_a_wrong_command_line():
    shown = cli("status", "--registry", "tcp://127.0.0.1:1", "--compact", "--json", timeout=60)
    assert shown.returncode == 2 and "--compact" in shown.stderr


async def test_the_update_agent_reports_its_engines_last_pull_and_a_puller_knows_its_own():
    from tests.conftest import World, autojump, host_tensors
    from tests.test_agent import FakeEngine
    from weightpull.rl.agent import UpdateAgent

    class Reporting(FakeEngine):
        def last_pull(self):
            return self.puller.last_pull()

    world = World()
    publisher, engine = world.publisher(), Reporting(world)
    assert engine.puller.last_pull() is None  # before its first pull
    agent = UpdateAgent("r0", world.registry, engine, clock=world.clock)
    async with autojump(world.clock), anyio.create_task_group() as tg:
        tg.start_soon(agent.run)
        await publisher.publish(1, host_tensors(1))
        assert await agent.wait_for_version(1, timeout=5) == 1
        tg.cancel_scope.cancel()
    report = engine.puller.last_pull()
    assert report == PullReport(engine.pulled.seconds, engine.pulled.nbytes, "")  # "": the version's own slot
    pull = (await world.registry.status()).pulls["r0"]
    assert (pull.version, pull.nbytes, pull.source) == (1, engine.pulled.nbytes, "") and pull.nbytes > 0


async def test_a_pull_report_to_a_server_of_an_earlier_release_falls_back_to_the_plain_report(monkeypatch):
    import attrs

    from weightpull.drivers.zmq_registry import wire
    from weightpull.drivers.zmq_registry.client import ZmqRegistry
    from weightpull.drivers.zmq_registry.server import RegistryServer
    from weightpull.operations import OPERATIONS

    earlier = attrs.evolve(OPERATIONS["report_serving"], optional={})  # as an earlier release checks it
    monkeypatch.setitem(wire._ARGS, "report_serving", wire._args_form("report_serving", wire._wire_op(earlier)))
    server = RegistryServer("tcp://127.0.0.1:0", insecure_dev=True)
    async with anyio.create_task_group() as tg:
        address = await tg.start(server.serve)
        async with ZmqRegistry(address, heartbeat=None) as reg:
            await reg.report_serving("r0", 1, pull=PullReport(1.0, 10))
            await reg.report_serving("r0", 2, pull=PullReport(1.0, 10))
            status = await reg.status()
        tg.cancel_scope.cancel()
    assert status.serving == {"r0": 2} and status.pulls == {}
