"""The table of operations agrees with everything made from it, and with what it is not
made from: the registry protocols, the machine (each operation's method takes the
table's argument names), the wire, and each client's methods; a request as an older
client sends it, without the newer optional arguments, is still answered."""

from __future__ import annotations

import inspect

import anyio
import pytest

from weightpull import Manifest, plan_layout
from weightpull.errors import MalformedMessageError, ProtocolError
from weightpull.layout import TensorSpec
from weightpull.operations import OPERATIONS, Callers, OperationsClient
from weightpull.principals import Principal
from weightpull.records import Lease, Reservation
from weightpull.registry import (
    InProcessRegistry,
    Registry,
    RegistryMachine,
    RelayingRegistry,
    ReservingRegistry,
    SliceRelayingRegistry,
    StreamingRegistry,
)

pytestmark = pytest.mark.anyio
PROTOCOLS = (Registry, StreamingRegistry, ReservingRegistry, RelayingRegistry, SliceRelayingRegistry)
LIFECYCLE = {"aclose"}  # the protocols' own: nothing of it crosses


def parameters(method) -> dict[str, inspect.Parameter]:
    return {n: p for n, p in inspect.signature(method).parameters.items() if n not in ("self", "by")}


def test_every_protocol_method_is_an_operation_of_the_table():
    methods = {m for protocol in PROTOCOLS for m in vars(protocol) if not m.startswith("_")}
    assert methods - LIFECYCLE <= set(OPERATIONS)


@pytest.mark.parametrize("name", sorted(OPERATIONS))
def test_every_operation_has_its_method_with_the_tables_argument_names(name):
    op = OPERATIONS[name]
    assert op.name == name
    owner = InProcessRegistry if op.waits else RegistryMachine  # a long poll waits on the face
    method = getattr(owner, op.target)
    takes = parameters(method)
    assert set(op.forms) <= set(takes), f"{owner.__name__}.{op.target} lacks {set(op.forms) - set(takes)}"
    needed = {n for n, p in takes.items() if p.default is inspect.Parameter.empty}
    assert needed <= set(op.args), f"{name}: the method needs {needed - set(op.args)}, which the table sends always"
    assert not set(op.optional) & needed, f"{name}: an optional argument the method needs"
    if not op.waits:
        assert "by" in inspect.signature(method).parameters  # the machine judges who asks
        assert name in ("ping",) or hasattr(InProcessRegistry, name)


@pytest.mark.parametrize("name", sorted(set(OPERATIONS) - {"ping"}))
def test_every_operation_is_a_typed_method_of_the_clients_face(name):
    method = getattr(OperationsClient, name)
    assert inspect.iscoroutinefunction(method)
    takes = parameters(method)
    op = OPERATIONS[name]
    assert set(op.forms) - {"timeout"} <= set(takes) | {"timeout"}
    assert all(p.annotation is not inspect.Parameter.empty for p in takes.values())
    assert inspect.signature(method).return_annotation is not inspect.Signature.empty


def test_the_wire_forms_are_the_tables():
    wire = pytest.importorskip("weightpull.drivers.zmq_registry.wire")
    assert set(wire.OPS) == set(OPERATIONS)
    for name, op in OPERATIONS.items():
        assert set(wire.OPS[name].args) == set(op.args)
        assert set(wire.OPS[name].optional) == set(op.optional)
        assert wire.OPS[name].mutates is op.mutates
    assert {n for n, op in OPERATIONS.items() if op.waits} == {"wait_for_version", "wait_for_buckets"}
    # What the machine refuses a reader, the table says a reader may not call.
    assert {n for n, op in OPERATIONS.items() if op.callers is Callers.PUBLISHER} >= {"begin", "commit", "retire"}


def test_the_clients_and_the_in_process_registry_are_made_from_the_face():
    pytest.importorskip("zmq")
    from weightpull.drivers.ray_registry import RayRegistry
    from weightpull.drivers.zmq_registry.client import ZmqRegistry

    for client in (ZmqRegistry, RayRegistry, InProcessRegistry):
        assert issubclass(client, OperationsClient)
        for name in set(OPERATIONS) - {"ping"}:  # an override keeps the face's signature
            assert parameters(getattr(client, name)).keys() == parameters(getattr(OperationsClient, name)).keys()


def manifest(version: int) -> Manifest:
    return Manifest(version, plan_layout([TensorSpec("w", "uint8", (8,))]), "fake", b"{}", 0, "p", ("d",))


