"""How much of a version changes from one training step to the next, and what a delta of
it would cost: the measurement that picks the unit of weightpull's deltas (issue 35).

Two trainings, each run here for a few steps, every step's weights cast to bf16 as a
publish casts them:

- `loop`: the loop demo's own training (`integrations/loop`): its tiny Llama, AdamW at the
  loop's learning rate, its warm-up, then its GRPO step (`Trainer.train_on`) on groups
  sampled from the model itself, as the demo's replicas would sample them.
- `qwen3`: a small Qwen3 made here (random, 4 layers), AdamW at an RL learning rate (1e-6),
  a GRPO-like loss on sequences it sampled (a reward per sequence, the group's mean as
  baseline).

For each, against the version `lag` steps back: the fraction of bf16 elements that changed,
the fraction of fixed blocks (of each size, aligned within each tensor) holding any change,
and the bytes each encoding moves as a fraction of the full version's: sparse indices
(`sparse16`: a 16-bit offset in 64 Ki-element chunks plus the value; `sparse32`: a 32-bit
index plus the value), a bitmap plus the values, and whole blocks (their values plus a
32-bit index each). Then the speed of the two units at equal bytes: encoding (compare,
gather) and patching (scatter) a 128 MiB buffer with the measured fraction changed, blocks
against sparse indices, side by side in one run.

    python -m weightpull.integrations.bench.delta [--steps 6] [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from types import SimpleNamespace
from typing import Any

import anyio
import numpy as np

from .util import best_seconds

BLOCKS = (64, 256, 1024, 4096, 65536)  # block sizes tried, in elements
LAGS = (1, 2, 4)  # versions back the delta is taken against
CHUNK = 1 << 16  # sparse16's chunk of elements: an offset in it fits 16 bits


def as_bf16_words(state: Iterable[tuple[str, Any]]) -> dict[str, np.ndarray]:
    """Each tensor cast to bf16 (as a publish casts fp32), as its raw 16-bit words."""
    import torch

    out = {}
    for name, t in state:
        out[name] = t.detach().to(torch.bfloat16).contiguous().view(torch.int16).numpy().reshape(-1).view(np.uint16)
    return out


def compare(old: dict[str, np.ndarray], new: dict[str, np.ndarray], blocks: Sequence[int] = BLOCKS) -> dict[str, Any]:
    """Changed elements and changed blocks of each size, and the bytes each encoding takes."""
    elements = changed = 0
    blocks_total = dict.fromkeys(blocks, 0)
    blocks_changed = dict.fromkeys(blocks, 0)
    block_elements = dict.fromkeys(blocks, 0)  # the elements in changed blocks (a tensor's last may be short)
    for name, a in new.items():
        diff = a != old[name]
        elements += diff.size
        changed += int(diff.sum())
        for size in blocks:
            n = -(-diff.size // size)
            padded = np.zeros(n * size, dtype=bool)
            padded[: diff.size] = diff
            hit = padded.reshape(n, size).any(axis=1)
            blocks_total[size] += n
            blocks_changed[size] += int(hit.sum())
            block_elements[size] += int(hit.sum()) * size - (size * n - diff.size if hit[-1] else 0)
    full = 2 * elements
    out: dict[str, Any] = {
        "elements": elements,
        "changed": changed,
        "element_fraction": changed / elements,
        "block_fraction": {str(s): blocks_changed[s] / blocks_total[s] for s in blocks},
    }
    encodings = {
        "sparse16": changed * (2 + 2) + 4 * -(-elements // CHUNK),
        "sparse32": changed * (4 + 2),
        "bitmap": -(-elements // 8) + 2 * changed,
    }
    for size in blocks:
        encodings[f"blocks{size}"] = 2 * block_elements[size] + 4 * blocks_changed[size]
    out["bytes_fraction"] = {k: v / full for k, v in encodings.items()}
    return out


# -- (a) the loop demo's training --------------------------------------------------------------


def _sample(model: Any, prompts: list[list[int]], n: int, digits: int, rng: Any) -> list[list[tuple[int, ...]]]:
    """`n` completions of `digits` tokens for each prompt, sampled from `model`."""
    import torch

    out = []
    with torch.no_grad():
        for prompt in prompts:
            x = torch.tensor([prompt] * n)
            for _ in range(digits):
                probs = torch.softmax(model(x).logits[:, -1].float(), -1)
                x = torch.cat([x, torch.multinomial(probs, 1, generator=rng)], 1)
            out.append([tuple(row[len(prompt) :]) for row in x.tolist()])
    return out


def loop_versions(steps: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """The bf16 versions the loop demo's trainer publishes: after its warm-up, then after
    each GRPO step (its own `Trainer.warmup` and `Trainer.train_on`, on one rank)."""
    import torch

    from weightpull.integrations.loop import task
    from weightpull.integrations.loop.settings import LoopConfig
    from weightpull.integrations.loop.trainer import Trainer

    cfg = LoopConfig(seed=seed)
    model = task.make_model(cfg.seed)
    trainer = SimpleNamespace(
        cfg=cfg, model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=cfg.lr), rank=0, world=1
    )
    Trainer.warmup(trainer)  # type: ignore[arg-type]  # the loop's own steps, on one rank
    versions = [as_bf16_words(model.state_dict().items())]
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        prompts = [task.prompt_tokens(rng, cfg.digits) for _ in range(cfg.groups_per_step)]
        completions = _sample(model, prompts, cfg.samples, cfg.digits, gen)
        batch = [{"prompt": p, "completions": c} for p, c in zip(prompts, completions, strict=True)]
        Trainer.train_on(trainer, batch)  # type: ignore[arg-type]
        versions.append(as_bf16_words(model.state_dict().items()))
    return versions


# -- (b) a small Qwen3 at an RL learning rate ---------------------------------------------------

QWEN3 = dict(
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    vocab_size=8192,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)


def qwen3_versions(steps: int, seed: int = 0, lr: float = 1e-6) -> list[dict[str, np.ndarray]]:
    """The bf16 versions of `qwen3_states`."""
    return [as_bf16_words(state.items()) for state in qwen3_states(steps, seed, lr)]


def qwen3_states(steps: int, seed: int = 0, lr: float = 1e-6) -> list[dict[str, Any]]:
    """The fp32 weights, after each step, of a small random Qwen3 trained with AdamW at
    `lr` on a GRPO-like loss: 8 groups of 4 sequences of 16 tokens sampled from it after a
    16-token prompt, each rewarded by how many of its tokens are even, the group's mean as
    the baseline."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(Qwen3Config(**QWEN3)).to(torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    versions = [{n: t.detach().clone() for n, t in model.state_dict().items()}]
    gen = torch.Generator().manual_seed(seed)
    groups, per_group, prompt_len, new = 8, 4, 16, 16
    for _ in range(steps):
        prompts = torch.randint(0, QWEN3["vocab_size"], (groups, prompt_len), generator=gen)
        x = prompts.repeat_interleave(per_group, 0)
        with torch.no_grad():
            for _ in range(new):
                probs = torch.softmax(model(x).logits[:, -1], -1)
                x = torch.cat([x, torch.multinomial(probs, 1, generator=gen)], 1)
        completion = x[:, prompt_len:]
        reward = (completion % 2 == 0).float().mean(1).view(groups, per_group)
        advantage = (reward - reward.mean(1, keepdim=True)).view(-1, 1)
        logits = model(x[:, :-1]).logits[:, prompt_len - 1 :]
        logp = torch.log_softmax(logits, -1).gather(-1, completion.unsqueeze(-1)).squeeze(-1)
        loss = -(advantage * logp).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        versions.append({n: t.detach().clone() for n, t in model.state_dict().items()})
    return versions


