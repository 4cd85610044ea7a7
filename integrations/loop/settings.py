"""The loop's settings, shared by the demo and every process it starts (as JSON)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs

from weightpull.errors import InvalidArgumentError


@attrs.frozen
class LoopConfig:
    steps: int = 24  # training steps in all, across the restart
    replicas: int = 2
    groups_per_step: int = 8  # prompt groups in one training batch
    samples: int = 8  # trajectories per group (GRPO's group)
    digits: int = 3  # the task: reverse this many digits
    lr: float = 2e-3
    warmup_steps: int = 10  # supervised steps before the first version: no all-zero groups
    max_staleness: int = 2  # off-policy bound, in versions
    lookahead: int = 3  # steps of prompts enqueued ahead of training
    max_inflight: int = 32  # prompts running at once, over every replica
    min_step_s: float = 1.0  # the least time a training step takes: stands for a bigger model's step
    kill_at: int | None = None  # SIGKILL the trainer after this step (None: a random one)
    health_timeout: float = 20.0  # no rollout worker heard from for this long: the trainer fails
    reclaim_timeout: float = 10.0  # a worker silent this long loses its running prompts
    sync_timeout: float = 60.0  # the bounded wait for every replica to serve the newest version
    validation_prompts: int = 16
    seed: int = 0

    def __attrs_post_init__(self) -> None:
        for name in ("steps", "replicas", "groups_per_step", "samples", "digits", "max_inflight"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise InvalidArgumentError(f"{name} must be an int >= 1, got {getattr(self, name)!r}")
        if self.steps < 4:
            raise InvalidArgumentError(f"the loop needs steps >= 4 (to kill and resume the trainer), got {self.steps}")
        if self.groups_per_step < 2:
            raise InvalidArgumentError(
                f"groups_per_step must be >= 2 (one per trainer rank), got {self.groups_per_step}"
            )
        if self.samples < 2:
            raise InvalidArgumentError(f"samples must be >= 2 (a group's baseline), got {self.samples}")
        if self.kill_at is not None and not 1 <= self.kill_at < self.steps:
            raise InvalidArgumentError(f"kill_at must be in [1, {self.steps}), got {self.kill_at}")

    def to_json(self) -> str:
        return json.dumps(attrs.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> LoopConfig:
        return cls(**json.loads(text))


@attrs.frozen
class Paths:
    """Where the run keeps its state: the ledger beside the checkpoint."""

    root: Path = attrs.field(converter=Path)

    @property
    def ledger(self) -> Path:
        return self.root / "checkpoint" / "ledger.db"

    @property
    def checkpoint(self) -> Path:
        return self.root / "checkpoint"

    @property
    def model(self) -> Path:
        return self.root / "model"

    @property
    def keys(self) -> Path:
        return self.root / "keys"

    @property
    def steps(self) -> Path:
        return self.root / "steps.jsonl"

    def replica_report(self, name: str) -> Path:
        return self.root / f"{name}.json"

    def failure(self, run: int, rank: int) -> Path:
        """Where a trainer rank that failed says why, in one line."""
        return self.root / f"trainer-run{run}-rank{rank}.failed"


def spec(cfg: LoopConfig, root: Path, **extra: Any) -> str:
    return json.dumps({"config": attrs.asdict(cfg), "root": str(root), **extra})
