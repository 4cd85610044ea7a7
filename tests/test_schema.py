"""The schema of everything that crosses a process boundary: every record round-trips,
keeps its JSON form, and every wrong value is refused, typed, naming the class and field."""

import json
import re

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from weightpull import schema
from weightpull.errors import InvalidArgumentError, MalformedMessageError
from weightpull.layout import DTYPE_SIZES, Layout, TensorSpec, plan_layout
from weightpull.manifest import Manifest
from weightpull.registry import Lease, LeaseInfo, RegistryStatus, VersionInfo
from weightpull.sharding import Shard, chunk_rows
from weightpull.states import VersionState

LAYOUT = plan_layout([TensorSpec("w", "float32", (4, 2)), TensorSpec("b", "bfloat16", (4,))], bucket_bytes=64)
SHARDS = (Shard(0, 2, "p0", 0, b"s0", ((0, 2), (0, 2))), Shard(1, 2, "p1", 1, b"s1", ((2, 4), (2, 4))))
PLAIN = Manifest(3, LAYOUT, "fake", b"src", 1, "p", digests=["0" * 32] * len(LAYOUT.buckets))
LEASE = Lease("abc-1", 3, "r0", 5.5, 12.5)
STATUS = RegistryStatus(
    4,
    (
        VersionInfo(4, VersionState.READY, "t", 1, 256, 1.5, 1),
        VersionInfo(3, VersionState.ABORTED, "t", 0, None, 2.5, 0, "boom"),
    ),
    (LeaseInfo("abc-1", 4, "r0", 4.5),),
    {"r0": 3},
)

# Each record with its wire form, exactly as the hand-written to_dict wrote it before the
# schema: the served registry talks to older peers within a release.
FORMS = [
    (LEASE, {"id": "abc-1", "version": 3, "holder": "r0", "ttl": 5.5, "expires_at": 12.5}),
    (
        STATUS,
        {
            "newest_ready": 4,
            "versions": [
                {
                    "version": 4,
                    "state": "READY",
                    "publisher": "t",
                    "slot": 1,
                    "nbytes": 256,
                    "age": 1.5,
                    "live_leases": 1,
                    "reason": "",
                },
                {
                    "version": 3,
                    "state": "ABORTED",
                    "publisher": "t",
                    "slot": 0,
                    "nbytes": None,
                    "age": 2.5,
                    "live_leases": 0,
                    "reason": "boom",
                },
            ],
            "leases": [{"id": "abc-1", "version": 4, "holder": "r0", "expires_in": 4.5}],
            "serving": {"r0": 3},
        },
    ),
    (
        STATUS.versions[0],
        {
            "version": 4,
            "state": "READY",
            "publisher": "t",
            "slot": 1,
            "nbytes": 256,
            "age": 1.5,
            "live_leases": 1,
            "reason": "",
        },
    ),
    (STATUS.leases[0], {"id": "abc-1", "version": 4, "holder": "r0", "expires_in": 4.5}),
    (
        LAYOUT,
        {
            "tensors": [["w", "float32", [4, 2]], ["b", "bfloat16", [4]]],
            "bucket_bytes": 64,
            "align": 256,
            "signature": LAYOUT.signature,
        },
    ),
    (SHARDS[1], {"index": 1, "count": 2, "publisher": "p1", "slot": 1, "source": "czE=", "rows": [[2, 4], [2, 4]]}),
    (
        PLAIN,
        {
            "version": 3,
            "layout": LAYOUT.to_dict(),
            "transport": "fake",
            "source": "c3Jj",
            "slot": 1,
            "publisher": "p",
            "digests": ["0" * 32] * len(LAYOUT.buckets),
        },
    ),
    (
        Manifest(3, LAYOUT, "fake", b"s0", 0, "p0", shards=SHARDS),
        {
            "version": 3,
            "layout": LAYOUT.to_dict(),
            "transport": "fake",
            "source": "czA=",
            "slot": 0,
            "publisher": "p0",
            "digests": None,
            "shards": [s.to_dict() for s in SHARDS],
        },
    ),
]


@pytest.mark.parametrize("record, form", FORMS, ids=lambda v: type(v).__name__)
def test_each_record_keeps_its_wire_form_and_comes_back_whole(record, form):
    assert record.to_dict() == form
    assert json.dumps(record.to_dict()) == json.dumps(form)  # key order too: the bytes are the same
    assert type(record).from_dict(json.loads(json.dumps(form))) == record


# -- every wrong value, at every place of every record -------------------------------------

WRONG = {  # a value of each JSON type, and the ones a lax schema would coerce
    int: [True, "3", 3.5, None, [3], {}],
    float: [True, "3", None, [1.5]],
    str: [3, True, None, ["x"], {}],
}
# Fields a sender may leave out (they have a default), Optional fields, and mappings whose
# keys are names (a key more is a name more, not an unknown field).
MAY_BE_MISSING = {"Manifest.digests", "Manifest.shards", "VersionInfo.reason"}
MAY_BE_NULL = {"Manifest.digests", "VersionInfo.nbytes", "RegistryStatus.newest_ready"}
MAPPINGS = {"RegistryStatus.serving"}


