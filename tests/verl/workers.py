"""verl workers for the tests, built as verl's own engine tests build theirs: a trainer
worker that owns a model and a checkpoint engine made by `CheckpointEngineRegistry`, and
a rollout worker that is verl's `CheckpointEngineWorker` with a server adapter that keeps
what it was given (there is no inference server on a CPU machine)."""

from __future__ import annotations

import weakref
from collections.abc import Iterator

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from verl.checkpoint_engine import CheckpointEngineRegistry, CheckpointEngineWorker
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register
from verl.single_controller.ray import RayWorkerGroup
from verl.utils.import_utils import import_external_libs
from verl.workers.config import CheckpointEngineConfig
from verl.workers.rollout import BaseRollout, RolloutReplica

TINY = LlamaConfig(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    max_position_embeddings=64,
)


def rollout_view(state: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """What a replica must receive of `state`: fp32 cast to the rollout dtype, else as is."""
    return {n: t.to(dtype) if dtype is not None and t.dtype == torch.float32 else t.clone() for n, t in state.items()}


class Live:
    """Bytes of the weights a trainer's iterator yielded that are still alive, and the
    most at once: what a rank held of what verl's iterator gathered for it."""

    def __init__(self) -> None:
        self.now = self.peak = 0

    def track(self, t: torch.Tensor) -> torch.Tensor:
        n = t.numel() * t.element_size()
        self.now += n
        self.peak = max(self.peak, self.now)
        weakref.finalize(t, self._gone, n)
        return t

    def _gone(self, n: int) -> None:
        self.now -= n


class TrainerWorker(Worker):
    """A trainer rank: a tiny Llama (the same on every rank) and the engine verl's
    TrainingWorker would build for it."""

    def __init__(self, config: CheckpointEngineConfig) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = LlamaForCausalLM(TINY)
        import_external_libs(config.custom_backend_module or None)
        self.checkpoint_engine = CheckpointEngineRegistry.new(
            config.backend,
            is_master=self.rank == 0,
            bucket_size=config.update_weights_bucket_megabytes << 20,
            **config.engine_kwargs.get(config.backend, {}),
        )

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def train_step(self, step: int) -> None:
        """Move every weight, the same way on every rank."""
        g = torch.Generator().manual_seed(step)
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.01)

    def gathered(self) -> Iterator[tuple[str, torch.Tensor]]:
        """What verl's FSDP engine yields (`get_per_tensor_param`): each weight whole, a
        new tensor (its `full_tensor()`), one at a time."""
        self.live = Live()
        for name, tensor in self.model.state_dict().items():
            yield name, self.live.track(tensor.detach().clone())

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    async def update_weights(self, global_steps: int | None = None, mode: str = "auto"):
        self.last_metrics = await self.checkpoint_engine.send_weights(self.gathered(), global_steps)
        return self.last_metrics

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def memory(self) -> dict[str, int]:
        """What the last update held on this rank: the most bytes of the yielded weights
        alive at once, the most the engine held (its own count), and each slot's size."""
        publisher = self.checkpoint_engine.publisher
        slots = [] if publisher is None else [s.region.nbytes for s in publisher.slots if s.region is not None]
        return {
            "live_peak": self.live.peak,
            "held_peak": self.last_metrics.get("transport_pull/held_bytes_peak", 0),
            "slot_bytes": max(slots, default=0),
        }

    @register(dispatch_mode=Dispatch.DP_COMPUTE, blocking=False)
    def execute_checkpoint_engine(self, method: str, *args, **kwargs):
        return getattr(self.checkpoint_engine, method)(*args, **kwargs)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def state(self) -> dict[str, torch.Tensor]:
        return {n: t.clone() for n, t in self.model.state_dict().items()}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def slot_regions(self) -> list[int]:
        """Which memory each slot uses (ids; empty on a rank that does not publish)."""
        publisher = self.checkpoint_engine.publisher
        return [] if publisher is None else [id(s.region) for s in publisher.slots if s.region is not None]


class KeepingAdapter(BaseRollout):
    """A server adapter that keeps a copy of every weight it is given (as verl's engine
    tests' adapter does), and the steps it was given them at."""

    def __init__(self, config, model_config) -> None:
        super().__init__(config, model_config, device_mesh=None)
        self.received: dict[str, torch.Tensor] = {}
        self.steps: list[int | None] = []

    async def update_weights(self, weights, **kwargs) -> None:
        async for name, weight in weights:
            self.received[name] = weight.clone()
        self.steps.append(kwargs.get("global_steps"))

    async def resume(self, tags: list[str]):
        raise NotImplementedError

    async def release(self):
        raise NotImplementedError


class RolloutWorker(CheckpointEngineWorker):
    def __init__(self, rollout_config, model_config=None) -> None:
        super().__init__(rollout_config, model_config, KeepingAdapter(rollout_config, model_config))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def received(self) -> tuple[dict[str, torch.Tensor], list, int | None, dict, dict | None]:
        """What the adapter was given, at which steps, the version received, the pulls'
        figures and (sliced) the box of each weight this worker read."""
        engine = self.checkpoint_engine
        sliced = engine.rank_slice
        boxes = None if sliced is None else {p.name: [pc.box for pc in p.pieces] for p in sliced.params}
        return (
            self.server_adapter.received,
            self.server_adapter.steps,
            engine.received_version,
            engine.pull_figures,
            boxes,
        )


class Replica(RolloutReplica):
    """A replica of `world_size` rollout workers of a worker group, and no server to
    launch (abort, release and resume then reach no server: there is none)."""

    async def init_hybrid(self, worker_group: RayWorkerGroup) -> None:
        self.workers = worker_group.workers[
            self.world_size * self.replica_rank : self.world_size * (self.replica_rank + 1)
        ]

    def get_ray_class_with_init_args(self):
        raise NotImplementedError

    async def launch_servers(self) -> None:
        pass
