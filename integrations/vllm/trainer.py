"""weightpull as a backend of vLLM's own weight-transfer API (the trainer's side).

A trainer on vLLM's API switches from `nccl` or `ipc` by giving
`WeightTransferTrainerFactory.trainer_init` a `WeightpullTrainerInitInfo` in place of
their init info, and the server `--weight-transfer-config '{"backend": "weightpull"}'`:

    engine = WeightTransferTrainerFactory.trainer_init(
        WeightpullTrainerInitInfo(registry="tcp://trainer:5555", rank=rank),
        client=HTTPVLLMWeightSyncClient("http://replica:8000"),
        source=ModuleSource(model),
    )
    engine.send_weights()  # after each optimizer step, on every trainer rank

`send_weights()` publishes the source (checkpoint names, full shapes, each tensor in its
metadata dtype) as the next version into a slot registered once, then drives the
handshake through the client: `start_weight_update`, `update_weights({"version": N})`
(each worker pulls N one-sided and loads it checked), `finish_weight_update("N")`. Every
trainer rank calls it: they iterate the source in lockstep (gathering a sharded weight
is a collective), rank 0 snapshots and publishes. With `agent=True` the replicas pull and
apply on their own schedule and `send_weights` only publishes.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self

import torch
from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine, WeightSource

from weightpull.errors import InvalidArgumentError, WeightpullError
from weightpull.layout import TensorSpec
from weightpull.registry import connect_registry
from weightpull.tensors import normalize_dtype

from ..torch_snapshot import SnapshotPublisher
from .backend import BACKEND, InitInfo
from .plugin import register

log = logging.getLogger(__name__)


class ReplicaUpdateError(WeightpullError):
    """A replica refused or failed a step of the update handshake: the version stays
    published, and the replica serves what it served before (the message is its own)."""


@dataclass
class WeightpullTrainerInitInfo(TrainerInitInfo):
    """The trainer's side of the `weightpull` backend.

    Args:
        registry: The served registry's address (tcp://HOST:PORT).
        transport: The driver replicas read the slot with ("nixl"; "cuda_ipc" on one host).
        slot_device: Where the slot lies ("cpu", or a GPU for `cuda_ipc`).
        replica: What each replica's workers are told at init, `PullSpec`'s fields as a
            dict (`registry` defaults to this one; `transport` to this one's).
        agent: True (or `AgentOptions`' fields): each replica runs weightpull's update
            agent and pulls on its own schedule; `send_weights` only publishes.
        name: The publisher's name (default: the registry key's principal, else random).
        first_version: The first version published; None: one past the registry's newest.
        timeout: Seconds a replica waits for its version to be published and pulled.
        registry_options: Keyword arguments of `connect_registry` (keys, ...).
        transport_options: Keyword arguments of `create_transport`.
        publisher_options: Keyword arguments of the `Publisher` (`num_slots`, `when_full`, ...).
        rank: This trainer process's rank; rank 0 publishes and drives the replicas.
    """

    backend: ClassVar[str] = BACKEND

    registry: str = ""
    transport: str = "nixl"
    slot_device: str = "cpu"
    replica: dict[str, Any] = field(default_factory=dict)
    agent: bool | dict[str, Any] = False
    name: str | None = None
    first_version: int | None = None
    timeout: float = 60.0
    registry_options: dict[str, Any] = field(default_factory=dict)
    transport_options: dict[str, Any] = field(default_factory=dict)
    publisher_options: dict[str, Any] = field(default_factory=dict)

    def replica_init(self) -> dict[str, Any]:
        """The init_info each replica's workers get, checked here first (as a worker
        would check it), so a bad one fails in the trainer with the reason."""
        info = {"registry": self.registry, "transport": self.transport, **self.replica}
        if self.agent:
            info["agent"] = self.agent
        InitInfo.parse(info, holder="check", tensor_parallel=1)
        return info


class WeightpullTrainerEngine(TrainerWeightTransferEngine[WeightpullTrainerInitInfo]):
    """vLLM's `TrainerWeightTransferEngine` for weightpull: publish, then let replicas pull."""

    init_info_cls = WeightpullTrainerInitInfo

    def __init__(self, *, client: Any, source: WeightSource | None = None, is_sender: bool = True) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.info: WeightpullTrainerInitInfo | None = None
        self.publisher: SnapshotPublisher | None = None  # rank 0's
        self.version: int | None = None  # the last one published

    @classmethod
    def trainer_init(
        cls, init_info: WeightpullTrainerInitInfo, *, client: Any, source: WeightSource | None = None
    ) -> Self:
        """Register the slot (rank 0) and tell the replicas where to pull from.

        Raises:
            InvalidArgumentError: No source, no registry, or a bad replica init.
            ReplicaUpdateError: The replicas refused the init.
        """
        if not isinstance(init_info, WeightpullTrainerInitInfo):
            raise InvalidArgumentError(f"init_info must be a WeightpullTrainerInitInfo, got {type(init_info).__name__}")
        if source is None:
            raise InvalidArgumentError(
                "the weightpull backend publishes a WeightSource: pass source=ModuleSource(model)"
            )
        if not init_info.registry:
            raise InvalidArgumentError("WeightpullTrainerInitInfo.registry must be the served registry's address")
        replica = init_info.replica_init()
        engine = cls(client=client, source=source, is_sender=init_info.is_sender)
        engine.info = init_info
        if engine.is_sender:
            specs = [TensorSpec(m.name, normalize_dtype(m.dtype), tuple(m.shape)) for m in source.metadata()]
            engine.publisher = SnapshotPublisher(
                connect_registry(init_info.registry, **init_info.registry_options),
                init_info.transport,
                specs,
                device=init_info.slot_device,
                slot_device=init_info.slot_device,
                rollout_dtype=None,  # each tensor goes in its metadata dtype (the wire dtype)
                transport_options=init_info.transport_options,
                close_registry=True,
                **({"name": init_info.name} if init_info.name else {}),
                **init_info.publisher_options,
            )
            engine.version = init_info.first_version - 1 if init_info.first_version is not None else None
            _drive("init_weight_transfer_engine", client.init_weight_transfer_engine, replica)
        return engine

    def send_weights(self, version: int | None = None) -> int:
        """Publish the source as `version` (None: the next one), then, unless the replicas
        run their agent, have them load it. Call it on every trainer rank. Returns the
        version.

        Raises:
            PublishError: The snapshot or the announcement failed.
            ReplicaUpdateError: A replica failed to load it (it serves its last good one).
        """
        assert self.source is not None and self.info is not None
        if not self.is_sender:  # the collectives of the iteration, in lockstep with rank 0
            for _ in self._iterate():
                pass
            return -1
        assert self.publisher is not None
        if version is None:
            version = (self.version if self.version is not None else self._newest()) + 1
        ticket = self.publisher.publish(version, self._iterate())
        ticket.result(self.info.timeout)  # READY: replicas may lease it
        self.version = version
        if not self.info.agent:
            _drive("start_weight_update", self.client.start_weight_update)
            _drive(
                "update_weights",
                self.client.update_weights,
                {"version": version, "timeout": self.info.timeout},
            )
            _drive("finish_weight_update", self.client.finish_weight_update, str(version))
        return version

    def shutdown(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
            self.publisher = None

    def _iterate(self) -> Iterator[tuple[str, torch.Tensor]]:
        assert self.source is not None
        for names, tensors in self.source.iter_groups():  # honours the source's groups()
            yield from zip(names, tensors, strict=True)

    def _newest(self) -> int:
        assert self.publisher is not None
        newest = self.publisher.call(self.publisher.publisher.registry.newest)
        return -1 if newest is None else newest.version


def _drive(step: str, call: Any, *args: Any) -> None:
    """One step of the handshake, its failure as a `ReplicaUpdateError` with the replica's words."""
    try:
        call(*args)
    except Exception as exc:
        raise ReplicaUpdateError(f"the replica failed {step}: {_reason(exc)}") from exc


def _reason(exc: Exception) -> str:
    response = getattr(exc, "response", None)  # requests' HTTPError: the server's JSON error
    if response is not None:
        try:
            error = response.json().get("error", {})
            return str(error.get("message", error) if isinstance(error, dict) else error)
        except ValueError:
            return f"{exc} ({response.text[:500]})"
    return f"{type(exc).__name__}: {exc}"


register()  # the trainer's process loads no vLLM plugins: the backend's name resolves once this is imported


class OfflineClient:
    """vLLM's offline `LLM` as a `VLLMWeightSyncClient`: its weight-sync methods take
    request objects (or their dict forms) where the protocol passes the infos alone."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: Any) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)
