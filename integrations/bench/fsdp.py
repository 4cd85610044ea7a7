"""How long publishing blocks an FSDP2 trainer: one rank, a model of Qwen3-8B's shapes
in fp32 (16.4 GB as bf16), no optimizer state.

    weightpull bench fsdp [--mode sharded,gathered] [--publishes 5]

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
import time

import anyio
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

from weightpull.drivers.fake import FakeTransport
from weightpull.integrations.fsdp import FSDPPublisher, named_state
from weightpull.integrations.torch_tensors import as_tensors
from weightpull.puller import Puller
from weightpull.registry import InProcessRegistry

from .presets import qwen3_shaped
from .util import PinnedFake, free_port, median_ms


def run(args: argparse.Namespace) -> list[dict]:
    """Each mode's figures, also printed as one JSON line each as it ends. `args`: the
    command line's (`mode`, `publishes`, `device`, `verify`, and the model's shape: `layers`,
    `hidden`, `inter`, `vocab`, `heads`, `kv_heads`, `head_dim`)."""
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
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
        with FSDPPublisher(
            model, mode=mode, registry=InProcessRegistry(), transport=PinnedFake(), name=mode, num_slots=2
        ) as publisher:
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
        results.append(
            {
                "mode": mode,
                "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                "tensors": len(params),
                "bf16_bytes": nbytes,
                "publishes": args.publishes,
                "blocking_ms": [round(s * 1e3, 2) for s in blocking],
                "blocking_median_ms": median_ms(blocking),
                "blocking_max_ms": round(max(blocking) * 1e3, 2),
                "metric_max_ms": round(publisher.blocking.max_s * 1e3, 2),
                "announced_after_return_ms": [round(s * 1e3, 1) for s in background],
                "first_publish_s": round(first_s, 2),
                "bit_exact": exact,
            }
        )
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


def ok(results: list[dict]) -> bool:
    """Every mode's pulled copy bit-exact (or not checked: --no-verify)."""
    return all(r["bit_exact"] in (True, None) for r in results)
