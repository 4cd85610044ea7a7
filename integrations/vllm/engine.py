"""The engine side: an `AsyncLLM` replica, its update agent, and what the dispatcher runs.

`VllmEngine` is the agent's `EngineControl` over an `AsyncLLM` whose workers carry
`WeightpullWorker`: prefetch and apply are `collective_rpc` calls into the workers;
pause, resume, the cache reset and the version label are `AsyncLLM`'s own.
`VllmReplica` is what the dispatcher starts prompts on. `open_replica` puts the three
together around a new engine.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import anyio
import attrs

from weightpull.clock import Clock, MonotonicClock
from weightpull.errors import ApplyError, InvalidArgumentError, PullError
from weightpull.puller import check_line
from weightpull.records import PullReport
from weightpull.registry import Registry
from weightpull.rl.agent import PauseMode, UpdateAgent
from weightpull.rl.dispatcher import Prompt
from weightpull.rl.staleness import Trajectory

from .mirrors import error_from_info
from .worker import WORKER_EXTENSION, pulls_slices


def _relay_host(_: Any, __: attrs.Attribute[str | None], host: str | None) -> None:
    if host is not None and (not isinstance(host, str) or not host):
        raise InvalidArgumentError(f"PullSpec.host must be a non-empty string or None, got {host!r}")


def _flag(what: str) -> Any:
    def check(_: Any, __: Any, value: object) -> None:
        if not isinstance(value, bool):
            raise InvalidArgumentError(f"PullSpec.{what} must be True or False, got {value!r}")

    return check


def _relay_cap(_: Any, __: attrs.Attribute[int | None], cap: int | None) -> None:
    if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 1):
        raise InvalidArgumentError(f"PullSpec.relay_cap must be a positive int or None (no cap), got {cap!r}")


def _publisher(_: Any, __: attrs.Attribute[str | None], publisher: str | None) -> None:
    try:
        check_line(publisher)
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(f"PullSpec.{exc}") from None


def _sharded(_: Any, __: attrs.Attribute[bool | str], sharded: bool | str) -> None:
    if not isinstance(sharded, bool) and sharded != "auto":
        raise InvalidArgumentError(
            f"PullSpec.sharded must be 'auto' (each worker its slice at tensor parallel > 1), True or False, "
            f"got {sharded!r}"
        )


def _stream(_: Any, __: attrs.Attribute[bool | None], stream: bool | None) -> None:
    if stream is not None and not isinstance(stream, bool):
        raise InvalidArgumentError(f"PullSpec.stream must be True, False or None (as host says), got {stream!r}")


@attrs.frozen
class PullSpec:
    """How each worker reaches the registry and the publisher's memory, and whether it
    reads from other replicas' mirrors and offers its own (relays: docs/guides/vllm.md#relays).

    Args:
        registry: The served registry's address.
        holder: The lease holder's name (the replica's).
        transport: The driver each worker reads with.
        ttl: Seconds each lease lasts between renewals.
        mirror_device: Where each worker keeps its mirrors: "cpu", or "cuda" for the
            worker's own GPU (the apply is then a device copy, not a host-to-device one,
            but the mirrors take their bytes from the GPU memory vLLM would give its KV
            cache).
        registry_options: Keyword arguments of `connect_registry` (keys, ...).
        transport_options: Keyword arguments of `create_transport`.
        faults: `weightpull.drivers.faulty.Faults` fields, to wrap the transport in.
        check_apply: After each apply, compare the tensors the kernels use with a first
            load of the same copy (docs/guides/vllm.md#the-check-after-every-apply); the
            structural checks always run.
        sharded: Whether each tensor-parallel worker pulls only its slice: the elements
            its own weight loaders read, recorded from the engine at start, into mirrors
            of the slice's size (docs/guides/sharding.md). "auto": at tensor parallel > 1
            (`sliced`); True: always; False: every worker pulls the whole version.
        spare_mirror: Keep a second mirror per worker: the next version is pulled into it
            while the other holds the version served, which a failed apply reloads and a
            relay's readers keep reading. False halves the mirrors' memory: the next
            version is pulled over the served one, so a failed apply has nothing to go
            back to once a version was applied (an older version than the newest READY one
            takes no new lease, so it cannot be pulled again): the replica stays paused and
            must not serve (`ApplyError` with `restored` None; the update agent fails).
        host: This replica's host name: each pull's lease is placed by the registry's
            policy, at the trainer's slot or at a relay (another replica's mirror, or the
            same rank's of a replica of the same layout), the same host's first; bytes
            from a relay are checked against the publisher's digests (a slice's, against
            the digests its layout's first relay gave).
        relay: Offer each worker's mirror to other replicas (needs `host`): a whole
            version's while it fills and after; a slice's once whole.
        relay_cap: The most readers a relay serves at once; None: no cap.
        stream: Read a version bucket by bucket as its source holds it (the trainer's
            slot while it is published, a relay still receiving it); None: when `host`
            is set. A relay streams.
        publisher: The publisher principal whose versions this replica follows (None: the
            registry's default line): another principal's versions are never pulled
            (docs/guides/registry-service.md).

    Raises:
        InvalidArgumentError: `relay` without `host`, `relay` with `stream=False`,
            `relay_cap` without `relay`, or a value of the wrong kind.
    """

    registry: str
    holder: str
    transport: str = "nixl"
    ttl: float = 10.0
    mirror_device: str = "cpu"
    registry_options: Mapping[str, Any] = attrs.field(factory=dict)
    transport_options: Mapping[str, Any] = attrs.field(factory=dict)
    faults: Mapping[str, Any] | None = None
    check_apply: bool = True
    sharded: bool | str = attrs.field(default="auto", validator=_sharded)
    host: str | None = attrs.field(default=None, validator=_relay_host)
    relay: bool = attrs.field(default=False, validator=_flag("relay"))
    relay_cap: int | None = attrs.field(default=None, validator=_relay_cap)
    stream: bool | None = attrs.field(default=None, validator=_stream)
    publisher: str | None = attrs.field(default=None, validator=_publisher)
    spare_mirror: bool = attrs.field(default=True, validator=_flag("spare_mirror"))

    def sliced(self, tensor_parallel: int) -> bool:
        """Whether each worker of an engine of `tensor_parallel` ranks pulls only its slice.

        Args:
            tensor_parallel: The engine's tensor-parallel size.
        """
        return pulls_slices(self.sharded, tensor_parallel)

    def __attrs_post_init__(self) -> None:
        """The relay options' combinations, refused here rather than in every worker."""
        if self.relay and self.host is None:
            raise InvalidArgumentError("PullSpec.relay needs PullSpec.host: the registry places readers by host")
        if self.relay and self.stream is False:
            raise InvalidArgumentError(
                "PullSpec.relay forwards each bucket as it lands: leave PullSpec.stream unset or True"
            )
        if self.relay_cap is not None and not self.relay:
            raise InvalidArgumentError("PullSpec.relay_cap caps a relay's readers: it needs PullSpec.relay=True")


class VllmEngine:
    """`EngineControl` for one `AsyncLLM` whose workers carry the weightpull extension:
    what the update agent drives (prefetch, pause, apply, resume).

    Args:
        llm: The `AsyncLLM`.
        poll_interval: Seconds between polls of the workers' pulls.
        apply_timeout: Seconds an apply may wait for its version's pull.
        clock: The clock those waits run on.
    """

    def __init__(
        self, llm: Any, *, poll_interval: float = 0.02, apply_timeout: float = 60.0, clock: Clock | None = None
    ) -> None:
        self.llm = llm
        self.poll_interval = poll_interval
        self.apply_timeout = apply_timeout
        self.clock = clock or MonotonicClock()
        self.last_apply: Mapping[str, Any] = {}  # the first worker's report of the last apply
        self.spec: PullSpec | None = None  # as `start` was given it
        self._last_pull: PullReport | None = None

    async def _rpc(self, method: str, *args: Any) -> list[Any]:
        return await self.llm.collective_rpc(method, args=args)

    async def start(self, spec: PullSpec) -> None:
        """Connect every worker to the registry and register its mirrors; raise
        `UnsupportedModelError` for a model whose updates cannot be made whole."""
        self.spec = spec
        for status in await self._rpc("weightpull_start", attrs.asdict(spec)):
            if status.get("error"):
                raise error_from_info(status["error"])

    async def prepare(self) -> None:
        """Before the first version (the update agent calls it once): every worker maps
        the publishers' reserved slots and registers its mirrors (a slice's at its size),
        in the background."""
        await self._rpc("weightpull_prepare")

    async def memory(self, *, trim: bool = False) -> list[dict[str, Any]]:
        """Each worker's host memory: its resident set (`rss_bytes`), its mirrors' bytes
        (`mirror_bytes`) and count, whether they hold its slice (`sliced`), its `pid`.

        Args:
            trim: Let each worker's allocator give back freed memory first, so that the
                resident set counts live memory (glibc's `malloc_trim`).
        """
        return await self._rpc("weightpull_memory", trim)

    async def prefetch(self, version: int) -> None:
        statuses = await self._rpc("weightpull_prefetch", version)
        while True:
            for status in statuses:
                if status["error"] is not None:
                    raise error_from_info(status["error"])
            if all(s["pulled"] == version for s in statuses):
                self._last_pull = _pull_report(statuses)
                return
            if any(s["pending"] != version and s["pulled"] != version for s in statuses):
                raise PullError(f"the prefetch of v{version} is no longer under way (restarted?)")
            await self.clock.sleep(self.poll_interval)
            statuses = await self._rpc("weightpull_status")

    def last_pull(self) -> PullReport | None:
        """The last prefetch as the update agent reports it for the registry's status: the
        slowest worker's seconds, the bytes all workers read, the first worker's source."""
        return self._last_pull

    async def pause(self, mode: PauseMode) -> None:
        # The caches are reset once, after the apply (nothing runs in between).
        await self.llm.pause_generation(mode=mode.value, clear_cache=False)

    async def apply(self, version: int) -> None:
        results = await self._rpc("weightpull_apply", version, self.apply_timeout)
        failed = [r for r in results if not r["ok"]]
        if failed:
            restored = {r["restored"] for r in failed}
            if len(failed) < len(results):  # the others loaded it: give them back the old one too
                restored |= set(await self._rpc("weightpull_revert"))
            last_good = restored.pop() if len(restored) == 1 else None
            self.last_apply = failed[0]
            raise ApplyError(
                f"applying v{version} failed on {len(failed)} of {len(results)} workers "
                f"({failed[0]['error']['type']}: {failed[0]['error']['message']}); "
                + (
                    f"the replica holds {last_good!r} again"
                    if last_good is not None
                    else "the last good version could not be restored: the replica stays paused and must not serve"
                    + _NO_SPARE * (self.spec is not None and not self.spec.spare_mirror)
                ),
                version=version,
                restored=last_good,
            ) from error_from_info(failed[0]["error"])
        self.last_apply = results[0]
        await self._rpc("weightpull_commit", version)
        # Blocks cached under the old weights must not be reused; requests frozen by a
        # `keep` pause are recomputed on the new weights.
        await self.llm.reset_prefix_cache(reset_running_requests=True)

    async def label(self, version: int) -> None:
        # What `finish_weight_update(weight_version=...)` does after its own transfer.
        await self.llm.update_weight_version(str(version))

    async def resume(self) -> None:
        await self.llm.resume_generation()

    async def stop(self) -> None:
        await self._rpc("weightpull_stop")


_NO_SPARE = (
    " (with spare_mirror=False the next version is pulled over the only copy of the one served; "
    "PullSpec(spare_mirror=True) keeps it for a failed apply to go back to)"
)


def _pull_report(statuses: list[Any]) -> PullReport | None:
    if any(s.get("seconds") is None or s.get("bytes") is None for s in statuses):
        return None  # a worker of an earlier release: no figures
    return PullReport(max(s["seconds"] for s in statuses), sum(s["bytes"] for s in statuses), statuses[0]["source"])


class VllmReplica:
    """A replica as the dispatcher sees it: `generate` on the engine, versions from the agent.

    Args:
        name: The replica's name.
        llm: Its `AsyncLLM`.
        agent: Its update agent.
        sampling_params: vLLM's `SamplingParams` for each prompt.
    """

    def __init__(self, name: str, llm: Any, agent: UpdateAgent, sampling_params: Any) -> None:
        self.name = name
        self.llm = llm
        self.agent = agent
        self.sampling_params = sampling_params
        self._ids = itertools.count()

    @property
    def serving(self) -> int | None:
        return self.agent.serving

    async def wait_changed(self) -> None:
        await self.agent.wait_changed()

    async def generate(self, prompt: Prompt) -> Trajectory | None:
        """`prompt.payload` is a list of token ids. The trajectory's versions are the ones
        vLLM recorded for its tokens (their `weight_versions` spans)."""
        from vllm.inputs import TokensPrompt

        final = None
        request_id = f"{prompt.id}@{self.name}#{next(self._ids)}"
        tokens = TokensPrompt(prompt_token_ids=list(prompt.payload))
        async for output in self.llm.generate(tokens, self.sampling_params, request_id=request_id):
            final = output  # the last one holds the whole completion
        completion = final.outputs[0] if final is not None else None
        if completion is None or completion.finish_reason == "abort":
            return None  # an update aborted it: the dispatcher starts it again
        versions = [int(span.version) for span in completion.weight_versions or ()]
        return Trajectory(prompt.id, completion.token_ids, versions, group=prompt.group, replica=self.name)


def engine_args(model: str, **overrides: Any) -> Any:
    """`AsyncEngineArgs` for a replica: the weightpull worker extension (or a subclass of
    it; None for a plain engine), token-id prompts, and a bounded KV cache (the CPU
    backend otherwise reserves most of the RAM)."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    kw: dict[str, Any] = {
        "skip_tokenizer_init": True,
        "kv_cache_memory_bytes": 32 << 20,
        "enforce_eager": True,
        "disable_log_stats": True,
        "worker_extension_cls": WORKER_EXTENSION,
        **overrides,
    }
    if kw["worker_extension_cls"] is None:
        kw["worker_extension_cls"] = ""
    return AsyncEngineArgs(model=model, **kw)


@attrs.define
class OpenReplica:
    """What `open_replica` yields: the engine, its control, its update agent and the
    replica the dispatcher runs prompts on."""

    name: str
    llm: Any
    engine: VllmEngine
    agent: UpdateAgent
    replica: VllmReplica


@asynccontextmanager
async def open_replica(
    name: str,
    model: str,
    registry: Registry,
    spec: PullSpec,
    *,
    sampling_params: Any = None,
    pause_mode: PauseMode | str = PauseMode.ABORT,
    min_version_lag: int = 1,
    **engine_overrides: Any,
) -> AsyncIterator[OpenReplica]:
    """Start an `AsyncLLM` for `model` with its workers connected per `spec`, and an
    update agent watching `registry` (the same registry, as this process reaches it).
    Run `agent.run()` in your task group; the engine shuts down on exit.

    Args:
        name: The replica's name (its update agent's).
        model: The model vLLM starts from (a path or a hub name).
        registry: The registry, as this process reaches it.
        spec: How the workers reach the registry and the publisher's memory.
        sampling_params: vLLM's `SamplingParams` for each prompt.
        pause_mode: How the engine pauses for an apply (`PauseMode`).
        min_version_lag: How far ahead the newest version must be before an update.
        **engine_overrides: `AsyncEngineArgs` fields (`engine_args`).

    Yields:
        The replica, its engine, control and agent.

    Raises:
        UnsupportedModelError: The model is one whose weights an apply cannot reload.
        WeightpullError: The workers could not reach the registry or the transport.
    """
    llm = await start_engine(engine_args(model, **engine_overrides))
    engine = VllmEngine(llm)
    try:
        await engine.start(spec)
        agent = UpdateAgent(
            name, registry, engine, pause_mode=pause_mode, min_version_lag=min_version_lag, publisher=spec.publisher
        )
        yield OpenReplica(name, llm, engine, agent, VllmReplica(name, llm, agent, sampling_params))
    finally:
        await shutdown(llm, engine)


async def start_engine(args: Any) -> Any:
    """An `AsyncLLM` for `args`. Its constructor blocks while the engine's processes start
    (seconds): run in a thread, several engines start at once and the event loop goes on.
    (It starts its asyncio tasks lazily, on the loop that first uses it.)"""
    from vllm.v1.engine.async_llm import AsyncLLM

    return await anyio.to_thread.run_sync(AsyncLLM.from_engine_args, args)


async def shutdown(llm: Any, engine: VllmEngine | None = None) -> None:
    """Stop the workers' pulls, then the engine, even when cancelled. vLLM's shutdown
    blocks for seconds: it runs in a thread, so several engines stop at once."""
    with anyio.CancelScope(shield=True):
        if engine is not None:
            with anyio.move_on_after(5):
                try:
                    await engine.stop()  # deregister the mirrors, end the pull thread
                except Exception:  # noqa: S110 - the engine may be dead already
                    pass
        await anyio.to_thread.run_sync(llm.shutdown)
