"""`transport_pull` under verl's own `CheckpointEngineManager`, as verl's engine tests run
nccl and nixl: two trainer ranks and two rollout workers, each a Ray actor of its own, on
a local Ray instance; weights published over nixl into the trainer's slots and pulled by
the rollout, compared bit for bit after every update.

- Two replicas of one worker each pull whole versions: from the trainer ranks' shards
  (each rank publishes its rows, none holds the whole model) and, the old path, from
  rank 0's whole copy.
- One replica of two tensor-parallel workers pulls sliced: each worker only its slice,
  which together make the trainer's weights.
- The decoupled path: the trainer publishes alone, the replicas prefetch while they
  would be generating, and the update only hands the mirror over.
"""

import uuid
from contextlib import asynccontextmanager

import pytest
import ray
import torch
from verl.checkpoint_engine import CheckpointEngineManager
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from verl.single_controller.ray.base import split_resource_pool
from verl.workers.config import CheckpointEngineConfig, RolloutConfig

from .weights import bits, same_bits
from .workers import Replica, RolloutWorker, TrainerWorker, rollout_view

pytestmark = pytest.mark.anyio
UPDATES = 3


def config(rollout_dtype="bfloat16", publish="sharded", tensor_parallel_size=1) -> CheckpointEngineConfig:
    return CheckpointEngineConfig(
        backend="transport_pull",
        update_weights_bucket_megabytes=1,  # several buckets, so several reads per pull
        custom_backend_module="weightpull.integrations.verl",
        engine_kwargs={
            "transport_pull": {
                "transport": "nixl",
                "device": "cpu",
                "num_slots": 2,
                "rollout_dtype": rollout_dtype,
                "lease_ttl": 10.0,
                "registry": f"ray://wp-{uuid.uuid4().hex[:8]}",
                "publish": publish,
                "tensor_parallel_size": tensor_parallel_size,  # sliced: 'auto', so sliced past 1
            }
        },
    )


