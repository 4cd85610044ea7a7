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
metadata dtype unless `rollout_dtype` says otherwise) as the next version into slots
registered once, then drives the handshake through the client: `start_weight_update`,
`update_weights({"version": N})` (each worker pulls N one-sided and loads it checked),
`finish_weight_update("N")`. Every trainer rank calls it, iterating the source in
lockstep (materializing a sharded weight is a collective). With more than one rank each
publishes only its dim-0 rows of every weight, as one shard of a sharded version
(`publish="sharded"`, the default there), so no rank holds a slot of the whole model;
with `publish="whole"` rank 0 alone publishes it all. With `agent` the replicas pull and
apply on their own schedule and `send_weights` only publishes.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self

import torch
from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightSource,
)

from weightpull.errors import InvalidArgumentError, PublishError, ReplicaUpdateError
from weightpull.layout import TensorSpec
from weightpull.principals import Principal, Role
from weightpull.registry import Registry, connect_registry
from weightpull.sharding import Sharding, chunk_rows
from weightpull.tensors import normalize_dtype

from ..torch_snapshot import SnapshotPublisher
from .backend import BACKEND, InitInfo
from .plugin import register

log = logging.getLogger(__name__)

PUBLISH_MODES = ("auto", "sharded", "whole")


@dataclass
class WeightpullTrainerInitInfo(TrainerInitInfo):
    """The trainer's side of the `weightpull` backend. Beside these, vLLM's own `rank`
    (keyword only): this trainer process's rank; rank 0 drives the replicas.

    Args:
        registry: The served registry's address (tcp://HOST:PORT).
        transport: The driver replicas read the slots with ("nixl"; "cuda_ipc" on one host).
        slot_device: Where the slots lie ("cpu", or a GPU for `cuda_ipc`).
        staging_device: Where each snapshot is cast before its copy into a slot, off the
            trainer's critical path: the source's own device ("cuda" for a GPU trainer);
            None: `slot_device`.
        rollout_dtype: The dtype fp32 weights are published in ("bfloat16" halves their
            bytes); None: each in its metadata dtype, as vLLM's other backends send them.
        publish: "sharded": each trainer rank publishes its dim-0 rows of every weight, one
            shard of a sharded version; "whole": rank 0 publishes every weight whole;
            "auto": sharded when there is more than one rank.
        world_size: How many trainer ranks call `send_weights`; None: torch.distributed's
            world size once initialized, else 1.
        replica: What each replica's workers are told at init, `PullSpec`'s fields as a
            dict (`registry` defaults to this one; `transport` to this one's).
        agent: True (or `AgentOptions`' fields: the server's own `url`, `pause_mode`, ...):
            each replica runs weightpull's update agent and pulls on its own schedule;
            `send_weights` only publishes.
        name: The publisher's name; a sharded one's ranks publish as `NAME/rankN`
            (default: the registry key's principal, else a random one).
        first_version: The first version published; None: one past every version the
            registry knows of, or any replica serves (rank 0 decides; torch.distributed
            tells the others).
        timeout: Seconds a publish may take to be announced, and a replica to load it.
        registry_options: Keyword arguments of `connect_registry` (keys, ...).
        transport_options: Keyword arguments of `create_transport`.
        publisher_options: Keyword arguments of the `Publisher` (`num_slots`,
            `when_full` ("wait" unless given: the replicas are asked for this very
            version), ...).

    Raises:
        InvalidArgumentError: A field of the wrong kind or out of range, named.
    """

    backend: ClassVar[str] = BACKEND

    registry: str = ""
    transport: str = "nixl"
    slot_device: str = "cpu"
    staging_device: str | None = None
    rollout_dtype: str | None = None
    publish: str = "auto"
    world_size: int | None = None
    replica: dict[str, Any] = field(default_factory=dict)
    agent: bool | dict[str, Any] = False
    name: str | None = None
    first_version: int | None = None
    timeout: float = 60.0
    registry_options: dict[str, Any] = field(default_factory=dict)
    transport_options: dict[str, Any] = field(default_factory=dict)
    publisher_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.registry, str) or not self.registry:
            raise InvalidArgumentError(
                f"WeightpullTrainerInitInfo.registry must be the served registry's address "
                f"(tcp://HOST:PORT), got {self.registry!r}"
            )
        if self.publish not in PUBLISH_MODES:
            raise InvalidArgumentError(
                f"WeightpullTrainerInitInfo.publish must be one of {PUBLISH_MODES}, got {self.publish!r}"
            )
        for what, value, least in (("rank", self.rank, 0), ("world_size", self.world_size, 1)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < least):
                raise InvalidArgumentError(f"WeightpullTrainerInitInfo.{what} must be an int >= {least}, got {value!r}")
        if self.world_size is not None and self.rank >= self.world_size:
            raise InvalidArgumentError(
                f"WeightpullTrainerInitInfo.rank {self.rank} is not below world_size {self.world_size}"
            )
        if self.first_version is not None and (
            not isinstance(self.first_version, int) or isinstance(self.first_version, bool) or self.first_version < 0
        ):
            raise InvalidArgumentError(
                f"WeightpullTrainerInitInfo.first_version must be an int >= 0 or None, got {self.first_version!r}"
            )
        if not isinstance(self.timeout, (int, float)) or not 0 < self.timeout < math.inf:
            raise InvalidArgumentError(
                f"WeightpullTrainerInitInfo.timeout must be a positive number of seconds, got {self.timeout!r}"
            )
        if self.rollout_dtype is not None:
            self.rollout_dtype = normalize_dtype(self.rollout_dtype, "WeightpullTrainerInitInfo.rollout_dtype")

    def ranks(self) -> int:
        """How many trainer ranks call `send_weights` (`world_size`, else torch.distributed's)."""
        if self.world_size is not None:
            return self.world_size
        import torch.distributed as dist

        return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1

    def replica_init(self) -> dict[str, Any]:
        """The init_info each replica's workers get, checked here first (as a worker
        would check it), so a bad one fails in the trainer with the reason."""
        info = {"registry": self.registry, "transport": self.transport, **self.replica}
        if self.agent:
            info["agent"] = self.agent
        InitInfo.parse(info, holder="check")
        return info


