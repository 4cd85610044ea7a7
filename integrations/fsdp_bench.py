"""How long publishing blocks an FSDP2 trainer: one rank, a model of Qwen3-8B's shapes
in fp32 (16.4 GB as bf16), no optimizer state.

    python -m weightpull.integrations.fsdp_bench [--mode sharded,gathered] [--publishes 5]

Each publish follows a stand-in optimizer step (every parameter changes) and is timed
from the call to its return: the snapshot into the GPU staging buffer. The copy to a
pinned host slot and the announcement run after it returns; their time is reported
apart. At the end a replica pulls the last version and compares it, bit for bit, with
the parameters gathered and cast anew. One JSON line per mode goes to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time

import anyio
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

from weightpull.drivers.fake import FakeTransport
from weightpull.puller import Puller
from weightpull.registry import InProcessRegistry

from .fsdp import FSDPPublisher, named_state
from .torch_tensors import as_tensors


class PinnedFake(FakeTransport):
    """The in-process driver over page-locked host memory, as a real driver would
    register it, so that device-to-host copies run at full speed, asynchronously."""

    def allocate(self, nbytes: int, device: str = "cpu"):
        if device != "cpu" or not torch.cuda.is_available():
            return super().allocate(nbytes, device)
        return self.register(torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy())


def qwen3_shaped(layers: int, hidden: int, inter: int, vocab: int, heads: int, kv_heads: int, head_dim: int) -> nn.Module:
    """Qwen3's tensors under their checkpoint names, on the meta device (no forward)."""

    def linear(n_out: int, n_in: int) -> nn.Module:
        return nn.Linear(n_in, n_out, bias=False)

    def norm(n: int) -> nn.Module:
        m = nn.Module()
        m.weight = nn.Parameter(torch.empty(n))
        return m

    def layer() -> nn.Module:
        attn = nn.Module()
        attn.q_proj, attn.k_proj = linear(heads * head_dim, hidden), linear(kv_heads * head_dim, hidden)
        attn.v_proj, attn.o_proj = linear(kv_heads * head_dim, hidden), linear(hidden, heads * head_dim)
        attn.q_norm, attn.k_norm = norm(head_dim), norm(head_dim)
        mlp = nn.Module()
        mlp.gate_proj, mlp.up_proj, mlp.down_proj = linear(inter, hidden), linear(inter, hidden), linear(hidden, inter)
        m = nn.Module()
        m.input_layernorm, m.self_attn, m.post_attention_layernorm, m.mlp = norm(hidden), attn, norm(hidden), mlp
        return m

    with torch.device("meta"):
        body = nn.Module()
        body.embed_tokens = nn.Embedding(vocab, hidden)
        body.layers = nn.ModuleList(layer() for _ in range(layers))
        body.norm = norm(hidden)
        model = nn.Module()
        model.model, model.lm_head = body, linear(vocab, hidden)
    return model


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args: argparse.Namespace) -> list[dict]:
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    model = qwen3_shaped(args.layers, args.hidden, args.inter, args.vocab, args.heads, args.kv_heads, args.head_dim)
    model.to_empty(device=device)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    params = [p for _, p in named_state(model)]
    results = []
    for mode in args.mode.split(","):
        with FSDPPublisher(model, mode=mode, registry=InProcessRegistry(), transport=PinnedFake(),
                           name=mode, num_slots=2) as publisher:
            started = time.perf_counter()
            publisher.publish(0).result()  # registers the slot it takes: once per slot, not per step
            first_s = time.perf_counter() - started
            blocking, background = [], []
            for version in range(1, args.publishes + 1):
                with torch.no_grad():  # a stand-in optimizer step: every parameter moves
                    torch._foreach_add_([p.to_local() for p in params], 1e-3)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                ticket = publisher.publish(version)
                returned = time.perf_counter()
                result = ticket.result()
                background.append(time.perf_counter() - returned)
                blocking.append(ticket.blocking_s)
            exact = _check(publisher, model, device, args.publishes) if args.verify else None
            nbytes = result.manifest.nbytes
        results.append({
            "mode": mode, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "tensors": len(params), "bf16_bytes": nbytes, "publishes": args.publishes,
            "blocking_ms": [round(s * 1e3, 2) for s in blocking],
            "blocking_median_ms": round(statistics.median(blocking) * 1e3, 2),
            "blocking_max_ms": round(max(blocking) * 1e3, 2),
            "metric_max_ms": round(publisher.blocking.max_s * 1e3, 2),
            "announced_after_return_ms": [round(s * 1e3, 1) for s in background],
            "first_publish_s": round(first_s, 2), "bit_exact": exact,
        })
        print(json.dumps(results[-1]), flush=True)
    dist.destroy_process_group()
    return results


def _check(publisher: FSDPPublisher, model: nn.Module, device: torch.device, version: int) -> bool:
    """Pull the newest version as a replica would and compare it with the parameters,
    gathered and cast anew."""
    assert publisher.publisher is not None
    puller = Puller(publisher.publisher.registry, FakeTransport(), holder="check")
    pulled = anyio.run(puller.pull)
    got = as_tensors(pulled.layout, pulled.region)
    exact = pulled.version == version and list(got) == [n for n, _ in named_state(model)]
    with torch.no_grad():
        for name, p in named_state(model):
            want = p.full_tensor().to(torch.bfloat16)
            exact = exact and torch.equal(got[name].to(device).view(torch.int16), want.view(torch.int16))
    anyio.run(puller.aclose)
    return exact


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", default="sharded,gathered")
    parser.add_argument("--publishes", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--no-verify", dest="verify", action="store_false")
    for name, default in [("layers", 36), ("hidden", 4096), ("inter", 12288), ("vocab", 151936), ("heads", 32),
                          ("kv-heads", 8), ("head-dim", 128)]:
        parser.add_argument(f"--{name}", type=int, default=default)
    results = run(parser.parse_args(argv))
    return 0 if all(r["bit_exact"] in (True, None) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
