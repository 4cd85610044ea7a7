"""The trainer: one rank of a two-rank FSDP2 job (gloo, CPU) that never calls into rollout.

Each step: sample fresh groups from the ledger's replay buffer (rank 0; the wait is
health-checked), train on them (GRPO: per-digit rewards, the group's mean as baseline),
publish the weights with the sharded FSDP publish (its only weight work: a snapshot into
a slot), mark the groups trained, log the step, checkpoint (model, optimizer, step and
version, with DCP), and enqueue the prompts of a later step tagged with the oldest
version still fresh enough. Resumed from a checkpoint, it first recovers the ledger
(running prompts back to pending; prompts trained after the checkpoint untrained) and
continues the registry's numbering. At the end it waits (bounded) until every replica
serves the newest version, then validates through them with greedy prompts.

Run by the demo as `python -m weightpull.integrations.loop.trainer SPEC` with torchrun's
environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and the trainer's key.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import random
import shutil
import sys
import time
from typing import Any, NoReturn

import anyio
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

from weightpull.errors import PublishError, VersionWaitTimeoutError
from weightpull.rl.dispatcher import Prompt
from weightpull.rl.health import Health, Producer
from weightpull.rl.ledger import Ledger
from weightpull.rl.replay import ReplayBuffer, Sampler
from weightpull.rl.staleness import StalenessClock

from . import task
from .settings import LoopConfig, Paths


def step_prompts(cfg: LoopConfig, step: int, min_version: int) -> list[Prompt]:
    """The prompts of `step`: a pure function of the step, so a resumed trainer makes the
    same ones (and the ledger keeps the first)."""
    rng = random.Random(f"{cfg.seed}-{step}")
    prompts = []
    for g in range(cfg.groups_per_step):
        payload = {"tokens": task.prompt_tokens(rng, cfg.digits), "n": cfg.samples, "max_tokens": cfg.digits}
        prompts.append(Prompt(f"s{step}-g{g}", min_version, payload, group=f"s{step}-g{g}"))
    return prompts


def validation_prompts(cfg: LoopConfig, version: int) -> list[Prompt]:
    rng = random.Random(f"{cfg.seed}-validation")
    return [
        Prompt(
            f"val-v{version}-{i}",
            version,
            {"tokens": task.prompt_tokens(rng, cfg.digits), "n": 1, "max_tokens": cfg.digits, "greedy": True},
            group=f"val-v{version}-{i}",
        )
        for i in range(cfg.validation_prompts)
    ]


class Trainer:
    def __init__(self, cfg: LoopConfig, paths: Paths, address: str, run: int) -> None:
        self.cfg, self.paths, self.address, self.run = cfg, paths, address, run
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.model = task.make_model(cfg.seed)
        for layer in self.model.model.layers:
            fully_shard(layer)
        fully_shard(self.model)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr)
        self.ledger = Ledger.open(paths.ledger, max_inflight=cfg.max_inflight) if self.rank == 0 else None
        self.step = 0
        self.version: int | None = None  # the registry's number of the last publish

    # -- checkpoints ---------------------------------------------------------------------

    def _state(self) -> dict[str, Any]:
        model, optim = get_state_dict(self.model, self.optimizer)
        return {"model": model, "optim": optim}

    def latest(self) -> dict[str, Any] | None:
        marker = self.paths.checkpoint / "latest.json"
        return json.loads(marker.read_text()) if marker.exists() else None

    def save(self) -> None:
        target = self.paths.checkpoint / f"step-{self.step}"
        dcp.save(self._state(), checkpoint_id=str(target))
        dist.barrier()
        if self.rank == 0:  # the marker names a complete checkpoint, or the last one
            marker = self.paths.checkpoint / "latest.json"
            tmp = marker.with_suffix(".tmp")
            tmp.write_text(json.dumps({"step": self.step, "version": self.version, "dir": target.name}))
            os.replace(tmp, marker)
            for old in self.paths.checkpoint.glob("step-*"):
                if old != target:
                    shutil.rmtree(old, ignore_errors=True)
        dist.barrier()

    def load(self, latest: dict[str, Any]) -> None:
        state = self._state()
        dcp.load(state, checkpoint_id=str(self.paths.checkpoint / latest["dir"]))
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        self.step = latest["step"]

    # -- the steps -----------------------------------------------------------------------

    def warmup(self) -> None:
        """Supervised steps on the task, so that groups are not all zero at the start."""
        rng = random.Random(f"{self.cfg.seed}-warmup-{self.rank}")
        d = self.cfg.digits
        for _ in range(self.cfg.warmup_steps):
            prompts = [task.prompt_tokens(rng, d) for _ in range(32)]
            x = torch.tensor([p + task.answer(p) for p in prompts])
            logits = self.model(x[:, :-1]).logits[:, -d:]
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, task.VOCAB), x[:, -d:].reshape(-1))
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad()

    def train_on(self, batch: list[dict[str, Any]]) -> float:
        """One GRPO step on this rank's share of the groups; their mean reward."""
        d = self.cfg.digits
        mine = batch[self.rank :: self.world]
        rows, advantages, all_rewards = [], [], []
        for item in batch:
            rewards = torch.tensor([task.rewards(item["prompt"], c) for c in item["completions"]])
            all_rewards.append(rewards.mean().item())
            if item in mine:
                advantages.append(rewards - rewards.mean(0, keepdim=True))  # per digit: the group's baseline
                rows += [item["prompt"] + list(c) for c in item["completions"]]
        x = torch.tensor(rows)
        logits = self.model(x[:, :-1]).logits[:, -d:]
        logp = torch.log_softmax(logits, -1).gather(-1, x[:, -d:].unsqueeze(-1)).squeeze(-1)
        loss = -(torch.cat(advantages) * logp).mean()
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        return sum(all_rewards) / len(all_rewards)