# -- the versions published: full, delta, fp8 and fp8 delta, each pulled and checked ------------


def wire(states: Sequence[dict[str, Any]], say: Callable[[str], None]) -> dict[str, Any]:
    """Each state published through a real `Publisher(deltas=True)` (the fake driver, in
    this process), as bf16 and as block fp8, and pulled by a `Puller` that holds the one
    before, so it patches each from its delta: per form, the mean bytes of a version whole,
    of its delta, and of what the patching replica read, the seconds a publish and a
    patched pull took, and the share of each class of tensor (linear weights, the rest)
    whose words changed. Every pulled copy is checked against the form's own cast."""
    return {form: anyio.run(_wire, states, form, say) for form in ("bf16", "fp8")}


async def _wire(states: Sequence[dict[str, Any]], form: str, say: Callable[[str], None]) -> dict[str, Any]:
    import torch

    from weightpull import InProcessRegistry, Publisher, Puller, as_tensors
    from weightpull.drivers.fake import FakeTransport
    from weightpull.integrations import fp8

    class Counting(FakeTransport):
        read_bytes = 0

        async def read(self, remote: Any, remote_offset: int, local: Any, local_offset: int, nbytes: int) -> None:
            self.read_bytes += nbytes
            await super().read(remote, remote_offset, local, local_offset, nbytes)

    def published(state: dict[str, Any]) -> dict[str, Any]:
        """The form's own cast, made here apart from the publisher's: what a pull must hold."""
        if form == "bf16":
            return {n: t.to(torch.bfloat16) for n, t in state.items()}
        return {n: v.tensor() if isinstance(v, fp8.Fp8Part) else v.to(torch.bfloat16) for n, v in fp8.expand(state)}

    registry = InProcessRegistry()
    publisher = Publisher(registry, FakeTransport(), digests="wsum64", deltas=True, delta_room=0.5)
    transport = Counting()
    puller = Puller(registry, transport)
    rows = []
    previous: dict[str, Any] | None = None
    for version, state in enumerate(states, 1):
        tensors = fp8.expand(state) if form == "fp8" else state
        started = time.perf_counter()
        result = await publisher.publish(version, tensors)
        publish_s = time.perf_counter() - started
        before = transport.read_bytes
        pulled = await puller.pull()
        want = published(state)
        got = as_tensors(pulled.layout, pulled.region)
        assert all(torch.equal(got[n].view(torch.uint8), w.contiguous().view(torch.uint8)) for n, w in want.items()), (
            f"{form} v{version}: the pulled copy is not the version"
        )
        manifest = result.manifest
        row: dict[str, Any] = {
            "version": version,
            "bytes": sum(b.nbytes for b in manifest.layout.buckets),
            "delta_bytes": manifest.delta.nbytes if manifest.delta else None,
            "read_bytes": transport.read_bytes - before,
            "patched": pulled.base is not None,
            "publish_s": publish_s,
            "pull_s": pulled.seconds,
        }
        if previous is not None and manifest.delta is not None:
            row["classes"] = _classes(previous, want, manifest.delta.word, fp8.quantizes)
        rows.append(row)
        previous = want
    later = [r for r in rows if r["patched"]]
    say(f"{form}: {len(later)} of {len(rows) - 1} versions patched from their delta")
    classes: dict[str, dict[str, float]] = {}
    for name in ("linear", "other"):
        got_rows = [r["classes"][name] for r in later if "classes" in r]
        if got_rows:
            classes[name] = {k: sum(c[k] for c in got_rows) / len(got_rows) for k in got_rows[0]}
    return {
        "bytes": rows[0]["bytes"],
        "delta_bytes": _avg([r["delta_bytes"] for r in later]),
        "read_bytes": _avg([r["read_bytes"] for r in later]),
        "whole_read_bytes": rows[0]["read_bytes"],
        "publish_s": _avg([r["publish_s"] for r in later]),
        "pull_s": _avg([r["pull_s"] for r in later]),
        "whole_pull_s": rows[0]["pull_s"],
        "classes": classes,
        "versions": rows,
    }


