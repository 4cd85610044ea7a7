"""weightpull as a backend of vLLM's own weight-transfer API (the worker's side).

`vllm serve MODEL --weight-transfer-config '{"backend": "weightpull"}'` (or
`LLM(..., weight_transfer_config=...)`) makes a `WeightpullTransferEngine` in every worker
once the `vllm.general_plugins` entry point has registered it (`plugin.py`). vLLM's RL
routes then drive it:

- `/init_weight_transfer_engine` `{"init_info": {...}}`: `InitInfo` (a `PullSpec` as a dict,
  and `agent`): connect to the registry, register the two mirrors; with `agent`, the first
  worker runs weightpull's update agent (`server_agent.py`) and the trainer only publishes.
- `/start_weight_update`: nothing to prepare. The reload runs within one `update_weights`,
  so that a failed one can be undone before the call returns.
- `/update_weights` `{"update_info": {"version": N}}`: wait for N to be published (at most
  `timeout`), pull it one-sided under a lease (or take the prefetched copy), load it
  through the layerwise reload with the apply's rules and check. The workers agree: if one
  fails, every one loads the last good version again and the call fails, so
  tensor-parallel workers never serve a mix. `{"version": N, "prefetch": true}` only starts
  the pull into the spare mirror, and returns at once: generation goes on meanwhile.
- `/finish_weight_update` `{"weight_version": "N"}`: commit (the mirror serves), and the first
  worker reports the replica serving N to the registry. vLLM labels outputs with the
  `weight_version` and `/weight_info` reports it.

Parameters are written in place by the reload (their addresses stay), so CUDA graphs
captured at start-up stay valid. Each worker holds a `WeightpullWorker` of its own: the
same mirrors, apply, check and fallbacks as the worker extension (`worker.py`).
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import attrs
import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from weightpull.errors import ApplyError, InvalidArgumentError, WeightpullError
from weightpull.transports import transport_class

from .engine import PullSpec
from .mirrors import BackgroundPulls, error_from_info, error_info
from .worker import CHECKPOINT, WeightpullWorker

log = logging.getLogger(__name__)

BACKEND = "weightpull"
DEFAULT_TIMEOUT = 60.0  # seconds an update waits for its version to be published and pulled

_SPEC_FIELDS = frozenset(f.name for f in attrs.fields(PullSpec))


@attrs.frozen
class AgentOptions:
    """`init_info["agent"]`: the first worker runs weightpull's update agent, which drives
    its own server's RL routes (`url`) on the replica's schedule.

    Args:
        url: The server's own address, as the worker reaches it.
        pause_mode: What becomes of requests in flight during the pause ("abort", "wait",
            "keep": vLLM's `/pause` modes).
        min_version_lag: Update once the newest version is this many ahead.
        timeout: Seconds each route may take.
    """

    url: str = "http://127.0.0.1:8000"
    pause_mode: str = "keep"
    min_version_lag: int = 1
    timeout: float = 300.0

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.url, str) or not self.url.startswith(("http://", "https://")):
            raise InvalidArgumentError(f"agent.url must be the server's http(s):// address, got {self.url!r}")
        if self.pause_mode not in ("abort", "wait", "keep"):
            raise InvalidArgumentError(f"agent.pause_mode must be abort, wait or keep; got {self.pause_mode!r}")
        lag = self.min_version_lag
        if not isinstance(lag, int) or isinstance(lag, bool) or lag < 1:
            raise InvalidArgumentError(f"agent.min_version_lag must be an int >= 1, got {lag!r}")
        if not isinstance(self.timeout, (int, float)) or not 0 < self.timeout < float("inf"):
            raise InvalidArgumentError(f"agent.timeout must be a positive number of seconds, got {self.timeout!r}")


@dataclass
class InitInfo(WeightTransferInitInfo):
    """What `/init_weight_transfer_engine` carries, checked (`parse`)."""

    spec: PullSpec
    agent: AgentOptions | None = None

    @classmethod
    def parse(cls, data: Any, *, holder: str) -> InitInfo:
        """From the init dict: `PullSpec`'s fields (`registry` required; `holder` defaults
        to this engine's name; the others to `PullSpec`'s own defaults) and an optional
        `agent` (True, or `AgentOptions`' fields).

        Raises:
            InvalidArgumentError: Not a dict, an unknown key, no registry, or a bad value.
            UnknownDriverError: No transport of that name.
            DriverUnavailableError: The transport cannot run here (its extra is missing).
        """
        if not isinstance(data, Mapping):
            raise InvalidArgumentError(f"weightpull's init_info must be a JSON object, got {type(data).__name__}")
        data = dict(data)
        agent = data.pop("agent", None)
        unknown = sorted(set(data) - _SPEC_FIELDS)
        if unknown:
            raise InvalidArgumentError(
                f"unknown weightpull init_info key(s) {unknown}; known: {sorted(_SPEC_FIELDS | {'agent'})}"
            )
        if not data.get("registry"):
            raise InvalidArgumentError(
                "weightpull's init_info needs 'registry': the served registry's address (tcp://HOST:PORT)"
            )
        data.setdefault("holder", holder)
        try:
            spec = PullSpec(**data)
        except TypeError as exc:
            raise InvalidArgumentError(f"weightpull's init_info: {exc}") from None
        transport_class(spec.transport)  # a misspelt or missing driver, named before anything is touched
        if agent is None or agent is False:
            options = None
        elif agent is True:
            options = AgentOptions()
        elif isinstance(agent, Mapping):
            try:
                options = AgentOptions(**agent)
            except TypeError as exc:
                raise InvalidArgumentError(f"weightpull's init_info agent: {exc}") from None
        else:
            raise InvalidArgumentError(f"init_info agent must be true, false or an object, got {agent!r}")
        return cls(spec, options)


@dataclass
class UpdateInfo(WeightTransferUpdateInfo):
    """What `/update_weights` carries: the version to load (or, with `prefetch`, to start
    pulling), and how long to wait for it to be published and pulled."""

    version: int
    prefetch: bool = False
    timeout: float = DEFAULT_TIMEOUT

    def __post_init__(self) -> None:
        if not isinstance(self.version, int) or isinstance(self.version, bool) or self.version < 0:
            raise InvalidArgumentError(f"update_info version must be an int >= 0, got {self.version!r}")
        if not isinstance(self.prefetch, bool):
            raise InvalidArgumentError(f"update_info prefetch must be true or false, got {self.prefetch!r}")
        if not isinstance(self.timeout, (int, float)) or not 0 < self.timeout < float("inf"):
            raise InvalidArgumentError(
                f"update_info timeout must be a positive number of seconds, got {self.timeout!r}"
            )


class _Runner:
    """What the apply reads of a model runner, from what vLLM hands a transfer engine."""

    def __init__(self, engine: WeightTransferEngine[Any, Any]) -> None:
        self._engine = engine

    def get_model(self) -> torch.nn.Module:
        return self._engine.model

    @property
    def model_config(self) -> Any:
        return self._engine.model_config

    @property
    def vllm_config(self) -> Any:
        return self._engine.vllm_config


class _Worker(WeightpullWorker):
    """The worker extension's state and steps, on a transfer engine instead of a worker."""

    def __init__(self, engine: WeightTransferEngine[Any, Any], rank: int) -> None:
        self.model_runner = _Runner(engine)
        self.device = engine.device
        self.parallel_config = engine.parallel_config
        self.rank = rank

    def weightpull_stop(self) -> None:
        # The mirror of the version served goes with the pulls: from now on a failed apply
        # has nothing to go back to (not the checkpoint: the model holds a version since).
        if self._weightpull is not None and self._weightpull.pair.current is not None:
            self._weightpull_fallback = None
        super().weightpull_stop()


def _noting(exc: WeightpullError, note: str) -> WeightpullError:
    """`exc` with `note` added to its message (its type and attributes kept)."""
    exc.args = (f"{exc}; {note}", *exc.args[1:])
    return exc


def _group() -> Any:
    """This engine's workers (tensor and pipeline parallel): they apply as one."""
    from vllm.distributed import get_world_group

    return get_world_group()


class WeightpullTransferEngine(WeightTransferEngine[InitInfo, UpdateInfo]):
    """vLLM's `WeightTransferEngine` for weightpull: each worker pulls its version (or its
    tensor-parallel slice) one-sided from the publisher's slot, and loads it checked."""

    init_info_cls = InitInfo
    update_info_cls = UpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        group = _group()
        self.rank, self.world = group.rank_in_group, group.world_size
        self._worker = _Worker(self, self.rank)
        self._info: InitInfo | None = None
        self._applied: int | None = None  # loaded on every worker, not yet committed
        self._served: int | str | None = CHECKPOINT  # what the model holds (None: unknown, a failed restore)
        self._agent: Any = None  # the first worker's `ServerAgent`, with `agent`

    @property
    def holder(self) -> str:
        """This replica's default lease holder name: one per engine, the same on every worker."""
        instance = getattr(self.vllm_config, "instance_id", "") or str(os.getppid())
        return f"vllm-{socket.gethostname()}-{instance}"

    def parse_init_info(self, init_dict: dict[str, Any]) -> InitInfo:
        return InitInfo.parse(init_dict, holder=self.holder)

    def parse_update_info(self, update_dict: dict[str, Any]) -> UpdateInfo:
        if not isinstance(update_dict, Mapping):
            raise InvalidArgumentError(f"weightpull's update_info must be a JSON object, got {update_dict!r}")
        unknown = sorted(set(update_dict) - {"version", "prefetch", "timeout"})
        if unknown or "version" not in update_dict:
            raise InvalidArgumentError(
                f"weightpull's update_info takes 'version' (required), 'prefetch' and 'timeout'; got {sorted(update_dict)}"
            )
        return UpdateInfo(**update_dict)

    # -- vLLM's steps ------------------------------------------------------------------------

    def init_transfer_engine(self, init_info: InitInfo) -> None:
        if init_info == self._info and (init_info.agent is None or (self._agent is not None and self._agent.running)):
            # The same settings again (a trainer restarted): the mirrors stay, and with them
            # the version served, which a failed apply goes back to.
            log.info("weightpull: worker %d already pulls as asked; kept as it is", self.rank)
            return
        previous = self._info
        self._stop_agent()  # it drives the pulls being replaced
        status = self._worker.weightpull_start(attrs.asdict(init_info.spec))
        if status.get("error"):
            # Refused before the running pulls were touched: they, and an agent that ran,
            # go on as before, and the replica serves what it served.
            if previous is not None:
                self._start_agent(previous)
            raise error_from_info(status["error"])
        self._info = init_info
        log.info(
            "weightpull: worker %d of %d pulls from %s as %r (%s)",
            self.rank,
            self.world,
            init_info.spec.registry,
            init_info.spec.holder,
            "its slice" if init_info.spec.sliced(self.parallel_config.tensor_parallel_size) else "whole versions",
        )
        self._start_agent(init_info)

    def _start_agent(self, info: InitInfo) -> None:
        if info.agent is not None and self.rank == 0:
            from .server_agent import ServerAgent

            self._agent = ServerAgent(self, info.spec, info.agent)
            self._agent.start()

    def _stop_agent(self) -> None:
        if self._agent is not None:
            self._agent.stop()
            self._agent = None

    def start_weight_update(self) -> None:
        self._pulls()  # refused here, before anything, if no init came first

    def receive_weights(self, update_info: UpdateInfo) -> None:
        pulls, version = self._pulls(), update_info.version
        if update_info.prefetch:
            pulls.prefetch(version)
            return
        result = self._pull_and_apply(version, update_info.timeout)
        if self._agree(bool(result["ok"])):
            self._applied = version
            return
        if result["ok"]:  # loaded here, failed on another worker: back to the last good one
            restored = self._served = self._worker.weightpull_revert()
            raise ApplyError(
                f"v{version} failed on another worker of this replica; every worker holds {restored!r} again",
                version=version,
                restored=restored,
            )
        cause, restored = error_from_info(result["error"]), result["restored"]
        if result.get("stage") == "pull":  # nothing was touched
            raise _noting(cause, f"the replica still serves {self._served!r}")
        self._served = restored
        raise ApplyError(
            f"applying v{version} failed ({type(cause).__name__}: {cause}); "
            + (
                f"the replica holds {restored!r} again"
                if restored is not None
                else "the last good version could not be restored: do not serve"
            ),
            version=version,
            restored=restored,
        ) from cause

    def _pull_and_apply(self, version: int, timeout: float) -> dict[str, Any]:
        """`weightpull_apply`'s report; a version not published in time is a failed pull
        like any other, so that every worker still joins the agreement that follows."""
        status = self._pulls().status()
        if version not in (status["pulled"], status["pending"]):
            try:
                self._wait_published(version, timeout)
            except WeightpullError as exc:
                return {
                    "ok": False,
                    "version": version,
                    "stage": "pull",
                    "error": error_info(exc),
                    "restored": self._served,
                }
            self._pulls().prefetch(version)
        return self._worker.weightpull_apply(version, timeout)

    def finish_weight_update(self) -> None:
        version, self._applied = self._applied, None
        if version is None:
            return  # a session that only prefetched, or whose update failed
        self._worker.weightpull_commit(version)
        self._served = version
        if self.rank == 0 and self._agent is None:  # the agent reports what it applies itself
            self._report(version)

    def shutdown(self) -> None:
        self._stop_agent()
        self._worker.weightpull_stop()
        self._info = None

    # -- internals ---------------------------------------------------------------------------

    def _pulls(self) -> BackgroundPulls:
        if self._worker._weightpull is None:
            raise InvalidArgumentError(
                "weightpull's transfer engine was not initialized: call /init_weight_transfer_engine first"
            )
        return self._worker._weightpull

    def _wait_published(self, version: int, timeout: float) -> None:
        """Until `version` is READY on the followed line: `VersionWaitTimeoutError` after
        `timeout`, `PublisherLapsedError` at once when its publisher is gone."""
        pulls = self._pulls()
        registry, publisher = pulls.pair.registry, self._info.spec.publisher if self._info else None

        async def wait() -> None:
            kwargs = {"publisher": publisher} if publisher is not None else {}
            await registry.wait_for_version(version, timeout, **kwargs)

        pulls.call(wait)

    def _agree(self, ok: bool) -> bool:
        """Whether every worker of this engine succeeded (each passes its own)."""
        if self.world == 1:
            return ok
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN, group=_group().cpu_group)
        return bool(flag.item())

    def _report(self, version: int) -> None:
        """Tell the registry this replica serves `version` (its status shows it); only
        informative, so a failure is logged."""
        pulls = self._pulls()
        holder = self._info.spec.holder if self._info else self.holder
        try:
            pulls.call(pulls.pair.registry.report_serving, holder, version)
        except WeightpullError as exc:
            log.warning("weightpull: could not report serving v%s: %s", version, exc)

    def serving(self) -> int | str | None:
        """The version this worker's model holds: the last committed, the checkpoint's name
        ("checkpoint") before any, None once a failed apply could not restore one."""
        return self._served
