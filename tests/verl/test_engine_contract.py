"""What verl asks of every checkpoint engine, checked in one process against verl's own
registry and manager code: found by name once `custom_backend_module` is imported, built
from `engine_kwargs` with verl's arguments, a topology of the lengths verl's manager
asserts; bad settings refused at construction with a typed error naming them, and weights
a sharded publish cannot take refused before anything is published."""

import pytest
import torch
from verl.checkpoint_engine import CheckpointEngine, CheckpointEngineRegistry
from verl.utils.import_utils import import_external_libs

from weightpull.errors import InvalidArgumentError, UnknownDriverError, WeightpullError

import_external_libs("weightpull.integrations.verl")  # what verl does with custom_backend_module

from weightpull.integrations.verl import TransportPullCheckpointEngine  # noqa: E402

pytestmark = pytest.mark.anyio


def new(**kwargs):
    return CheckpointEngineRegistry.new("transport_pull", bucket_size=1 << 20, **kwargs)


def test_verl_finds_the_engine_by_name():
    cls = CheckpointEngineRegistry.get("transport_pull")
    assert cls is TransportPullCheckpointEngine and issubclass(cls, CheckpointEngine)
    engine = new(is_master=True)  # the defaults: nixl, host memory, 2 slots, bf16, ray://weightpull
    assert engine.settings.transport == "nixl" and engine.settings.registry == "ray://weightpull"


def test_the_topology_has_one_entry_per_worker():
    engine = new()
    metadata = [engine.prepare() for _ in range(5)]
    actor, rollout = TransportPullCheckpointEngine.build_topology(2, 3, metadata)
    assert {k: len(v) for k, v in actor.items()} == {"rank": 2}
    assert {k: len(v) for k, v in rollout.items()} == {"rank": 3}
    engine.init_process_group(**{k: v[0] for k, v in rollout.items()})
    engine.finalize()
    with pytest.raises(InvalidArgumentError, match="different registries"):
        TransportPullCheckpointEngine.build_topology(1, 1, [{"registry": "ray://a"}, {"registry": "ray://b"}])


@pytest.mark.parametrize("world", [None, "2"], ids=["one-rank", "whole-of-two"])
async def test_a_trainer_rank_that_is_not_the_master_takes_part_and_publishes_nothing(monkeypatch, world):
    """Publishing whole: asked for, or a lone trainer rank (its one shard is the whole)."""
    if world is not None:
        monkeypatch.setenv("RANK", "1")
        monkeypatch.setenv("WORLD_SIZE", world)
    engine = new(is_master=False, registry="ray://never-reached", publish="whole" if world else "sharded")
    taken = []

    def weights():
        for name in ("a", "b"):
            taken.append(name)  # a gather would run here, on every rank
            yield name, None

    assert await engine.send_weights(weights(), global_steps=3) == {}
    assert taken == ["a", "b"] and engine.publisher is None


@pytest.mark.parametrize(
    ("setting", "value", "error", "named"),
    [
        ("transport", "carrier-pigeon", UnknownDriverError, "carrier-pigeon"),
        ("num_slots", 1, InvalidArgumentError, "num_slots"),
        ("num_slots", "2", InvalidArgumentError, "num_slots"),
        ("lease_ttl", 0, InvalidArgumentError, "lease_ttl"),
        ("device", "tpu", InvalidArgumentError, "device"),
        ("rollout_dtype", "float7", InvalidArgumentError, "rollout_dtype"),
        ("registry", "localhost", InvalidArgumentError, "registry"),
        ("slots", 2, InvalidArgumentError, "slots"),
        ("publish", "scattered", InvalidArgumentError, "publish"),
        ("sliced", "yes", InvalidArgumentError, "sliced"),
        ("sliced", 1, InvalidArgumentError, "sliced"),
        ("sliced", True, InvalidArgumentError, "sliced is true but tensor_parallel_size is 1"),
        ("tensor_parallel_size", 0, InvalidArgumentError, "tensor_parallel_size"),
        ("tensor_parallel_size", "2", InvalidArgumentError, "tensor_parallel_size"),
        ("tensor_parallel_size", True, InvalidArgumentError, "tensor_parallel_size"),
    ],
)
def test_bad_settings_are_refused_by_name(setting, value, error, named):
    with pytest.raises(error, match=named) as caught:
        new(**{setting: value})
    assert isinstance(caught.value, WeightpullError)


def test_rollout_dtype_takes_verls_spellings():
    import torch

    assert new(rollout_dtype=torch.bfloat16).settings.rollout_dtype == "bfloat16"
    assert new(rollout_dtype=None).settings.rollout_dtype is None


def test_sliced_is_auto_by_default_and_follows_the_tensor_parallel_size():
    assert new().settings.slices is False  # one rank: it reads the whole anyway
    assert new(tensor_parallel_size=2).settings.slices is True
    assert new(tensor_parallel_size=2, sliced=False).settings.slices is False
    assert new(tensor_parallel_size=4, sliced=True).settings.slices is True


def test_a_sliced_worker_without_a_rank_is_refused_saying_where_it_comes_from(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    engine = new(tensor_parallel_size=2, registry="ray://never-reached")
    with pytest.raises(InvalidArgumentError, match=r"\$RANK"):
        engine.prefetch()


@pytest.mark.parametrize(
    ("name", "tensor", "named"),
    [
        ("step", torch.tensor(3.0), "'step' is a scalar.*publish to 'whole'"),
    ],
)
async def test_a_weight_a_shard_cannot_hold_is_refused_before_anything_is_published(monkeypatch, name, tensor, named):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    engine = new(is_master=True, registry="ray://never-reached")
    with pytest.raises(InvalidArgumentError, match=named):
        await engine.send_weights(iter([("w", torch.ones(4, 2)), (name, tensor)]), global_steps=1)
    assert engine.publisher is None