def _classes(old: dict[str, Any], new: dict[str, Any], word: int, linear: Callable[..., bool]) -> dict[str, Any]:
    """Per class of tensor (linear weights and their scales; the rest): its bytes, and the
    share of its `word`-byte words that changed (what a delta sends of it, at 2 + word bytes
    each)."""
    out = {k: {"bytes": 0, "changed": 0, "words": 0} for k in ("linear", "other")}
    for name, b in new.items():
        base = name.removesuffix("_scale_inv")
        kind = "linear" if linear(base, tuple(new[base].shape)) else "other"
        x = b.contiguous().view(-1).view(torch_uint8()).numpy()
        y = old[name].contiguous().view(-1).view(torch_uint8()).numpy()
        words = x.size // word
        changed = int((x.reshape(words, word) != y.reshape(words, word)).any(axis=1).sum())
        out[kind]["bytes"] += x.size
        out[kind]["changed"] += changed
        out[kind]["words"] += words
    return {
        k: {
            "bytes": v["bytes"],
            "changed": v["changed"] / v["words"],
            "delta_share": v["changed"] * (2 + word) / v["bytes"],
        }
        for k, v in out.items()
    }


def torch_uint8() -> Any:
    import torch

    return torch.uint8


def _avg(values: Sequence[float | None]) -> float | None:
    got = [v for v in values if v is not None]
    return sum(got) / len(got) if got else None


