"""`engine_kwargs.transport_pull`: the engine's settings, checked once, when verl builds the
engine, so that a misspelt run fails at start-up and not at its first weight update."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from weightpull.errors import InvalidArgumentError
from weightpull.tensors import normalize_dtype
from weightpull.transports import transport_class

DEFAULT_REGISTRY = "ray://weightpull"  # a Ray job needs no registry service of its own
PUBLISH_MODES = ("sharded", "whole")


def _transport(_: Any, __: attrs.Attribute[str], name: str) -> None:
    if not isinstance(name, str) or not name:
        raise InvalidArgumentError(f"transport_pull.transport must be a driver's name, got {name!r}")
    transport_class(name)  # UnknownDriverError, or DriverUnavailableError naming the extra


def _device(_: Any, __: attrs.Attribute[str], device: str) -> None:
    if not isinstance(device, str) or not (device == "cpu" or device == "cuda" or device.startswith("cuda:")):
        raise InvalidArgumentError(f"transport_pull.device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")


def _num_slots(_: Any, __: attrs.Attribute[int], n: int) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 2:
        raise InvalidArgumentError(
            f"transport_pull.num_slots must be an int >= 2 (one always holds the newest version), got {n!r}"
        )


def _lease_ttl(_: Any, __: attrs.Attribute[float], ttl: float) -> None:
    if isinstance(ttl, bool) or not isinstance(ttl, int | float) or not ttl > 0:
        raise InvalidArgumentError(f"transport_pull.lease_ttl must be a positive number of seconds, got {ttl!r}")


def _registry(_: Any, __: attrs.Attribute[str], address: str) -> None:
    if not isinstance(address, str) or "://" not in address:
        raise InvalidArgumentError(
            f"transport_pull.registry must be an address, ray://NAME or tcp://HOST:PORT, got {address!r}"
        )


def _publish(_: Any, __: attrs.Attribute[str], mode: str) -> None:
    if mode not in PUBLISH_MODES:
        raise InvalidArgumentError(
            f"transport_pull.publish must be one of {list(PUBLISH_MODES)} (each trainer rank its shard, or rank 0 "
            f"the whole version), got {mode!r}"
        )


def _sliced(value: Any) -> bool | str:
    if value == "auto" or isinstance(value, bool):
        return value
    raise InvalidArgumentError(
        f"transport_pull.sliced must be 'auto', true or false (each rollout rank its slice), got {value!r}"
    )


def _tensor_parallel_size(_: Any, __: attrs.Attribute[int], n: int) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise InvalidArgumentError(
            "transport_pull.tensor_parallel_size must be the rollout's tensor-parallel size, an int >= 1 "
            f"(${{actor_rollout_ref.rollout.tensor_model_parallel_size}}), got {n!r}"
        )


def _dtype(value: Any) -> str | None:
    return None if value is None or value == "none" else normalize_dtype(value, "transport_pull.rollout_dtype")


@attrs.frozen
class Settings:
    """What `transport_pull` is told in verl's config:

    - `transport`: the weightpull driver both sides read over (`nixl` between processes
      and hosts; `cuda_ipc` on one host);
    - `device`: where this side's registered memory lives: the trainer's slots, a
      replica's mirror ("cpu", or a GPU);
    - `num_slots`: the trainer's slots (>= 2), each a whole copy of the weights;
    - `rollout_dtype`: what fp32 weights are cast to in the slot (None keeps them);
    - `lease_ttl`: seconds a replica's lease lasts unrenewed while it reads;
    - `registry`: `ray://NAME` (a named Ray actor, the default) or a served registry's
      `tcp://HOST:PORT`;
    - `publish`: "sharded" (each trainer rank publishes its dim-0 shard of every weight,
      the default) or "whole" (rank 0 publishes every weight whole, as verl's own engines
      send them);
    - `tensor_parallel_size`: the rollout's tensor-parallel size (verl does not tell a
      checkpoint engine; pass `${actor_rollout_ref.rollout.tensor_model_parallel_size}`);
    - `sliced`: whether each rollout rank reads only its tensor-parallel slice: "auto"
      (the default) when `tensor_parallel_size` > 1, true, or false (every rank the whole).

    Raises:
        InvalidArgumentError: A setting is of the wrong kind or out of range, or `sliced`
            is true with `tensor_parallel_size` 1 (one rank's slice is the whole).
    """

    transport: str = attrs.field(default="nixl", validator=_transport)
    device: str = attrs.field(default="cpu", validator=_device)
    num_slots: int = attrs.field(default=2, validator=_num_slots)
    rollout_dtype: str | None = attrs.field(default="bfloat16", converter=_dtype)
    lease_ttl: float = attrs.field(default=30.0, validator=_lease_ttl)
    registry: str = attrs.field(default=DEFAULT_REGISTRY, validator=_registry)
    publish: str = attrs.field(default="sharded", validator=_publish)
    tensor_parallel_size: int = attrs.field(default=1, validator=_tensor_parallel_size)
    sliced: bool | str = attrs.field(default="auto", converter=_sliced)

    def __attrs_post_init__(self) -> None:
        if self.sliced is True and self.tensor_parallel_size == 1:
            raise InvalidArgumentError(
                "transport_pull.sliced is true but tensor_parallel_size is 1: one rank's slice is the whole "
                "version; set tensor_parallel_size to the rollout's (or sliced to 'auto')"
            )

    @property
    def slices(self) -> bool:
        """Whether a rollout rank pulls only its slice."""
        return self.tensor_parallel_size > 1 if self.sliced == "auto" else bool(self.sliced)

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any]) -> Settings:
        """From `engine_kwargs.transport_pull` (a dict, or Hydra's DictConfig), refusing
        keys it does not know, by name."""
        known = {a.name for a in attrs.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise InvalidArgumentError(
                f"unknown engine_kwargs.transport_pull setting(s) {unknown}; known: {sorted(known)}"
            )
        return cls(**{str(k): v for k, v in kwargs.items()})