def _generic(path):
    """Which field of which record a path names: a status's versions are VersionInfos."""
    return re.sub(r"^.*\.leases\[\d+\]", "LeaseInfo", re.sub(r"^.*\.versions\[\d+\]", "VersionInfo", path))


def mutations(data, path):
    """(changed copy, path of the change, what kind) for every place in `data`."""
    if isinstance(data, dict):
        mapping = path in MAPPINGS
        yield [data], path, "type"
        if not mapping:
            yield {**data, "unknown": 1}, path, "extra"
        for key, value in data.items():
            where = f"{path}[{key!r}]" if mapping else f"{path}.{key}"
            if _generic(where) not in MAY_BE_MISSING and not mapping:
                yield {k: v for k, v in data.items() if k != key}, where, "missing"
            for changed, at, kind in mutations(value, where):
                yield {**data, key: changed}, at, kind
    elif isinstance(data, list):
        yield "not a list", path, "type"
        yield {"0": data[0]} if data else {}, path, "type"
        for i, value in enumerate(data):
            for changed, at, kind in mutations(value, f"{path}[{i}]"):
                yield [*data[:i], changed, *data[i + 1 :]], at, kind
    elif type(data) in WRONG:
        for wrong in WRONG[type(data)]:
            if wrong is None and _generic(path) in MAY_BE_NULL:
                continue
            yield wrong, path, "type"


CASES = [
    pytest.param(type(record), changed, at, kind, id=f"{at}:{kind}:{changed if kind != 'missing' else ''}"[:90])
    for record, form in FORMS
    for changed, at, kind in mutations(form, type(record).__name__)
]


@pytest.mark.parametrize("cls, data, path, kind", CASES)
def test_every_wrong_value_is_refused_naming_the_class_and_field(cls, data, path, kind):
    with pytest.raises(InvalidArgumentError) as info:
        cls.from_dict(json.loads(json.dumps(data)))
    message = str(info.value)
    assert message.startswith(f"malformed {schema._noun(cls)}: ")
    words = {
        "extra": f"{path} has unexpected keys ['unknown']",
        "missing": f"{path} is missing",
        "type": f"{path} must be",
    }
    assert words[kind] in message, message


def test_a_wrong_value_names_only_what_is_wrong_and_not_too_much():
    data = {**LEASE.to_dict(), "version": "3"}
    with pytest.raises(InvalidArgumentError) as info:
        Lease.from_dict(data)
    assert str(info.value) == "malformed lease: Lease.version must be an int, got '3'"
    many = {**STATUS.to_dict(), "versions": [{}] * 50}
    with pytest.raises(InvalidArgumentError, match="and \\d+ more$") as info:
        RegistryStatus.from_dict(many)
    assert len(str(info.value)) < 600  # a hostile message does not make a huge error reply


@pytest.mark.parametrize("data", [None, [1], "x", 3, True])
@pytest.mark.parametrize("cls", [Lease, VersionInfo, LeaseInfo, RegistryStatus, Layout, Shard, Manifest])
def test_a_record_comes_from_an_object_only(cls, data):
    with pytest.raises(InvalidArgumentError, match=f"{cls.__name__} must be an object"):
        cls.from_dict(data)


def test_the_records_own_checks_still_run_named():
    tampered = {**LAYOUT.to_dict(), "signature": "0" * 32}
    with pytest.raises(InvalidArgumentError, match="Manifest.layout: layout signature mismatch"):
        Manifest.from_dict({**PLAIN.to_dict(), "layout": tampered})
    with pytest.raises(InvalidArgumentError, match="Manifest: manifest v3: 1 digests for 2 buckets"):
        Manifest.from_dict({**PLAIN.to_dict(), "digests": ["00"]})
    with pytest.raises(InvalidArgumentError, match=r"Shard.rows\[0\] must hold 2 items"):
        Shard.from_dict({**SHARDS[0].to_dict(), "rows": [[0, 1, 2], [0, 2]]})
    with pytest.raises(InvalidArgumentError, match="Shard.source must be base64 text"):
        Shard.from_dict({**SHARDS[0].to_dict(), "source": "not base64!"})
    with pytest.raises(InvalidArgumentError, match="VersionInfo.state must be one of"):
        VersionInfo.from_dict({**STATUS.versions[0].to_dict(), "state": "GONE"})


def test_numbers_too_large_for_a_float_are_refused_not_overflowed():
    with pytest.raises(InvalidArgumentError, match="Lease.ttl must be a finite number"):
        Lease.from_dict({**LEASE.to_dict(), "ttl": 10**400})
    assert Lease.from_dict({**LEASE.to_dict(), "ttl": 5}).ttl == 5.0  # a JSON number without a fraction is a float