# A model of Qwen3-8B's shape (36 layers, hidden 4096, MLP 12288, 32 heads of 128, 8 KV
# heads, vocabulary 151936, untied head): the bytes of each class, to scale the measured
# shares by.
QWEN3_8B = {"linear": 36 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 12288), "other": 2 * 151936 * 4096}


def at_8b(result: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Bytes per version of a Qwen3-8B-shaped model, each form's measured shares applied
    to its classes' bytes: bf16 and fp8 whole, and each one's delta."""
    out = {}
    for form, run in result["wire"].items():
        width = {"linear": 1 if form == "fp8" else 2, "other": 2}
        whole = sum(n * width[k] for k, n in QWEN3_8B.items())
        if form == "fp8":
            whole += 4 * QWEN3_8B["linear"] // (128 * 128)  # the scales
        delta = sum(n * width[k] * run["classes"][k]["delta_share"] for k, n in QWEN3_8B.items() if k in run["classes"])
        out[form] = {"whole": whole, "delta": delta}
    return out


# -- the speed of the two units, side by side ---------------------------------------------------


def speed(fraction: float, block: int, nbytes: int = 128 << 20, repeat: int = 5, seed: int = 0) -> dict[str, Any]:
    """Seconds to encode (compare, gather) and patch (scatter) `nbytes` of bf16 words with
    `fraction` of them changed at random, by changed blocks of `block` elements and by
    sparse element indices; and each encoding's bytes."""
    rng = np.random.default_rng(seed)
    n = nbytes // 2 // block * block
    old = rng.integers(0, 1 << 16, n, dtype=np.uint16)
    new = old.copy()
    where = rng.choice(n, int(n * fraction), replace=False)
    new[where] ^= 1  # a changed low bit: a step moved the element by one unit
    target = old.copy()

    def block_encode() -> tuple[np.ndarray, np.ndarray]:
        a, b = old.reshape(-1, block), new.reshape(-1, block)
        ids = np.flatnonzero((a != b).any(axis=1)).astype(np.uint32)
        return ids, b[ids]

    def sparse_encode() -> tuple[np.ndarray, np.ndarray]:
        idx = np.flatnonzero(old != new)
        return idx, new[idx]

    ids, rows = block_encode()
    idx, vals = sparse_encode()

    def block_patch() -> None:
        target.reshape(-1, block)[ids] = rows

    def sparse_patch() -> None:
        target[idx] = vals

    out = {
        "bytes": 2 * n,
        "fraction": fraction,
        "block": block,
        "blocks": {
            "encode_s": best_seconds(block_encode, repeat),
            "patch_s": best_seconds(block_patch, repeat),
            "delta_bytes": ids.nbytes + rows.nbytes,
        },
        "sparse": {
            "encode_s": best_seconds(sparse_encode, repeat),
            "patch_s": best_seconds(sparse_patch, repeat),
            "delta_bytes": len(idx) * 4 + 4 * -(-n // CHUNK),  # as sparse16 sends them
        },
    }
    block_patch()
    assert np.array_equal(target, new), "the block patch did not give the new bytes"
    target[:] = old
    sparse_patch()
    assert np.array_equal(target, new), "the sparse patch did not give the new bytes"
    return out


# -- the report ---------------------------------------------------------------------------------


def measure(steps: int, say: Callable[[str], None]) -> dict[str, Any]:
    out: dict[str, Any] = {"steps": steps, "blocks": list(BLOCKS), "lags": list(LAGS), "runs": {}}
    say(f"training qwen3 for {steps} steps")
    states = qwen3_states(steps)
    for name, make in (("loop", loop_versions), ("qwen3", lambda _: [as_bf16_words(s.items()) for s in states])):
        if name == "loop":
            say(f"training {name} for {steps} steps")
        versions = make(steps)
        rows = {}
        for lag in LAGS:
            pairs = [compare(versions[i - lag], versions[i]) for i in range(lag, len(versions))]
            if pairs:
                rows[str(lag)] = _mean(pairs)
        out["runs"][name] = {"elements": pairs[0]["elements"] if pairs else 0, "lags": rows}
    fraction = out["runs"]["qwen3"]["lags"]["1"]["element_fraction"]
    say(f"timing blocks against sparse indices at {fraction:.2%} changed")
    out["speed"] = [speed(fraction, block) for block in (64, 1024)]
    say("publishing qwen3's versions as bf16 and as fp8, with deltas, each pulled by a replica holding the last")
    out["wire"] = wire(states, say)
    out["qwen3_8b"] = at_8b(out)
    return out


def _mean(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Each fraction's mean over the steps, and its range over them (element fraction)."""
    frac = [r["element_fraction"] for r in rows]
    return {
        "element_fraction": sum(frac) / len(frac),
        "element_fraction_range": [min(frac), max(frac)],
        "block_fraction": {k: sum(r["block_fraction"][k] for r in rows) / len(rows) for k in rows[0]["block_fraction"]},
        "bytes_fraction": {k: sum(r["bytes_fraction"][k] for r in rows) / len(rows) for k in rows[0]["bytes_fraction"]},
    }


def table(result: dict[str, Any]) -> str:
    lines = []
    head = ["training", "lag", "elements changed"] + [f"blocks of {b}" for b in BLOCKS]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "---|" * 2 + "---:|" * (len(head) - 2))
    for name, run in result["runs"].items():
        for lag, row in run["lags"].items():
            lo, hi = row["element_fraction_range"]
            cells = [name, lag, f"{row['element_fraction']:.3%} ({lo:.3%}-{hi:.3%})"]
            cells += [f"{row['block_fraction'][str(b)]:.1%}" for b in BLOCKS]
            lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    enc = ["sparse16", "sparse32", "bitmap"] + [f"blocks{b}" for b in BLOCKS]
    lines.append("| training | lag | " + " | ".join(f"{e} bytes" for e in enc) + " |")
    lines.append("|" + "---|" * 2 + "---:|" * len(enc))
    for name, run in result["runs"].items():
        for lag, row in run["lags"].items():
            cells = [name, lag] + [f"{row['bytes_fraction'][e]:.2%}" for e in enc]
            lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("| unit | changed | delta bytes | encode | patch | encode GB/s | patch GB/s |")
    lines.append("|---|---:|---:|---:|---:|---:|---:|")
    for s in result["speed"]:
        for unit in ("blocks", "sparse"):
            r = s[unit]
            what = f"blocks of {s['block']}" if unit == "blocks" else "sparse16 indices"
            lines.append(
                f"| {what} | {s['fraction']:.3%} | {r['delta_bytes'] / s['bytes']:.2%} | {r['encode_s'] * 1e3:.1f} ms | "
                f"{r['patch_s'] * 1e3:.1f} ms | {s['bytes'] / r['encode_s'] / 1e9:.2f} | "
                f"{s['bytes'] / r['patch_s'] / 1e9:.2f} |"
            )
    lines.append("")
    lines.append(
        "| form | a version whole | its delta (mean) | a patching replica read | publish | patched pull | whole pull |"
    )
    lines.append("|---|---:|---:|---:|---:|---:|---:|")
    bf16 = result["wire"]["bf16"]["bytes"]
    for form, run in result["wire"].items():
        cells = [
            form,
            f"{run['bytes'] / 1e6:.2f} MB ({run['bytes'] / bf16:.1%})",
            f"{run['delta_bytes'] / 1e6:.3f} MB ({run['delta_bytes'] / bf16:.2%})" if run["delta_bytes"] else "-",
            f"{run['read_bytes'] / 1e6:.3f} MB" if run["read_bytes"] else "-",
            f"{run['publish_s'] * 1e3:.0f} ms" if run["publish_s"] else "-",
            f"{run['pull_s'] * 1e3:.0f} ms" if run["pull_s"] else "-",
            f"{run['whole_pull_s'] * 1e3:.0f} ms",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("| form, class | bytes | words changed a step | delta bytes per byte |")
    lines.append("|---|---:|---:|---:|")
    for form, run in result["wire"].items():
        for k, c in run["classes"].items():
            lines.append(f"| {form}, {k} | {c['bytes'] / 1e6:.2f} MB | {c['changed']:.3%} | {c['delta_share']:.2%} |")
    lines.append("")
    lines.append("| Qwen3-8B-shaped | whole | delta | delta / bf16 whole |")
    lines.append("|---|---:|---:|---:|")
    base = result["qwen3_8b"]["bf16"]["whole"]
    for form, b in result["qwen3_8b"].items():
        lines.append(f"| {form} | {b['whole'] / 1e9:.2f} GB | {b['delta'] / 1e9:.3f} GB | {b['delta'] / base:.2%} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m weightpull.integrations.bench.delta", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--steps", type=int, default=6, help="training steps of each model (default: 6)")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON line")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be at least 1")

    def say(line: str) -> None:
        sys.stderr.write(f"[delta] {line}\n")

    result = measure(args.steps, say)
    print(json.dumps(result) if args.json else table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