def test_arguments_cross_in_the_order_given_and_optional_ones_only_when_set():
    acquire = OPERATIONS["acquire"]
    sent = acquire.encode_args({"version": None, "ttl": 1.0, "holder": "r", "streaming": None, "host": None})
    assert list(sent) == ["version", "ttl", "holder"]  # as an older registry takes it
    lease = Lease("l1", 1, "r", 1.0, 5.0, "relay", b"\x00d")
    assert OPERATIONS["renew"].decode_args(OPERATIONS["renew"].encode_args({"lease": lease})) == {"lease": lease}
    offer = OPERATIONS["offer"].encode_args({"version": 1, "holder": "r", "host": "h", "descriptor": b"\x00"})
    assert offer["descriptor"] == "AA=="
    with pytest.raises(MalformedMessageError, match="base64"):
        OPERATIONS["offer"].decode_args({**offer, "descriptor": "not base64!"})
    with pytest.raises(TypeError, match="needs ttl"):
        acquire.encode_args({"version": 1, "holder": "r"})
    with pytest.raises(TypeError, match="no argument 'colour'"):
        acquire.encode_args({"version": 1, "ttl": 1.0, "holder": "r", "colour": "red"})
    with pytest.raises(ProtocolError, match="expected a list"):
        OPERATIONS["reservations"].decode_result({"not": "a list"})
    reservation = Reservation("p", "fake", (b"s",), 8)
    assert OPERATIONS["reservations"].decode_result(OPERATIONS["reservations"].encode_result((reservation,))) == (
        reservation,
    )


async def test_a_request_without_the_newer_optional_arguments_is_still_answered():
    """What an older client sends: only the arguments every release took, through the
    served registry's checks and dispatch, as a principal of its own."""
    wire = pytest.importorskip("weightpull.drivers.zmq_registry.wire")
    from weightpull.drivers.zmq_registry.server import RegistryServer

    server = RegistryServer("tcp://127.0.0.1:0", insecure_dev=True)
    trainer = Principal.publisher("p")

    def ask(op: str, **args):
        req = wire.Request("old-client", op, args, server.epoch)
        wire.check_args(req)
        return server._execute(op, req.args, trainer)

    number = ask("begin", version=None, publisher="p", slot=0)  # no shard
    ask("commit", manifest=manifest(number).to_dict())
    assert ask("newest")["version"] == number  # no publisher
    lease = ask("acquire", version=None, ttl=5.0, holder="p")  # no streaming, host, exclude, publisher
    assert ask("progress", version=number)["state"] == "READY"  # no source
    ask("offer", version=number, holder="p/relay", host="h", descriptor="AA==")  # no cap, landed
    assert ask("release_checked", lease=lease) is True
    assert ask("abort", version=ask("begin", version=None, publisher="p", slot=1), reason="") is None
    registry = server.registry
    with anyio.fail_after(10):  # a long poll, as an older client asks it
        waited = await server_answer(registry, "wait_for_version", {"min_version": number, "timeout": None}, trainer)
    assert waited["version"] == number


async def server_answer(registry, name, args, by):
    from weightpull.operations import answer

    return await answer(registry, name, args, by=by, max_wait=1.0)


async def test_the_machine_refuses_a_reader_every_operation_the_table_gives_publishers():
    from weightpull.errors import PermissionDeniedError

    registry = InProcessRegistry()
    trainer = registry.as_principal(Principal.publisher("p"))
    reader = registry.as_principal(Principal.reader("r"))
    v = await trainer.begin(publisher="p", slot=0)
    calls = {
        "begin": lambda: reader.begin(publisher="p", slot=1),
        "commit": lambda: reader.commit(manifest(v)),
        "abort": lambda: reader.abort(v, "not mine"),
        "retire": lambda: reader.retire(v),
        "reclaim": lambda: reader.reclaim(v),
        "stream": lambda: reader.stream(manifest(v)),
        "mark": lambda: reader.mark(v, 1),
        "commit_stream": lambda: reader.commit_stream(v),
        "reserve": lambda: reader.reserve(Reservation("p", "fake", (b"s",), 8)),
    }
    assert set(calls) == {n for n, op in OPERATIONS.items() if op.callers is Callers.PUBLISHER}
    for name, call in calls.items():
        with pytest.raises(PermissionDeniedError, match=f"reader r may not {name}"):
            await call()
