"""`transport_pull` under verl's own `CheckpointEngineManager`, as verl's engine tests run
nccl and nixl: two trainer ranks and two replicas (one rollout worker each), each a Ray
actor of its own, on a local Ray instance; weights published over nixl into the trainer's
slots and pulled by each replica, compared bit for bit after every update. Then the
decoupled path: the trainer publishes alone, the replicas prefetch while they would be
generating, and the update only hands the mirror over."""

import uuid
from contextlib import asynccontextmanager

import pytest
import ray
import torch
from verl.checkpoint_engine import CheckpointEngineManager
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from verl.single_controller.ray.base import split_resource_pool
from verl.workers.config import CheckpointEngineConfig, RolloutConfig

from .weights import same_bits
from .workers import Replica, RolloutWorker, TrainerWorker, rollout_view

pytestmark = pytest.mark.anyio
UPDATES = 3


def config(rollout_dtype="bfloat16") -> CheckpointEngineConfig:
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
            }
        },
    )


@asynccontextmanager
async def started(checkpoint_engine: CheckpointEngineConfig):
    """Two trainer ranks and two replicas of one rollout worker each; gone afterwards,
    with the CPUs their placement groups held."""
    pool = RayResourcePool(process_on_nodes=[4], use_gpu=False, max_colocate_count=1)
    trainer_pool, rollout_pool = split_resource_pool(pool, [2, 2])
    trainer = RayWorkerGroup(
        resource_pool=trainer_pool,
        ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(TrainerWorker), config=checkpoint_engine),
        device_name="cpu",
    )
    rollout_config = RolloutConfig(name="vllm", tensor_model_parallel_size=1, checkpoint_engine=checkpoint_engine)
    rollout = RayWorkerGroup(
        resource_pool=rollout_pool,
        ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(RolloutWorker), rollout_config=rollout_config),
        device_name="cpu",
    )
    replicas = [Replica(replica_rank=i, config=rollout_config, model_config=None) for i in range(2)]
    for replica in replicas:
        await replica.init_hybrid(rollout)
    try:
        yield trainer, rollout, CheckpointEngineManager(config=checkpoint_engine, actor_wg=trainer, replicas=replicas)
    finally:
        for worker in trainer.workers + rollout.workers:
            ray.kill(worker)
        for pg in pool.get_placement_groups():
            ray.util.remove_placement_group(pg)


def check_replicas(trainer, rollout, version: int, dtype) -> list[dict]:
    """Every replica received exactly the trainer's weights of `version`; their puller
    figures."""
    want = rollout_view(trainer.state()[0], dtype)
    figures = []
    for received, steps, received_version, metrics in rollout.received():
        assert received_version == version
        assert steps[-1] == version
        assert same_bits(received, want) == []
        figures.append(metrics)
    return figures


@pytest.mark.parametrize("dtype", [torch.bfloat16, None], ids=["bf16", "as-trained"])
async def test_updates_through_verls_manager_are_bit_exact(ray_local, dtype):
    checkpoint_engine = config(None if dtype is None else "bfloat16")
    async with started(checkpoint_engine) as (trainer, rollout, manager):
        await updates(trainer, rollout, manager, dtype)


async def updates(trainer, rollout, manager, dtype) -> None:
    regions = None
    for step in range(UPDATES):
        if step:
            trainer.train_step(step)
        await manager.update_weights(global_steps=step)
        figures = check_replicas(trainer, rollout, step, dtype)
        assert all(f["pull/pulls"] == step + 1 for f in figures)  # one pull per update, per replica
        master, other = trainer.slot_regions()
        assert other == []  # only rank 0 publishes
        if step >= 1:  # both slots made by now; never again
            regions = regions or master
            assert master == regions and len(master) == 2
    # The trainer moved: the pulls read what it published, not what it started from.
    assert same_bits(rollout.received()[0][0], rollout_view(trainer.state()[0], dtype)) == []


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
            assert all(f["pull/pulls"] == step + 1 for f in figures)  # no second pull for the update