# -- round trips of generated records -------------------------------------------------------

names = st.text(min_size=1, max_size=12)
counts = st.integers(0, 2**63 - 1)
seconds = st.floats(-1e12, 1e12, allow_nan=False)


@st.composite
def layouts(draw, sharded=False):
    shapes = st.lists(st.integers(0, 6), min_size=1 if sharded else 0, max_size=3).map(tuple)
    specs = draw(
        st.lists(
            st.tuples(names, st.sampled_from(sorted(DTYPE_SIZES)), shapes),
            min_size=1,
            max_size=5,
            unique_by=lambda t: t[0],
        )
    )
    bucket = draw(st.sampled_from([64, 1024, 1 << 20]))
    return plan_layout([TensorSpec(*s) for s in specs], bucket_bytes=bucket, align=draw(st.sampled_from([1, 64, 256])))


@st.composite
def manifests(draw):
    if draw(st.booleans()):
        layout = draw(layouts(sharded=True))
        count = draw(st.integers(1, 3))
        shards = [
            Shard(
                i,
                count,
                f"p{i}",
                i,
                draw(st.binary(max_size=16)),
                tuple(chunk_rows(s.shape[0], i, count) for s in layout.specs),
            )
            for i in range(count)
        ]
        first = shards[0]
        return Manifest(draw(counts), layout, "fake", first.source, first.slot, first.publisher, shards=shards)
    layout = draw(layouts())
    digests = draw(st.none() | st.just([f"{i:032x}" for i in range(len(layout.buckets))]))
    return Manifest(
        draw(counts), layout, draw(names), draw(st.binary(max_size=64)), draw(counts), draw(names), digests=digests
    )


version_infos = st.builds(
    VersionInfo,
    counts,
    st.sampled_from(VersionState),
    names,
    counts,
    st.none() | counts,
    seconds,
    counts,
    st.text(max_size=20),
)
lease_infos = st.builds(LeaseInfo, names, counts, names, seconds)
RECORDS = {
    "Lease": st.builds(Lease, names, counts, names, seconds, seconds),
    "VersionInfo": version_infos,
    "LeaseInfo": lease_infos,
    "RegistryStatus": st.builds(
        RegistryStatus,
        st.none() | counts,
        st.lists(version_infos, max_size=3).map(tuple),
        st.lists(lease_infos, max_size=3).map(tuple),
        st.dictionaries(names, counts, max_size=3),
    ),
    "Layout": layouts(),
    "Manifest": manifests(),
}


@pytest.mark.parametrize("kind", sorted(RECORDS))
def test_every_record_round_trips_through_json(kind):
    @given(record=RECORDS[kind])
    def check(record):
        data = json.loads(json.dumps(record.to_dict(), allow_nan=False))
        back = type(record).from_dict(data)
        assert back == record and back.to_dict() == record.to_dict()

    check()


# -- the wire's forms ----------------------------------------------------------------------


def test_wire_forms_refuse_wrong_values_as_malformed_messages():
    wire = pytest.importorskip("weightpull.drivers.zmq_registry.wire")
    body = {
        "wp": 1,
        "type": "request",
        "id": "r1",
        "nonce": "n" * 16,
        "ts": 1.5,
        "epoch": None,
        "op": "ping",
        "args": {},
    }
    assert schema.structure(body, wire.RequestBody, MalformedMessageError).epoch is None
    for key, wrong in [("id", 7), ("id", ""), ("ts", True), ("ts", "1"), ("nonce", None), ("op", 3.5), ("args", [])]:
        with pytest.raises(MalformedMessageError, match=f"malformed request body: RequestBody.{key} must be"):
            schema.structure({**body, key: wrong}, wire.RequestBody, MalformedMessageError)
    begin = wire.Request("r", "begin", {"version": 1, "publisher": "p", "slot": 0}, "e")
    wire.check_args(begin)
    wire.check_args(attrs.evolve(begin, args={**begin.args, "shard": [0, 2]}))
    for shard in [None, [2, 2], [0, True], [0], "0,2"]:  # optional: absent, never null
        with pytest.raises(MalformedMessageError, match=r"BeginArgs.shard(\[1\])? must be"):
            wire.check_args(attrs.evolve(begin, args={**begin.args, "shard": shard}))
    reply = {
        "wp": 1,
        "type": "reply",
        "id": None,
        "re": None,
        "nonce": "n" * 16,
        "ts": 1.0,
        "epoch": "e",
        "ok": False,
        "result": None,
        "error": {"type": "X", "message": "m", "more": 1},
    }
    with pytest.raises(MalformedMessageError, match=r"ReplyBody.error has unexpected keys \['more'\]"):
        schema.structure(reply, wire.ReplyBody, MalformedMessageError)
    raw = json.dumps({**reply, "error": None}).encode()
    with pytest.raises(MalformedMessageError, match="must name its error"):
        wire.decode_reply(b"k", [wire.mac(b"k", raw) + raw])
