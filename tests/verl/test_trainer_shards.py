"""A trainer rank's shard of what verl's iterator yields (`shards.take_shard`), in one
process: its dim-0 rows of each whole weight, copied in the slot's dtype with the whole
one let go; a DTensor's own rows as they are, nothing gathered; one placed otherwise
gathered first; what a shard cannot be refused, naming the setting that publishes it
whole."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from weightpull.errors import InvalidArgumentError
from weightpull.integrations.verl.shards import Held, take_shard, trainer_place

pytestmark = pytest.mark.anyio

WEIGHTS = {"embed": (7, 4), "norm": (4,), "head": (1, 4)}  # 7 rows: shards of 4 and 3; 1 row: one holds none


def whole(name):
    return torch.arange(torch.Size(WEIGHTS[name]).numel(), dtype=torch.float32).reshape(WEIGHTS[name]) + 0.1


@pytest.mark.parametrize(
    ("index", "rows"),
    [(0, {"embed": (0, 4), "norm": (0, 2), "head": (0, 1)}), (1, {"embed": (4, 7), "norm": (2, 4), "head": (1, 1)})],
)
async def test_each_rank_keeps_its_rows_in_the_slot_dtype_and_lets_the_whole_go(index, rows):
    held = Held()
    yielded = []

    def gathered():
        for name in WEIGHTS:
            t = whole(name)
            yielded.append(t.untyped_storage().data_ptr())
            yield name, t

    local, sharding = await take_shard(gathered(), index, 2, "bfloat16", held)
    assert (sharding.index, sharding.count) == (index, 2)
    assert dict(sharding.shapes) == WEIGHTS
    for name, t in local:
        a, b = rows[name]
        assert sharding.starts[name] == a
        assert t.dtype == torch.bfloat16 and torch.equal(t, whole(name)[a:b].to(torch.bfloat16))
        assert t.untyped_storage().data_ptr() not in yielded or t.numel() == 0  # a copy: the whole one can go
    kept = sum(t.numel() * 2 for _, t in local)
    assert held.now == kept and held.peak <= kept + 7 * 4 * 4  # its rows and one whole weight at most


@pytest.fixture
def two_ranks():
    """This process as rank 1 of a two-rank group (a fake one: nothing is sent)."""
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    try:
        yield init_device_mesh("cpu", (2,))
    finally:
        dist.destroy_process_group()


async def test_a_dtensors_own_rows_are_published_as_they_are(two_ranks):
    assert trainer_place() == (1, 2)
    full = whole("embed")
    d = DTensor.from_local(full[4:7].clone(), two_ranks, [Shard(0)], shape=full.shape, stride=full.stride())
    local, sharding = await take_shard([("embed", d)], 1, 2, "bfloat16", Held())
    assert local[0][1].untyped_storage().data_ptr() == d.to_local().untyped_storage().data_ptr()  # no copy
    assert sharding.starts == {"embed": 4} and sharding.shapes == {"embed": (7, 4)}


async def test_a_dtensor_placed_otherwise_is_gathered_then_taken_as_a_whole_weight(two_ranks):
    full = whole("embed")
    d = DTensor.from_local(full.clone(), two_ranks, [Replicate()], shape=full.shape, stride=full.stride())
    held = Held()
    local, sharding = await take_shard([("embed", d)], 1, 2, "bfloat16", held)
    assert torch.equal(local[0][1], full[4:7].to(torch.bfloat16)) and sharding.starts == {"embed": 4}
    assert held.peak == full.numel() * 4  # the gathered whole weight, while its rows were copied


async def test_a_mesh_in_another_order_than_the_trainer_ranks_is_refused_naming_the_whole_setting(two_ranks):
    full = whole("embed")
    d = DTensor.from_local(full[4:7].clone(), two_ranks, [Shard(0)], shape=full.shape, stride=full.stride())
    with pytest.raises(InvalidArgumentError, match="shard 1 of 2 but this trainer rank is 0.*publish to 'whole'"):
        await take_shard([("embed", d)], 0, 2, "bfloat16", Held())
