"""A rollout worker: one process, one vLLM replica, its update agent, and a claim loop.

The worker never hears from the trainer. Its agent pulls each new version and applies it
(pausing in `abort` mode: every trajectory comes from one version); the claim loop takes
the oldest pending prompts from the ledger that the version it serves may run, generates
each prompt's group, and completes it with the versions vLLM recorded. It beats in the
ledger (what the trainer's health check and the reclaim of a dead worker's prompts look
at), reclaims prompts of workers that went silent, and writes its agent's figures to a
file. Run as `python -m weightpull.integrations.loop.rollout SPEC`; stdin is its lifeline.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import anyio

from weightpull.rl.agent import PauseMode
from weightpull.rl.ledger import Entry, Ledger
from weightpull.rl.staleness import Trajectory

from .settings import LoopConfig, Paths

POLL_S = 0.05
BEAT_S = 0.5
PULL_ATTEMPTS, PULL_RETRY_S = 100, 0.2  # 20 s of failed pulls in a row before the agent gives up


async def run(cfg: LoopConfig, paths: Paths, index: int, address: str, out: Any = None) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from weightpull.integrations.vllm.engine import PullSpec, open_replica
    from weightpull.registry import connect_registry

    name = f"replica-{index}"
    keys = {"key": str(paths.keys / f"{name}.key_secret"), "server_key": str(paths.keys / "registry.key")}
    ledger = Ledger.open(paths.ledger, max_inflight=cfg.max_inflight)
    registry = connect_registry(address, **keys)
    spec = PullSpec(address, name, transport="nixl", registry_options=keys, publisher="trainer")  # its line
    inflight: set[str] = set()
    stats: dict[str, Any] = {"name": name, "pid": os.getpid(), "completed": 0, "aborted": 0, "late": 0}

    async def call(fn: Any, *args: Any) -> Any:  # SQLite may wait on another process's lock
        return await anyio.to_thread.run_sync(fn, *args)

    last_words: list[Any] = []  # the report, written once more as the worker stops
    try:
        async with (
            registry,
            open_replica(
                name,
                str(paths.model),
                registry,
                spec,
                pause_mode=PauseMode.ABORT,
                dtype="float32",
                max_model_len=64,
                max_num_seqs=256,
            ) as r,
            anyio.create_task_group() as tg,
        ):
            agent = r.agent
            # A version whose trainer died stays READY until the registry's liveness lapses
            # (seconds); reads of it fail meanwhile. Retry that long rather than fail.
            agent.max_pull_attempts, agent.retry_delay = PULL_ATTEMPTS, PULL_RETRY_S

            def report() -> None:
                out = {
                    **stats,
                    "serving": agent.serving,
                    "applied": agent.stats.applied,
                    "pause_s": agent.stats.pause_s,
                    "prefetch_s": agent.stats.prefetch_s,
                    "apply_failures": agent.stats.apply_failures,
                }
                tmp = paths.replica_report(name).with_suffix(".tmp")
                tmp.write_text(json.dumps(out))
                os.replace(tmp, paths.replica_report(name))

            last_words.append(report)

            async def beat() -> None:
                while True:
                    await call(ledger.beat, name, agent.serving)
                    stats["reclaimed"] = stats.get("reclaimed", 0) + len(
                        await call(ledger.reclaim, cfg.reclaim_timeout)
                    )
                    report()
                    await anyio.sleep(BEAT_S)

            async def generate(e: Entry) -> None:
                p = e.payload
                params = SamplingParams(
                    n=p["n"],
                    temperature=0.0 if p.get("greedy") else 1.0,
                    max_tokens=p["max_tokens"],
                    ignore_eos=True,
                    seed=p.get("seed"),
                )
                final = None
                try:
                    async for out in r.llm.generate(
                        TokensPrompt(prompt_token_ids=p["tokens"]), params, request_id=f"{e.id}@{name}#{e.attempts}"
                    ):
                        final = out
                    outs = final.outputs if final is not None else []
                    if len(outs) < p["n"] or any(c.finish_reason == "abort" for c in outs):
                        stats["aborted"] += 1
                        await call(ledger.release, name, e.id)  # an update aborted it: it runs again
                        return
                    trajectories = []
                    for c in outs:
                        versions = [int(span.version) for span in c.weight_versions or ()]
                        if not versions:
                            raise RuntimeError(f"vLLM recorded no weight version for {e.id}")
                        trajectories.append(Trajectory(e.id, c.token_ids, versions, group=e.group, replica=name))
                    if await call(ledger.complete, name, e.id, trajectories):
                        stats["completed"] += 1
                    else:
                        stats["late"] += 1  # reclaimed or recovered meanwhile: it runs again elsewhere
                finally:
                    inflight.discard(e.id)

            async def claim() -> None:
                while True:
                    serving = agent.serving
                    room = cfg.max_inflight - len(inflight)
                    if serving is not None and room > 0:
                        for e in await call(ledger.claim, name, serving, room):
                            inflight.add(e.id)
                            tg.start_soon(generate, e)
                    await anyio.sleep(POLL_S)

            async def lifeline() -> None:
                await anyio.wait_readable(sys.stdin.fileno())  # the demo never writes: EOF ends us
                tg.cancel_scope.cancel()

            async def agent_run() -> None:
                try:
                    await agent.run()
                except Exception as exc:
                    ledger.beat(name, agent.serving, failure=repr(exc))  # its last word, for the trainer
                    raise

            tg.start_soon(agent_run)
            tg.start_soon(beat)
            tg.start_soon(claim)
            tg.start_soon(lifeline)
            print("ready", file=out or sys.stdout, flush=True)
    finally:
        for report in last_words:
            report()
        ledger.close()


def main(spec: str) -> int:
    s = json.loads(spec)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    out = os.fdopen(os.dup(1), "w", buffering=1)  # our line to the demo: ready
    os.dup2(2, 1)  # what libraries print goes to stderr, never into that line
    anyio.run(run, LoopConfig(**s["config"]), Paths(s["root"]), s["index"], s["address"], out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