def _broadcast(obj: Any, rank: int) -> Any:
    box = [obj if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _log(paths: Paths, record: dict[str, Any]) -> None:
    with open(paths.steps, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _asked(paths: Paths) -> int:
    """The highest number this trainer ever asked the registry for (-1: none), kept
    beside the checkpoint: a resumed trainer asks past it, and past every version the
    registry still holds, so a version half written by a killed run is never joined."""
    marker = paths.checkpoint / "asked"
    return int(marker.read_text()) if marker.exists() else -1


def _ask(paths: Paths, number: int) -> None:
    marker = paths.checkpoint / "asked"
    tmp = marker.with_suffix(".tmp")
    with open(tmp, "w") as f:
        f.write(str(number))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, marker)


async def _registry_numbers(address: str) -> tuple[int, dict[str, int]]:
    """(the highest version number the registry holds, -1 if none; who serves what)."""
    from weightpull.registry import connect_registry

    async with connect_registry(address) as registry:
        status = await registry.status()
    return max((v.version for v in status.versions), default=-1), dict(status.serving)


def _announced(ticket: Any, asked: int) -> int:
    """The version every rank's publish of `asked` announced; else a `PublishError`
    naming the first rank whose publish failed and why, raised on every rank (each waits
    for all, so none goes on alone)."""
    try:
        result = ticket.result()
        mine = None if result is None else result.version
        why = "" if mine is not None else "its publish announced nothing"
    except Exception as exc:  # the publish's error, whatever it is: the ranks must agree
        mine, why = None, f"{type(exc).__name__}: {exc}"
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (mine, why))
    for r, (version, reason) in enumerate(everyone):
        if version is None:
            raise PublishError(f"rank {r}'s publish of v{asked} failed: {reason}")
        if version != asked:
            raise PublishError(f"rank {r} asked the registry for v{asked} and got v{version}")
    return asked


def main(spec: str) -> NoReturn:
    """Run the trainer; on any failure, say why in one line (stderr, and the file the
    demo reads: `Paths.failure`) and exit 1 at once. Waiting for the background loop's
    thread or the process group's teardown could hang: the other rank may be dead."""
    s = json.loads(spec)
    paths, run, rank = Paths(s["root"]), s["run"], int(os.environ.get("RANK", "0"))
    try:
        _main(s)
    except BaseException as exc:  # SystemExit and KeyboardInterrupt end a rank too
        reason = " ".join(f"{type(exc).__name__}: {exc}".split())
        with contextlib.suppress(OSError):
            paths.failure(run, rank).write_text(reason)
        sys.stderr.write(f"trainer rank {rank} (run {run}) failed: {reason}\n")
        sys.stderr.flush()
        os._exit(1)
    os._exit(0)  # the process group's teardown is not needed