@asynccontextmanager
async def started(checkpoint_engine: CheckpointEngineConfig, tp: int = 1):
    """Two trainer ranks and two rollout workers, as replicas of `tp` workers each; gone
    afterwards, with the CPUs their placement groups held."""
    pool = RayResourcePool(process_on_nodes=[4], use_gpu=False, max_colocate_count=1)
    trainer_pool, rollout_pool = split_resource_pool(pool, [2, 2])
    trainer = RayWorkerGroup(
        resource_pool=trainer_pool,
        ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(TrainerWorker), config=checkpoint_engine),
        device_name="cpu",
    )
    rollout_config = RolloutConfig(name="vllm", tensor_model_parallel_size=tp, checkpoint_engine=checkpoint_engine)
    rollout = RayWorkerGroup(
        resource_pool=rollout_pool,
        ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(RolloutWorker), rollout_config=rollout_config),
        device_name="cpu",
    )
    replicas = [Replica(replica_rank=i, config=rollout_config, model_config=None) for i in range(2 // tp)]
    for replica in replicas:
        await replica.init_hybrid(rollout)
    try:
        yield trainer, rollout, CheckpointEngineManager(config=checkpoint_engine, actor_wg=trainer, replicas=replicas)
    finally:
        for worker in trainer.workers + rollout.workers:
            ray.kill(worker)
        for pg in pool.get_placement_groups():
            ray.util.remove_placement_group(pg)


def nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def check_replicas(trainer, rollout, version: int, dtype) -> list[dict]:
    """Every rollout worker received exactly the trainer's weights of `version` (a sliced
    one: exactly them in every box it read, and together the workers read every element);
    their pull figures."""
    want = rollout_view(trainer.state()[0], dtype)
    figures = []
    covered = {name: torch.zeros(t.shape, dtype=torch.bool) for name, t in want.items()}
    workers = rollout.received()
    for received, steps, received_version, pulls, boxes in workers:
        assert received_version == version
        assert steps[-1] == version
        if boxes is None:
            assert same_bits(received, want) == []
        else:
            assert sorted(received) == sorted(want)
            for name, tensor_boxes in boxes.items():
                assert received[name].shape == want[name].shape and received[name].dtype == want[name].dtype
                for box in tensor_boxes:
                    index = tuple(slice(a, b) for a, b in box)
                    assert bits(received[name][index]) == bits(want[name][index]), name
                    covered[name][index] = True
        figures.append(pulls)
    if any(boxes is not None for *_, boxes in workers):
        assert [n for n, c in covered.items() if not c.all()] == []
    return figures


@pytest.mark.parametrize(
    ("dtype", "publish"), [(torch.bfloat16, "sharded"), (None, "whole")], ids=["bf16-sharded", "as-trained-whole"]
)
async def test_updates_through_verls_manager_are_bit_exact(ray_local, dtype, publish):
    checkpoint_engine = config(None if dtype is None else "bfloat16", publish=publish)
    async with started(checkpoint_engine) as (trainer, rollout, manager):
        await updates(trainer, rollout, manager, dtype, publish)


async def updates(trainer, rollout, manager, dtype, publish) -> None:
    regions = None
    for step in range(UPDATES):
        if step:
            trainer.train_step(step)
        await manager.update_weights(global_steps=step)
        figures = check_replicas(trainer, rollout, step, dtype)
        assert all(f["pulls"] == step + 1 for f in figures)  # one pull per update, per replica
        slots = trainer.slot_regions()
        if publish == "whole":
            assert slots[1] == []  # only rank 0 publishes
        else:
            assert all(slots)  # every rank publishes its shard
        if step >= 1:  # both slots of each publishing rank made by now; never again
            regions = regions or slots
            assert slots == regions and all(len(s) == 2 for s in slots if s)
    # The trainer moved: the pulls read what it published, not what it started from.
    assert same_bits(rollout.received()[0][0], rollout_view(trainer.state()[0], dtype)) == []
    whole = nbytes(trainer.state()[0])  # fp32, as yielded
    memory = trainer.memory()
    if publish == "whole":  # rank 0 holds every weight whole until its copy
        assert memory[0]["held_peak"] == whole and memory[0]["live_peak"] == whole
    else:  # each rank holds its rows and at most two whole weights, never the model
        largest = max(t.numel() * t.element_size() for t in trainer.state()[0].values())
        for m in memory:
            assert m["live_peak"] <= 2 * largest < whole
            assert m["held_peak"] < whole
            assert m["slot_bytes"] < 0.6 * nbytes(rollout_view(trainer.state()[0], dtype))  # its rows, in bf16


async def test_a_tensor_parallel_replica_pulls_each_workers_slice_from_the_trainers_shards(ray_local):
    """TP=2: each worker reads about half of the version, from both trainer ranks'
    shards; what the two hand their engine is the trainer's weights, box by box, after
    every update; the last update prefetched, so the update itself pulls nothing."""
    checkpoint_engine = config(tensor_parallel_size=2)
    async with started(checkpoint_engine, tp=2) as (trainer, rollout, manager):
        whole = nbytes(rollout_view(trainer.state()[0], torch.bfloat16))
        for step in range(UPDATES - 1):
            if step:
                trainer.train_step(step)
            await manager.update_weights(global_steps=step)
            figures = check_replicas(trainer, rollout, step, torch.bfloat16)
            assert all(f["pulls"] == step + 1 for f in figures)
            assert all(f["bytes_read"] < 0.75 * whole for f in figures)  # the KV and norms are read whole
        step = UPDATES - 1
        trainer.train_step(step)
        ray.get(trainer.update_weights(global_steps=step))
        held = ray.get(rollout.execute_checkpoint_engine(["prefetch"] * 2, wait=[True] * 2))
        assert held == [step, step]
        ray.get(rollout.update_weights(global_steps=step))
        figures = check_replicas(trainer, rollout, step, torch.bfloat16)
        assert all(f["pulls"] == UPDATES for f in figures)  # no second pull for the update


async def test_a_prefetch_while_generating_leaves_the_update_only_the_handover(ray_local):
    checkpoint_engine = config()
    async with started(checkpoint_engine) as (trainer, rollout, manager):
        await manager.update_weights(global_steps=0)  # the lockstep first load
        for step in (1, 2):
            trainer.train_step(step)
            ray.get(trainer.update_weights(global_steps=step))  # the trainer publishes and goes on
            held = ray.get(rollout.execute_checkpoint_engine(["prefetch"] * 2, wait=[True] * 2))
            assert held == [step, step]  # pulled while the replicas would still generate
            ray.get(rollout.update_weights(global_steps=step))  # the pause: only the handover
            figures = check_replicas(trainer, rollout, step, torch.bfloat16)
            assert all(f["pulls"] == step + 1 for f in figures)  # no second pull for the update