class WeightpullTrainerEngine(TrainerWeightTransferEngine[WeightpullTrainerInitInfo]):
    """vLLM's `TrainerWeightTransferEngine` for weightpull: publish, then let replicas pull.

    Attributes:
        publisher: This rank's `SnapshotPublisher` (None on the ranks of a whole publish
            but rank 0).
        sharding: This rank's place in a sharded version (None: published whole).
        version: The last version published (before the first: one below it).
    """

    init_info_cls = WeightpullTrainerInitInfo

    def __init__(self, *, client: Any, source: WeightSource | None = None, is_sender: bool = True) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.info: WeightpullTrainerInitInfo | None = None
        self.publisher: SnapshotPublisher | None = None
        self.sharding: Sharding | None = None
        self.version: int = -1

    @classmethod
    def trainer_init(
        cls, init_info: WeightpullTrainerInitInfo, *, client: Any, source: WeightSource | None = None
    ) -> Self:
        """Register this rank's slots (each rank's when sharded, rank 0's when whole),
        agree on the first version, and tell the replicas where to pull from (rank 0).
        Call it on every trainer rank.

        Raises:
            InvalidArgumentError: No source, a source split by ownership (`held_names`), a
                weight with no dim 0 to shard, or a bad replica init.
            ReplicaUpdateError: The replicas refused the init.
        """
        if not isinstance(init_info, WeightpullTrainerInitInfo):
            raise InvalidArgumentError(f"init_info must be a WeightpullTrainerInitInfo, got {type(init_info).__name__}")
        if source is None:
            raise InvalidArgumentError(
                "the weightpull backend publishes a WeightSource: pass source=ModuleSource(model)"
            )
        if source.held_names() is not None:
            raise InvalidArgumentError(
                "the weightpull backend publishes every weight from every rank's iteration; a source "
                "whose ranks hold parts of the model (held_names(), pipeline or expert parallel) is not "
                "supported: iterate the whole model on every rank"
            )
        replica = init_info.replica_init()
        engine = cls(client=client, source=source, is_sender=init_info.is_sender)
        engine.info = init_info
        count = init_info.ranks()
        meta = source.metadata()
        specs: list[TensorSpec] | None = None
        if init_info.publish == "sharded" or (init_info.publish == "auto" and count > 1):
            engine.sharding = _sharding(meta, init_info.rank, count)
            specs = [
                TensorSpec(m.name, normalize_dtype(m.dtype), (_rows_of(engine.sharding, m.name), *m.shape[1:]))
                for m in meta
            ]
        elif engine.is_sender:
            specs = [TensorSpec(m.name, normalize_dtype(m.dtype), tuple(m.shape)) for m in meta]
        if specs is not None:
            engine.publisher = _publisher(init_info, specs, engine.sharding)
        try:
            engine.version = _agree_first(engine, count) - 1
            if engine.is_sender:
                _drive("init_weight_transfer_engine", client.init_weight_transfer_engine, replica)
        except BaseException:
            engine.shutdown()  # the slots go: nothing will publish into them
            raise
        return engine

    def send_weights(self, version: int | None = None) -> int:
        """Publish the source as `version` (None: the next), then, unless the replicas run
        their agent, have them load it. Call it on every trainer rank, with the same
        `version`. Returns the version published (the registry's number for it).

        Args:
            version: The number to publish under; None: one past the last.

        Raises:
            PublishError: The snapshot or the announcement failed, or no slot was free.
            ReplicaUpdateError: A replica failed to load it (it serves its last good one).
        """
        assert self.source is not None and self.info is not None
        version = self.version + 1 if version is None else version
        if self.publisher is None:  # a rank of a whole publish: the iteration's collectives alone
            for _ in self._whole():
                pass
        else:
            tensors = self._whole() if self.sharding is None else self._shard()
            ticket = self.publisher.publish(version, tensors, shard=self.sharding)
            try:
                result = ticket.result(self.info.timeout)  # READY (sharded: this rank's shard committed)
            except concurrent.futures.TimeoutError:
                raise PublishError(f"v{version} was not announced within {self.info.timeout} s") from None
            assert result is not None
            if result.skipped:
                raise PublishError(f"v{version} was skipped: no slot was free (publisher_options when_full)")
            version = result.version
        self.version = version
        if self.is_sender and not self.info.agent:
            _drive("start_weight_update", self.client.start_weight_update)
            _drive(
                "update_weights",
                self.client.update_weights,
                {"version": version, "timeout": self.info.timeout},
            )
            _drive("finish_weight_update", self.client.finish_weight_update, str(version))
        return version

    def shutdown(self) -> None:
        """Deregister this rank's slots: the versions in them stop being readable."""
        if self.publisher is not None:
            self.publisher.close()
            self.publisher = None

    def _groups(self) -> Iterator[tuple[str, Any]]:
        assert self.source is not None
        for names, tensors in self.source.iter_groups():  # honours the source's groups()
            yield from zip(names, tensors, strict=True)

    def _whole(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every weight whole; one the source yields sharded is gathered (every rank alike)."""
        for name, tensor in self._groups():
            yield name, _full(tensor)

    def _shard(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's dim-0 rows of every weight, as views (the snapshot copies each at
        once, so a gathered weight goes before the next comes); a DTensor placed FSDP2's
        way over the trainer ranks gives its own rows, gathering nothing."""
        assert self.sharding is not None
        index, count = self.sharding.index, self.sharding.count
        for name, tensor in self._groups():
            start = self.sharding.starts[name]
            stop = start + _rows_of(self.sharding, name)
            if _dim0_of_ranks(tensor, count):
                if tensor.device_mesh.get_local_rank() != index:
                    raise InvalidArgumentError(
                        f"{name!r} is shard {tensor.device_mesh.get_local_rank()} of its mesh but this trainer "
                        f"rank is {index}: give init_info.rank in the mesh's order, or publish='whole'"
                    )
                yield name, tensor.to_local()
            else:
                yield name, _full(tensor)[start:stop]


def _full(tensor: Any) -> torch.Tensor:
    full_tensor = getattr(tensor, "full_tensor", None)  # a DTensor: a collective gather
    return full_tensor() if callable(full_tensor) else tensor


def _dim0_of_ranks(tensor: Any, count: int) -> bool:
    """Whether a DTensor's own rows are a rank's shard: FSDP2's `Shard(0)` on a 1-d mesh
    of the trainer ranks (the same answer on every rank, so every rank takes one path)."""
    from torch.distributed.tensor import DTensor, Shard

    return (
        isinstance(tensor, DTensor)
        and tensor.device_mesh.ndim == 1
        and tensor.device_mesh.size() == count
        and tuple(tensor.placements) == (Shard(0),)
    )


def _sharding(meta: list[ParamMeta], index: int, count: int) -> Sharding:
    """Rank `index` of `count`'s place: torch.chunk's rows of every weight (FSDP2's rule)."""
    scalars = [m.name for m in meta if not m.shape]
    if scalars:
        raise InvalidArgumentError(f"{scalars[:3]} have no dim 0 to shard over the trainer ranks; set publish='whole'")
    return Sharding(
        index,
        count,
        {m.name: tuple(m.shape) for m in meta},
        {m.name: chunk_rows(m.shape[0], index, count)[0] for m in meta},
    )


def _rows_of(sharding: Sharding, name: str) -> int:
    a, b = chunk_rows(sharding.shapes[name][0], sharding.index, sharding.count)
    return b - a


def _principal_name(registry: Registry) -> str | None:
    principal = getattr(registry, "principal", None)
    return principal.name if isinstance(principal, Principal) and principal.role is Role.PUBLISHER else None


def _publisher(
    info: WeightpullTrainerInitInfo, specs: list[TensorSpec], sharding: Sharding | None
) -> SnapshotPublisher:
    registry = connect_registry(info.registry, **info.registry_options)
    name = info.name or _principal_name(registry)
    if sharding is not None:  # the ranks of one trainer: one principal, a name each below it
        name = f"{name or 'vllm-trainer-' + uuid.uuid4().hex[:8]}/rank{sharding.index}"
    options = {"when_full": "wait", **info.publisher_options}
    return SnapshotPublisher(
        registry,
        info.transport,
        specs,
        device=info.staging_device or info.slot_device,
        slot_device=info.slot_device,
        rollout_dtype=info.rollout_dtype,
        transport_options=info.transport_options,
        close_registry=True,
        sharding=sharding,
        **({"name": name} if name else {}),
        **options,
    )


def _agree_first(engine: WeightpullTrainerEngine, count: int) -> int:
    """The first version to publish: `first_version`, else rank 0's look at the registry
    (one past every version it holds and every version a replica serves), which the
    other ranks of a sharded publish learn from it over torch.distributed."""
    info = engine.info
    assert info is not None
    if info.first_version is not None:
        return info.first_version
    first = None
    if engine.is_sender:
        assert engine.publisher is not None
        status = engine.publisher.call(engine.publisher.publisher.registry.status)
        known = [v.version for v in status.versions] + list(status.serving.values())
        first = max(known, default=-1) + 1
    if engine.sharding is None or count == 1:
        return first if first is not None else 0
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise InvalidArgumentError(
            "the ranks of a sharded publish agree on their first version over torch.distributed, which is "
            "not initialized: set first_version (the same on every rank)"
        )
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (info.rank, first))
    return next(number for rank, number in gathered if rank == 0)


