"""A vLLM worker's mirrors as `PullSpec` sets them, without vLLM: slices by default past
one tensor-parallel rank, a slice's mirrors registered at its size by `prepare`, and one
mirror instead of two (`spare_mirror=False`), whose worker gets the version it serves
back after a failed apply by pulling it again, or says it holds none."""

from __future__ import annotations

import anyio
import attrs
import numpy as np
import pytest

pytest.importorskip("torch")

from tests.conftest import host_tensors, settle  # noqa: E402
from tests.test_defaults import code_value, table  # noqa: E402
from tests.test_slice_puller import _check  # noqa: E402
from tests.test_slices import _model, _slice  # noqa: E402
from weightpull import HostTensor, InProcessRegistry, Publisher  # noqa: E402
from weightpull.drivers.fake import FakeTransport  # noqa: E402
from weightpull.errors import InvalidArgumentError  # noqa: E402
from weightpull.integrations.vllm import PullSpec, WeightpullWorker  # noqa: E402
from weightpull.integrations.vllm.mirrors import BackgroundPulls, checkpoint_weights  # noqa: E402

pytestmark = pytest.mark.anyio

ADDRESS = "tcp://127.0.0.1:5604"
SPECS = _model(vocab_size=22, hidden=8, heads=4, kv=2, inter=12, experts=2)


def as_bytes(pulled) -> dict[str, bytes]:
    return {name: bytes(t.numpy().tobytes()) for name, t in checkpoint_weights(pulled)}


def exact(pulled, version: int) -> bool:
    return as_bytes(pulled) == {n: t.data for n, t in host_tensors(version).items()}


async def background(registry, **options) -> BackgroundPulls:
    async def setup():
        return registry, FakeTransport()

    return await anyio.to_thread.run_sync(lambda: BackgroundPulls(setup, holder="r0", ttl=2.0, **options))


async def pulled(pulls: BackgroundPulls, version: int):
    pulls.prefetch(version)
    status = await anyio.to_thread.run_sync(settle, pulls)
    assert status["pulled"] == version, status
    return pulls.take(version)


# -- PullSpec ------------------------------------------------------------------------------


def test_workers_pull_their_slices_past_one_rank_unless_told_otherwise():
    spec = PullSpec(ADDRESS, "r0")
    assert (spec.sharded, spec.spare_mirror) == ("auto", True)
    assert [spec.sliced(n) for n in (1, 2, 8)] == [False, True, True]
    assert [PullSpec(ADDRESS, "r0", sharded=True).sliced(n) for n in (1, 2)] == [True, True]
    assert [PullSpec(ADDRESS, "r0", sharded=False).sliced(n) for n in (1, 8)] == [False, False]
    relaying = PullSpec(ADDRESS, "r0", host="h1", relay=True, stream=True, relay_cap=2)  # refused before
    assert relaying.sliced(2) and relaying.relay
    for bad in ("yes", 1, None):
        with pytest.raises(InvalidArgumentError, match=r"PullSpec.sharded must be 'auto' .*, True or False, got"):
            PullSpec(ADDRESS, "r0", sharded=bad)
    with pytest.raises(InvalidArgumentError, match="PullSpec.spare_mirror must be True or False, got 0"):
        PullSpec(ADDRESS, "r0", spare_mirror=0)


def test_the_defaults_page_names_every_default_of_pullspec_as_the_code_has_it():
    documented = table()["PullSpec"]
    fields = [f for f in attrs.fields(PullSpec) if f.default is not attrs.NOTHING]
    assert sorted(documented) == sorted(f.name for f in fields)
    for f in fields:
        default = f.default.factory() if isinstance(f.default, attrs.Factory) else f.default  # type: ignore[arg-type]
        assert code_value(documented[f.name]) == default, f"PullSpec({f.name}=...): {documented[f.name]}"


# -- one mirror ----------------------------------------------------------------------------


async def test_one_mirror_takes_each_version_over_the_served_one():
    registry = InProcessRegistry()
    publisher = Publisher(registry, FakeTransport(), rollout_dtype=None, bucket_bytes=2048)
    pulls = await background(registry, mirrors=1)
    try:
        await publisher.publish(1, host_tensors(1))
        first = await pulled(pulls, 1)
        pulls.pair.promote(first)
        size = pulls.status()["mirror_bytes"]
        assert size == first.region.nbytes and len(pulls.pair.pullers) == 1 and pulls.pair.holds(first)

        await publisher.publish(2, host_tensors(2))
        second = await pulled(pulls, 2)
        assert second.region is first.region and exact(second, 2)  # over the served copy
        assert not pulls.pair.holds(first) and pulls.status()["serving"] == 1  # the model still serves v1
        pulls.pair.promote(second)
        assert pulls.status()["serving"] == 2 and pulls.status()["mirror_bytes"] == size  # no second mirror
        with pytest.raises(InvalidArgumentError, match="v1 is no longer held by any mirror"):
            pulls.pair.promote(first)
    finally:
        await anyio.to_thread.run_sync(pulls.close)


