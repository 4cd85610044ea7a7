"""What verl asks of every checkpoint engine, checked in one process against verl's own
registry and manager code: found by name once `custom_backend_module` is imported, built
from `engine_kwargs` with verl's arguments, a topology of the lengths verl's manager
asserts; and bad settings refused at construction with a typed error naming them."""

import pytest
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


async def test_a_trainer_rank_that_is_not_the_master_takes_part_and_publishes_nothing():
    engine = new(is_master=False, registry="ray://never-reached")
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
