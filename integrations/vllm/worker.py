"""The worker side: a vLLM worker extension that pulls into mirrors and applies them.

Pass `worker_extension_cls=WORKER_EXTENSION` to the engine. vLLM resolves that name in
each worker process and mixes the class into its worker, so the methods below become
`collective_rpc` targets and run on the worker's own thread, between engine steps.
Everything crossing `collective_rpc` is plain data (versions, dicts, error text): when
the engine runs in its own process, tensors would arrive as lists.

- `weightpull_start(spec)`: connect to the registry, open the transport, make the
  mirrors (two, or one without `spare_mirror`: see `mirrors.py`); pulls then run on a
  thread of their own. At tensor parallel > 1 (or with `sharded=True`) each worker's
  mirrors hold its slice alone, recorded from its own loaders (`slices.py`). With the
  spec's `host`, each lease is placed by the registry at the trainer's slot or another
  replica's mirror; with `relay`, the worker offers its own mirrors (`mirrors.py`).
- `weightpull_prefetch(v)`: start pulling `v` into the spare mirror; returns at once.
- `weightpull_status()`: how that pull stands; `weightpull_memory()`: what the worker
  holds in host memory.
- `weightpull_apply(v)`: load the mirror through vLLM's layerwise checkpoint-format
  reload, driven by `apply.py`, which refuses a load that leaves any weight behind and,
  with `check_apply`, compares what the kernels use with a first load of the same copy.
  If that fails, reload the last good version (its mirror, or the checkpoint the engine
  started from) and report the failure: the model never keeps a mix. Without a spare
  mirror, once a version was applied the next pull overwrites its only copy: a failed
  apply then leaves the worker on no version (`restored` None), and the replica must
  not serve.
- `weightpull_commit(v)` once every worker applied `v`; else `weightpull_revert()` on all,
  so tensor-parallel workers never end on different versions.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch

from weightpull.errors import InvalidArgumentError, UnsupportedModelError, WeightpullError
from weightpull.integrations.torch_delta import patch_region
from weightpull.integrations.torch_digests import wsum64_digests
from weightpull.layout import TensorSpec
from weightpull.puller import Pulled
from weightpull.slice_puller import SlicePulled
from weightpull.slices import RankSlice

from . import apply, slices
from .mirrors import BackgroundPulls, checkpoint_weights, error_info

log = logging.getLogger(__name__)

WORKER_EXTENSION = "weightpull.integrations.vllm.worker.WeightpullWorker"
CHECKPOINT = "checkpoint"  # the last good version, before any was applied


def _setup(spec: dict[str, Any]):  # noqa: ANN202 - an async factory for BackgroundPulls
    async def setup():  # noqa: ANN202
        from weightpull.registry import connect_registry
        from weightpull.transports import create_transport

        registry = connect_registry(spec["registry"], **spec.get("registry_options", {}))
        transport = create_transport(spec["transport"], **spec.get("transport_options", {}))
        if spec.get("faults"):  # injected on purpose (tests, the demo's torn read)
            from weightpull.drivers.faulty import Faults, FaultyTransport

            transport = FaultyTransport(transport, Faults(**spec["faults"]))
        return registry, transport

    return setup


def relaying(spec: dict[str, Any]) -> dict[str, Any]:
    """The `Puller`'s relay options from a `PullSpec` (as a dict): none unless it names a
    host, so that a plain replica's pullers are made as before. `stream` unset streams
    whenever a host is named."""
    host = spec.get("host")
    if host is None:
        return {"stream": True} if spec.get("stream") else {}
    stream = spec.get("stream")
    return {
        "host": host,
        "stream": True if stream is None else bool(stream),
        "relay": bool(spec.get("relay", False)),
        "relay_cap": spec.get("relay_cap"),
    }


def digesting(device: str, *, whole: bool = True) -> dict[str, Any]:
    """The pullers' digest check for mirrors on `device`: on a GPU, the torch digester,
    which checks wsum64 digests where the mirror lies (a relay's bytes: `host`; a slice
    offered as a relay is digested by it too), and for a whole mirror the torch patcher,
    which patches a delta version there; none for a host mirror (checked and patched on
    the CPU)."""
    if device == "cpu":
        return {}
    return {"digester": wsum64_digests, "patcher": patch_region} if whole else {"digester": wsum64_digests}


def _malloc_trim() -> None:
    """Give the heap's free pages back to the system, where the C library can (glibc)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    if trim is not None:
        trim(0)


