"""The agent mode of the `weightpull` backend: the replica updates itself on its own schedule.

With `init_info["agent"]`, the first worker of a `vllm serve` replica runs weightpull's
`UpdateAgent` in a thread of its own. It watches the registry and drives its own server's
RL routes, as a trainer would: `/update_weights` with `prefetch` while generation goes on,
then `/pause`, `/update_weights`, `/finish_weight_update`, `/reset_prefix_cache`,
`/update_weight_version` and `/resume`; the workers do the pulling and loading
(`backend.py`). The trainer only publishes. It needs `VLLM_SERVER_DEV_MODE=1`, as every
RL route does.
"""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.parse
import urllib.request
from typing import TYPE_CHECKING, Any

import anyio
import anyio.from_thread
import attrs

from weightpull.errors import ApplyError, PullError, WeightpullError
from weightpull.records import PullReport
from weightpull.rl.agent import PauseMode, UpdateAgent

from .mirrors import error_from_info

if TYPE_CHECKING:
    from .backend import AgentOptions, WeightpullTransferEngine
    from .engine import PullSpec

log = logging.getLogger(__name__)

_POLL = 0.02  # seconds between looks at the first worker's pull


class RouteError(WeightpullError):
    """One of the server's own routes refused the agent's call (the message is the server's)."""


def post(url: str, path: str, body: dict[str, Any] | None = None, *, timeout: float, **query: Any) -> Any:
    """POST `body` as JSON to `url/path?query`; the reply's JSON, or `RouteError` with the
    server's own message."""
    target = f"{url.rstrip('/')}/{path}"
    if query:
        target += "?" + urllib.parse.urlencode(
            {k: str(v).lower() if isinstance(v, bool) else v for k, v in query.items()}
        )
    data = json.dumps(body).encode() if body is not None else b""
    request = urllib.request.Request(target, data=data, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:  # noqa: S310 - the server's own address
            return json.loads(reply.read() or b"null")
    except urllib.error.HTTPError as exc:
        text = exc.read().decode(errors="replace")
        raise RouteError(f"POST {path} answered {exc.code}: {_message(text)}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise RouteError(f"POST {target} failed: {exc}; is the server at {url}, with VLLM_SERVER_DEV_MODE=1?") from None


def _message(text: str) -> str:
    """The error's own words out of vLLM's error reply (`{"error": {"message": ...}}`)."""
    try:
        reply = json.loads(text)
    except ValueError:
        return text[:500]
    error = reply.get("error", reply) if isinstance(reply, dict) else reply
    return str(error.get("message", error) if isinstance(error, dict) else error)[:2000]


@attrs.define
class ServerControl:
    """`EngineControl` over the server's own routes, with the first worker's pulls read
    where they run (they are in this process)."""

    engine: WeightpullTransferEngine
    url: str
    timeout: float
    _last_pull: PullReport | None = None

    async def _post(self, path: str, body: dict[str, Any] | None = None, **query: Any) -> Any:
        return await anyio.to_thread.run_sync(lambda: post(self.url, path, body, timeout=self.timeout, **query))

    async def prefetch(self, version: int) -> None:
        try:  # every worker starts pulling into its spare mirror; generation goes on
            await self._post("start_weight_update")
            await self._post("update_weights", {"update_info": {"version": version, "prefetch": True}})
            await self._post("finish_weight_update")
        except RouteError as exc:
            raise PullError(f"could not start the prefetch of v{version}: {exc}") from exc
        pulls = self.engine._pulls()
        while True:
            status = pulls.status()
            if status["error"] is not None:
                raise error_from_info(status["error"])
            if status["pulled"] == version:
                if status["seconds"] is not None and status["bytes"] is not None:
                    self._last_pull = PullReport(status["seconds"], status["bytes"], status["source"])
                return
            if status["pending"] != version:
                raise PullError(f"the prefetch of v{version} is no longer under way (restarted?)")
            await anyio.sleep(_POLL)

    def last_pull(self) -> PullReport | None:
        return self._last_pull

    async def pause(self, mode: PauseMode) -> None:
        await self._post("pause", mode=mode.value, clear_cache=False)  # the cache is reset after the apply

    async def apply(self, version: int) -> None:
        try:
            await self._post("start_weight_update")
            await self._post("update_weights", {"update_info": {"version": version}})
            await self._post("finish_weight_update")
        except RouteError as exc:
            restored = self.engine.serving()
            raise ApplyError(
                f"applying v{version} failed: {exc}; the replica holds {restored!r}",
                version=version,
                restored=restored,
            ) from exc
        # Blocks cached under the old weights must not be reused; requests frozen by a
        # `keep` pause are recomputed on the new weights.
        await self._post("reset_prefix_cache", reset_running_requests=True)

    async def label(self, version: int) -> None:
        await self._post("update_weight_version", {"new_version": str(version)})

    async def resume(self) -> None:
        await self._post("resume")


class ServerAgent:
    """The update agent on a thread of its own, with its own registry client."""

    def __init__(self, engine: WeightpullTransferEngine, spec: PullSpec, options: AgentOptions) -> None:
        self.control = ServerControl(engine, options.url, options.timeout)
        self._spec, self._options = spec, options
        self._portal_cm: Any = None
        self._future: Any = None
        self.agent: UpdateAgent | None = None

    def start(self) -> None:
        self._portal_cm = anyio.from_thread.start_blocking_portal()
        portal = self._portal_cm.__enter__()
        self._future = portal.start_task_soon(self._run)
        self._future.add_done_callback(_log_end)

    async def _run(self) -> None:
        from weightpull.registry import connect_registry

        async with connect_registry(self._spec.registry, **self._spec.registry_options) as registry:
            self.agent = UpdateAgent(
                self._spec.holder,
                registry,
                self.control,
                pause_mode=self._options.pause_mode,
                min_version_lag=self._options.min_version_lag,
                publisher=self._spec.publisher,
            )
            serving = self.control.engine.serving()
            if isinstance(serving, int):  # a version loaded before the agent started
                self.agent.serving = serving
            await self.agent.run()

    @property
    def running(self) -> bool:
        """Whether the agent still runs (it stops only on a failure, which it logs)."""
        return self._future is not None and not self._future.done()

    def stop(self) -> None:
        if self._future is not None:
            self._future.cancel()
        if self._portal_cm is not None:
            self._portal_cm.__exit__(None, None, None)
            self._portal_cm = None


def _log_end(future: Any) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.error("weightpull's update agent stopped: %r", future.exception())
