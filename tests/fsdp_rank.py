"""One rank of a small FSDP2 training job that publishes through weightpull: test code,
run by tests/test_fsdp.py as `python -m tests.fsdp_rank MODE OUT` with torchrun's
environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and $WEIGHTPULL_REGISTRY.

It publishes v0 at start and v1..v3 after three optimizer steps, saves the full state
dict of v3 cast to bf16 (gathered independently of the publish) as OUT/expected.pt, then
breaks the publish of v4: in sharded mode rank 1's copy fails halfway; in gathered mode
rank 1 is killed in the middle of the gather. It writes OUT/rank{r}.json and stays alive
(its slots hold what replicas read) until OUT/done appears.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

VOCAB, HIDDEN, KV, INTER, LAYERS = 37, 16, 8, 24, 2  # odd vocab: uneven shards


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(HIDDEN, HIDDEN)
        self.k_proj = nn.Linear(HIDDEN, KV, bias=False)
        self.v_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.o_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.sinks = nn.Parameter(torch.randn(1))  # one row over two ranks: rank 1's shard is empty

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = torch.sigmoid(self.q_proj(x) + self.sinks * self.k_proj(x).sum(-1, keepdim=True))
        return self.o_proj(gate * self.v_proj(x))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(HIDDEN, INTER, bias=False)
        self.up_proj = nn.Linear(HIDDEN, INTER, bias=False)
        self.down_proj = nn.Linear(INTER, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class RMSNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(HIDDEN))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.input_layernorm, self.self_attn = RMSNorm(), Attention()
        self.post_attention_layernorm, self.mlp = RMSNorm(), MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(Layer() for _ in range(LAYERS))
        self.norm = RMSNorm()


class TinyLM(nn.Module):
    """Named as a Hugging Face Llama-style checkpoint names its tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.model = Body()
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(tokens)
        for layer in self.model.layers:
            x = layer(x)
        return self.lm_head(self.model.norm(x))


def main(mode: str, out: Path) -> None:
    from weightpull.integrations import torch_tensors
    from weightpull.integrations.fsdp import FSDPPublisher

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    torch.manual_seed(0)
    model = TinyLM()
    for i, layer in enumerate(model.model.layers):  # a wrapper that splices its name into every fqn
        model.model.layers[i] = fully_shard(checkpoint_wrapper(layer))
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    gathering = {"forbidden": False, "calls": 0, "die_at": None}
    full_tensor = DTensor.full_tensor

    def watched_full_tensor(self, *args, **kwargs):
        if gathering["forbidden"]:
            raise AssertionError("a sharded publish gathered a tensor")
        gathering["calls"] += 1
        if gathering["calls"] == gathering["die_at"]:
            os.kill(os.getpid(), signal.SIGKILL)  # a trainer rank dies mid-publish
        return full_tensor(self, *args, **kwargs)

    DTensor.full_tensor = watched_full_tensor
    publisher = FSDPPublisher(model, mode=mode, transport="nixl", name="trainer", num_slots=2)
    publish = publisher.publish

    def guarded(version):
        gathering["forbidden"] = mode == "sharded"
        try:
            return publish(version)
        finally:
            gathering["forbidden"] = False

    publisher.publish = guarded
    hook = publisher.attach(optimizer)  # v0 now, then one version per step
    report: dict = {"rank": rank, "blocking_s": []}
    batches = torch.randint(0, VOCAB, (4, 8, 12), generator=torch.Generator().manual_seed(1))
    for step in range(4):
        if step == 3:  # the full v3, gathered apart from any publish, is what replicas must read
            publisher.wait()
            expected = {n: t.full_tensor().to(torch.bfloat16) for n, t in _named(model)}
            if rank == 0:
                torch.save(expected, out / "expected.pt")
            if rank == 1 and mode == "sharded":
                _break_next_write(torch_tensors)
            if rank == 1 and mode == "gathered":
                gathering["die_at"] = gathering["calls"] + 3
        logits = model(batches[step, :, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batches[step, :, 1:].reshape(-1))
        loss.backward()
        try:
            optimizer.step()  # its hook publishes
        except Exception as exc:  # the gather of v4 broke: this rank's publish failed
            report["failed"] = f"{type(exc).__name__}: {exc}"
        optimizer.zero_grad()
        report["blocking_s"].append(publisher.blocking.last_s)
    hook.remove()
    publisher.wait()
    report["names"] = [n for n, _ in _named(model)]
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    while not (out / "done").exists():
        time.sleep(0.05)
    publisher.close()
    os._exit(0)  # the process group may be broken: skip its teardown


def _named(model: nn.Module):
    from weightpull.integrations.fsdp import named_state

    return named_state(model)


def _break_next_write(torch_tensors) -> None:
    """Rank 1's next copy into its slot writes half the tensors, then fails."""
    write = torch_tensors.TorchAdapter.write

    async def failing(self, items, region):
        torch_tensors.TorchAdapter.write = write
        await write(self, items[: len(items) // 2], region)
        raise RuntimeError("rank 1 lost its device mid-copy")

    torch_tensors.TorchAdapter.write = failing


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