def pulls_slices(sharded: bool | str, tensor_parallel: int) -> bool:
    """Whether a worker of an engine of `tensor_parallel` ranks pulls only its slice:
    `PullSpec.sharded` "auto" does past one rank; True and False say so outright."""
    return tensor_parallel > 1 if sharded == "auto" else bool(sharded)


def mirror_device(wanted: str, worker_device: Any) -> str:
    """Where the mirrors go: "cpu", a GPU named outright, or "cuda": the worker's own GPU."""
    if wanted != "cuda":
        return wanted
    if worker_device is None or torch.device(worker_device).type != "cuda":
        raise InvalidArgumentError(
            f"mirror_device='cuda' puts the mirrors on the worker's GPU, "
            f"but this worker runs on {worker_device or 'no device'}"
        )
    return str(torch.device(worker_device))


class WeightpullWorker:
    """Mixed into each vLLM worker (it has `reload_weights`, `model_runner`, ...): name it
    as the engine's `worker_extension_cls` (`WORKER_EXTENSION`; `engine_args` does). Each
    worker keeps its mirrors, pulls in the background and applies through vLLM's
    `reload_weights`; `VllmEngine` calls its `weightpull_*` methods over `collective_rpc`,
    each returning plain data (an error as data too, raised typed by the engine)."""

    _weightpull: BackgroundPulls | None = None
    _weightpull_applied: Pulled | SlicePulled | None = None  # loaded, not yet committed
    # What a failed apply falls back on when no mirror holds the served version: the
    # checkpoint the engine started from, or nothing (None) once pulls were restarted
    # after a version was applied (its mirror went with them).
    _weightpull_fallback: str | None = CHECKPOINT
    _weightpull_ties: dict[str, list[str]] | None = None  # read from the model before any reload
    _weightpull_check: bool = True
    # A sharded replica's: per published tensor, the boxes this rank's loaders read, and the
    # tensors' specs (recorded once); this rank's slice of them, and the specs.
    _weightpull_reads: tuple[dict[str, Any], list[TensorSpec]] | None = None
    _weightpull_sliced: tuple[RankSlice, list[TensorSpec]] | None = None

    def weightpull_start(self, spec: dict[str, Any]) -> dict[str, Any]:
        """`spec` is a `PullSpec` as a dict: the registry's address, the transport's
        driver name, the lease holder's name, and optional settings. Pulls started before
        are replaced only once the new ones are made: a start refused here (a device this
        worker lacks, a registry it cannot reach) leaves them running."""
        try:
            device = mirror_device(spec.get("mirror_device", "cpu"), getattr(self, "device", None))
        except WeightpullError as exc:  # as data: the engine raises it, typed
            return {"error": error_info(exc)}
        if self._weightpull_ties is None:
            model = self.model_runner.get_model()  # type: ignore[attr-defined]
            try:
                apply.refuse_unsupported(model)
            except UnsupportedModelError as exc:  # as data: the engine raises it, typed
                return {"error": error_info(exc)}
            self._weightpull_ties = apply.tied_parameters(model)
            apply.identity_layers(model)  # probed now (once per model), not in the first pause
        sliced = None
        if pulls_slices(spec.get("sharded", "auto"), self._weightpull_tensor_parallel()):
            try:
                sliced = self._weightpull_slice()
            except Exception as exc:  # as data: the engine raises it, typed
                return {"error": error_info(exc)}
        try:
            pulls = BackgroundPulls(
                _setup(spec),
                holder=self._weightpull_holder(spec),
                ttl=spec.get("ttl", 10.0),
                device=device,
                rank_slice=None if sliced is None else sliced[0],
                mirrors=2 if spec.get("spare_mirror", True) else 1,
                publisher=spec.get("publisher"),
                **relaying(spec),
                **digesting(device, whole=sliced is None),
            )
        except WeightpullError as exc:  # as data: the engine raises it, typed
            return {"error": error_info(exc)}
        if self._weightpull is not None:
            if self._weightpull.pair.current is not None:
                self._weightpull_fallback = None  # the served version's mirror goes with them
            self._weightpull.close()
        self._weightpull, self._weightpull_sliced = pulls, sliced
        self._weightpull_check = bool(spec.get("check_apply", True))
        return self.weightpull_status()

    def weightpull_prepare(self) -> dict[str, Any]:
        """Start mapping the slots publishers reserved ahead, and sizing the mirrors, in the
        background (the first pull waits for it)."""
        self._weightpull_pulls().prepare()
        return {"preparing": True}

    def weightpull_prefetch(self, version: int) -> dict[str, Any]:
        self._weightpull_pulls().prefetch(version)
        return self.weightpull_status()

    def weightpull_status(self) -> dict[str, Any]:
        return self._weightpull_pulls().status()

    def weightpull_memory(self, trim: bool = False) -> dict[str, Any]:
        """What this worker process holds in host memory: its resident set (the model, the
        runtime and host mirrors alike) and its mirrors' bytes (on their device). With
        `trim`, freed heap memory goes back to the system first (glibc's `malloc_trim`),
        so that the resident set counts what is live, not what the allocator kept."""
        import psutil  # a dependency of vLLM's

        if trim:
            _malloc_trim()
        pulls = self._weightpull
        return {
            "pid": os.getpid(),
            "rss_bytes": psutil.Process().memory_info().rss,
            "mirror_bytes": 0 if pulls is None else pulls.pair.nbytes,
            "mirrors": 0 if pulls is None else len(pulls.pair.pullers),
            "sliced": self._weightpull_sliced is not None,
        }

    def weightpull_apply(self, version: int, timeout: float | None = None) -> dict[str, Any]:
        """Load the mirrored `version` into the model; on failure, the last good one."""
        pulls = self._weightpull_pulls()
        started = time.perf_counter()
        try:
            pulled = pulls.take(version, timeout)
            self._weightpull_servable(pulled)
        except Exception as exc:  # nothing was touched: the model still serves its version
            return {
                "ok": False,
                "version": version,
                "stage": "pull",
                "error": error_info(exc),
                "restored": self._weightpull_serving(),
            }
        try:
            report = self._weightpull_load(pulled)
        except Exception as exc:
            log.error("applying v%s failed (%s: %s); restoring the last good version", version, type(exc).__name__, exc)
            return {
                "ok": False,
                "version": version,
                "stage": "load",
                "error": error_info(exc),
                "restored": self._weightpull_restore(),
            }
        self._weightpull_applied = pulled
        return {"ok": True, "version": version, "seconds": time.perf_counter() - started, **report.as_dict()}

    def weightpull_commit(self, version: int) -> None:
        """Every worker applied `version`: it is now the last good one."""
        pulled, self._weightpull_applied = self._weightpull_applied, None
        if pulled is None or pulled.version != version:
            raise RuntimeError(f"v{version} was not applied on this worker")
        self._weightpull_pulls().pair.promote(pulled)

    def weightpull_revert(self) -> int | str | None:
        """Another worker failed to apply: load the last good version here too."""
        self._weightpull_applied = None
        return self._weightpull_restore()

    def weightpull_stop(self) -> None:
        if self._weightpull is not None:
            self._weightpull.close()
            self._weightpull = None

    # -- internals -------------------------------------------------------------------------

    def _weightpull_pulls(self) -> BackgroundPulls:
        if self._weightpull is None:
            raise RuntimeError("weightpull_start was not called on this worker")
        return self._weightpull

    def _weightpull_holder(self, spec: dict[str, Any]) -> str:
        """The lease holder's name: the replica's; a relay's, per worker where the engine
        has several (each offers its own mirror, and offers are kept per holder)."""
        holder = str(spec["holder"])
        world = getattr(getattr(self, "parallel_config", None), "world_size", 1)
        if spec.get("relay") and world > 1:
            return f"{holder}/rank{getattr(self, 'rank', 0)}"
        return holder

    def _weightpull_tensor_parallel(self) -> int:
        config = getattr(self, "parallel_config", None)
        return int(getattr(config, "tensor_parallel_size", 1))

    def _weightpull_serving(self) -> int | str | None:
        current = self._weightpull_pulls().pair.current
        return self._weightpull_fallback if current is None else current.version

    def _weightpull_slice(self) -> tuple[RankSlice, list[TensorSpec]]:
        """This rank's slice, recorded from its own loaders (`slices.record_reads`) once per
        worker, before any version is applied: the model then holds its checkpoint again."""
        if self._weightpull_reads is None:
            served = self._weightpull is not None and self._weightpull.pair.current is not None
            if served or self._weightpull_fallback != CHECKPOINT:
                raise RuntimeError("a worker records its slice before any version is applied")
            runner = self.model_runner  # type: ignore[attr-defined]
            dtype = str(runner.model_config.dtype).removeprefix("torch.")  # versions come in the engine's dtype
            specs = [TensorSpec(name, dtype, tuple(t.shape)) for name, t in apply.checkpoint_iterator(runner)]
            reads = slices.record_reads(
                runner, specs, ties=self._weightpull_ties or {}, restore=apply.checkpoint_iterator(runner)
            )
            self._weightpull_reads = (reads, specs)
        reads, specs = self._weightpull_reads
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        rank, ranks = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        return slices.rank_slice(reads, specs, rank, ranks), specs

    def _weightpull_servable(self, pulled: Pulled | SlicePulled) -> None:
        """Refuse, before anything is loaded, a version of a form this engine does not serve
        (a block-fp8 version to an unquantized checkpoint, or the reverse)."""
        from weightpull.integrations import fp8

        config = self.model_runner.model_config.hf_config  # type: ignore[attr-defined]
        quantization = getattr(config, "quantization_config", None)
        if quantization is not None and not isinstance(quantization, dict):
            quantization = quantization.to_dict()  # transformers' config object
        fp8.check_servable(pulled.manifest.layout, pulled.version, quantization)

    def _weightpull_load(self, pulled: Any) -> apply.ApplyReport:
        """Checkpoint-format reload, checked: from a mirror, or (None) from the model's own files."""
        runner = self.model_runner  # type: ignore[attr-defined]
        if pulled is None:
            weights = apply.checkpoint_iterator(runner)
        elif isinstance(pulled, SlicePulled):
            assert self._weightpull_sliced is not None
            weights = slices.checkpoint_weights(pulled, *self._weightpull_sliced)
        else:
            weights = checkpoint_weights(pulled)
        return apply.load(runner, weights, ties=self._weightpull_ties or {}, check=self._weightpull_check)

    def _weightpull_restore(self) -> int | str | None:
        """Reload the last good version whole over a failed load (`apply.load` has
        finished vLLM's reload, so nothing is left half wrapped). None if no mirror holds
        it any more (pulls restarted since, or no spare mirror) or the reload fails too."""
        mirrors = self._weightpull_pulls().pair
        current = mirrors.current
        if current is None and self._weightpull_fallback is None:
            log.error("no mirror holds the last good version (pulls restarted since): this replica must not serve")
            return None
        if current is not None and not mirrors.holds(current):
            log.error(
                "v%s, the last good version, was overwritten by the next pull in the one mirror (spare_mirror=False): "
                "this replica must not serve",
                current.version,
            )
            return None
        try:
            self._weightpull_load(current)
        except Exception:
            log.exception("restoring the last good version failed: this replica must not serve")
            return None
        return self._weightpull_serving()