class _Worker(WeightpullWorker):
    """The worker's apply, with the model's reload replaced by a record of what it loaded
    (a failure for `failing` versions)."""

    def __init__(self, pulls: BackgroundPulls, failing: set[int]) -> None:
        self._weightpull = pulls
        self.failing = failing
        self.loaded: list[tuple[int, bool]] = []  # (version, its bytes exact)

    def _weightpull_servable(self, pulled) -> None:
        from weightpull.integrations import fp8

        fp8.check_servable(pulled.manifest.layout, pulled.version, None)  # an unquantized engine's

    def _weightpull_load(self, pulled):
        self.loaded.append((pulled.version, exact(pulled, pulled.version)))
        if pulled.version in self.failing:
            raise ValueError(f"v{pulled.version} does not fit the model")
        return _Report()


@attrs.frozen
class _Report:
    def as_dict(self) -> dict:
        return {}


@pytest.mark.parametrize("mirrors", [2, 1])
async def test_a_failed_apply_reloads_the_served_version_from_the_spare_and_without_one_says_it_holds_none(mirrors):
    registry = InProcessRegistry()
    publisher = Publisher(registry, FakeTransport(), rollout_dtype=None, bucket_bytes=2048)
    pulls = await background(registry, mirrors=mirrors)
    worker = _Worker(pulls, failing={3})

    async def apply(version: int) -> dict:
        await publisher.publish(version, host_tensors(version))
        await anyio.to_thread.run_sync(worker.weightpull_prefetch, version)
        await anyio.to_thread.run_sync(settle, pulls)
        return await anyio.to_thread.run_sync(worker.weightpull_apply, version, 5.0)

    try:
        assert (await apply(1))["ok"]
        worker.weightpull_commit(1)
        assert (await apply(2))["ok"]
        worker.weightpull_commit(2)
        failed = await apply(3)
        assert (failed["ok"], failed["stage"], failed["error"]["type"]) == (False, "load", "ValueError")
        if mirrors == 2:  # v2's exact bytes from the serving mirror
            assert failed["restored"] == 2 and worker.loaded == [(1, True), (2, True), (3, True), (2, True)]
        else:  # v2's only copy took v3: nothing to go back to (and v2, RETIRED, takes no new lease)
            assert failed["restored"] is None and worker.loaded == [(1, True), (2, True), (3, True)]
            assert worker.weightpull_revert() is None  # another worker's failure: the same answer
    finally:
        await anyio.to_thread.run_sync(pulls.close)


# -- a slice's mirrors ---------------------------------------------------------------------


def _full(version: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(version)
    return {s.name: rng.integers(-(2**31), 2**31 - 1, size=s.shape, dtype=np.int32) for s in SPECS}


@pytest.mark.parametrize("mirrors", [1, 2])
async def test_prepare_registers_a_slices_mirrors_at_its_size_before_any_version(mirrors):
    registry = InProcessRegistry()
    publisher = Publisher(registry, FakeTransport(), rollout_dtype=None, bucket_bytes=2048, num_slots=2)
    await publisher.reserve(SPECS)
    rank_slice = _slice(SPECS, 1, 2, 2)
    pulls = await background(registry, mirrors=mirrors, rank_slice=rank_slice)
    try:
        assert pulls.status()["mirror_bytes"] == 0
        mapped = await anyio.to_thread.run_sync(lambda: pulls.prepare().result(10))
        assert mapped == mirrors * len(publisher.slots)  # each mirror's puller maps every reserved slot
        slice_bytes = rank_slice.layout().total_bytes
        mirrors_made = [p.mirror for p in pulls.pair.pullers]
        assert [m.nbytes for m in mirrors_made] == [slice_bytes] * mirrors
        assert pulls.status()["mirror_bytes"] == mirrors * slice_bytes < mirrors * sum(s.nbytes for s in SPECS)

        full = _full(1)
        await publisher.publish(1, {n: HostTensor("int32", a.shape, a.tobytes()) for n, a in full.items()})
        first = await pulled(pulls, 1)
        assert first.region in mirrors_made  # pulled into a mirror made ahead
        _check(first, full, 1, 2)
    finally:
        await anyio.to_thread.run_sync(pulls.close)