def _drive(step: str, call: Any, *args: Any) -> None:
    """One step of the handshake, its failure as a `ReplicaUpdateError` with the replica's words."""
    try:
        call(*args)
    except Exception as exc:
        raise ReplicaUpdateError(f"the replica failed {step}: {_reason(exc)}") from exc


# vLLM's wrapping of a worker's error as it crosses the engine's processes.
_WRAPPED = re.compile(r"Worker failed with error '(.*)', please check the stack trace", re.DOTALL)


def _reason(exc: Exception) -> str:
    """The replica's own words: the worker's error out of vLLM's error reply."""
    response = getattr(exc, "response", None)  # requests' HTTPError: the server's JSON error
    if response is not None:
        try:
            error = response.json().get("error", {})
            text = str(error.get("message", error) if isinstance(error, dict) else error)
        except ValueError:
            return f"{exc} ({response.text[:500]})"
    else:
        text = f"{type(exc).__name__}: {exc}"
    found = _WRAPPED.search(text)
    return found.group(1) if found else text


register()  # the trainer's process loads no vLLM plugins: the backend's name resolves once this is imported


class OfflineClient:
    """vLLM's offline `LLM` as a `VLLMWeightSyncClient`: its weight-sync methods take
    request objects (or their dict forms) where the protocol passes the infos alone.

    Args:
        llm: The `vllm.LLM`, made with `weight_transfer_config={"backend": "weightpull"}`.
    """

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