def _main(s: dict[str, Any]) -> None:
    cfg, paths, address, run = LoopConfig(**s["config"]), Paths(s["root"]), s["address"], s["run"]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    from weightpull.integrations.fsdp import FSDPPublisher

    t = Trainer(cfg, paths, address, run)
    rank = t.rank
    latest = t.latest()
    if latest is not None:
        t.load(latest)
    else:
        t.warmup()
    if rank == 0:
        assert t.ledger is not None
        recovered = t.ledger.recover(None if latest is None else latest["step"])
        highest, _ = anyio.run(_registry_numbers, address)
        _log(
            paths,
            {
                "event": "start",
                "run": run,
                "from_step": t.step,
                "requeued": len(recovered.requeued),
                "untrained": len(recovered.untrained),
                "registry_highest": highest,
            },
        )
    # A resumed trainer asks past every number the registry holds (the crashed run's
    # versions, one perhaps half written): the registry's numbering goes on.
    ask = None
    if rank == 0:
        ask = max(anyio.run(_registry_numbers, address)[0], _asked(paths)) + 1
        _ask(paths, ask)
    ask = _broadcast(ask, rank)
    publisher = FSDPPublisher(
        t.model, mode="sharded", registry=address, transport="nixl", rollout_dtype=None, name="trainer", num_slots=3
    )
    t.version = _announced(publisher.publish(ask), ask)
    staleness = StalenessClock(cfg.max_staleness, now=t.version)
    sampler = None
    if rank == 0:
        ledger = t.ledger
        assert ledger is not None

        def producers() -> list[Producer]:
            return [Producer(w.name, w.last_beat, w.failure) for w in ledger.workers()]

        sampler = Sampler(
            ReplayBuffer(staleness),
            ledger.ready_groups,
            producers,
            Health(cfg.health_timeout),
            on_evict=lambda gone: ledger.requeue([g.id for g in gone], staleness.min_weight_version()),
        )
        for s_ in range(t.step + 1, min(t.step + 1 + cfg.lookahead, cfg.steps + 1)):
            ledger.enqueue(step_prompts(cfg, s_, staleness.min_weight_version()))
    while t.step < cfg.steps:
        started = time.perf_counter()
        t.step += 1
        batch = None
        if rank == 0:
            assert sampler is not None and t.ledger is not None
            got = anyio.run(sampler.sample, cfg.groups_per_step)
            payloads = {e.id: e.payload for e in t.ledger.entries()}
            batch = {
                "waited_s": got.waited_s,
                "evicted": [g.id for g in got.evicted],
                "groups": [
                    {
                        "id": g.id,
                        "prompt": payloads[g.trajectories[0].prompt_id]["tokens"],
                        "completions": [list(tr.tokens) for tr in g.trajectories],
                        "age": staleness.age(g),  # the one clock's age, as eviction and the check saw it
                        "versions": [list(tr.versions) for tr in g.trajectories],
                    }
                    for g in got.groups
                ],
            }
        batch = _broadcast(batch, rank)
        ages = [g["age"] for g in batch["groups"]]
        reward = t.train_on(batch["groups"])
        asked = t.version + 1
        if rank == 0:
            _ask(paths, asked)
        ticket = publisher.publish(asked)
        if rank == 0:
            assert t.ledger is not None
            prompts = t.ledger.mark_trained([g["id"] for g in batch["groups"]], t.step)
            _log(
                paths,
                {
                    "event": "step",
                    "t": time.time(),
                    "run": run,
                    "step": t.step,
                    "version": asked,
                    "trained_on_version": t.version,
                    "reward": reward,
                    "groups": [g["id"] for g in batch["groups"]],
                    "prompts": prompts,
                    "ages": ages,
                    "versions_per_trajectory": max(len(set(v)) for g in batch["groups"] for v in g["versions"]),
                    "waited_s": batch["waited_s"],
                    "evicted": batch["evicted"],
                    "publish_block_s": ticket.blocking_s,
                },
            )
        t.version = _announced(ticket, asked)  # announced in the background; checked before going on
        staleness.advance(asked)
        t.save()
        if rank == 0:
            assert t.ledger is not None
            ahead = t.step + cfg.lookahead
            if ahead <= cfg.steps:
                t.ledger.enqueue(step_prompts(cfg, ahead, staleness.min_weight_version()))
        spare = cfg.min_step_s - (time.perf_counter() - started)
        if spare > 0:
            time.sleep(spare)
    if rank == 0:
        _validate(cfg, paths, address, t, run)
    dist.barrier()
    publisher.close()


def _validate(cfg: LoopConfig, paths: Paths, address: str, t: Trainer, run: int) -> None:
    """Wait (bounded) until every replica serves the newest version, then score greedy
    answers the replicas give on it."""
    assert t.ledger is not None and t.version is not None
    started = time.perf_counter()
    names = [f"replica-{i}" for i in range(cfg.replicas)]
    while True:
        _, serving = anyio.run(_registry_numbers, address)
        if all(serving.get(n, -1) >= t.version for n in names):
            break
        if time.perf_counter() - started > cfg.sync_timeout:
            raise VersionWaitTimeoutError(
                f"not every replica served v{t.version} within {cfg.sync_timeout} s: serving {serving}"
            )
        time.sleep(0.1)
    sync_s = time.perf_counter() - started
    prompts = validation_prompts(cfg, t.version)
    t.ledger.enqueue(prompts)
    ids = {p.id for p in prompts}
    while True:
        done = {e.id: e for e in t.ledger.entries() if e.id in ids and e.state.value == "done"}
        if len(done) == len(ids):
            break
        if time.perf_counter() - started > cfg.sync_timeout:
            raise VersionWaitTimeoutError(f"validation did not finish within {cfg.sync_timeout} s")
        time.sleep(0.05)
    scores = [sum(task.rewards(e.payload["tokens"], e.result[0].tokens)) / cfg.digits for e in done.values()]
    versions = sorted({v for e in done.values() for v in e.result[0].versions})
    _log(
        paths,
        {
            "event": "validation",
            "run": run,
            "version": t.version,
            "sync_s": sync_s,
            "accuracy": sum(scores) / len(scores),
            "versions": versions,
        },
    )


if __name__ == "__main__":
    main(sys.argv[1])
