"""`weightpull bench model --preset NAME`: weightpull's whole path against the limits and the baselines.

For each transport it measures, on a tensor set shaped like a real model: the trainer's
blocking time per publish, the pull bandwidth, the replica's apply pause and the time from
publish to the replica serving the version (`flow`). Beside them, in the same run, the
machine's copy limits (`limits`) and the pushes a user would pick instead (`baselines`).
Needs torch; `import weightpull` stays without it.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable
from typing import Any

import anyio
import attrs
import torch

from weightpull.integrations.processes import owns_children
from weightpull.transport import Transport
from weightpull.transports import list_transports, transport_class

from . import baselines, limits, util
from .flow import SLOTS, Setup, run_flow
from .presets import PRESETS, default_preset
from .util import Progress

ORDER = ("cuda_ipc", "nixl", "torch", "fake")  # the fast path first


def runnable() -> list[str]:
    """The transports that load here and can carry this machine's path."""
    names = [d.name for d in list_transports() if d.available]
    return sorted(names, key=lambda n: ORDER.index(n) if n in ORDER else len(ORDER))


def machine() -> str:
    gpu = f", {torch.cuda.get_device_name()} x{torch.cuda.device_count()}" if torch.cuda.is_available() else ""
    return util.machine(gpu, torch.__version__)


def lends(name: str) -> bool:
    """Whether the driver lends a peer's slot in place (`Transport.view`), where it is local."""
    return transport_class(name).view is not Transport.view


def _release(cuda: bool) -> None:
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


@owns_children
async def run(
    preset: str | None = None,
    transports: Iterable[str] | None = None,
    versions: int = 3,
    with_baselines: bool = True,
    progress: Callable[[int], Progress] = Progress,
    stream: bool = True,
    host_slots: bool = True,
) -> dict[str, Any]:
    cuda = torch.cuda.is_available()
    preset = preset or default_preset(cuda)
    if versions < 1:
        raise ValueError(f"versions must be at least 1, got {versions}")
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; pick one of {', '.join(PRESETS)}")
    device = "cuda:0" if cuda else "cpu"
    names = list(transports) if transports else runnable()
    setups = []
    for name in names:
        paths = [Setup(name, preset, versions, device)]
        if host_slots and paths[-1].slot != "cpu":  # (fails early, naming a missing extra) host slots too
            paths.append(Setup(name, preset, versions, device, host_slot=True))
        for path in paths:  # each serially, then streamed (read while written), side by side
            setups += [path, attrs.evolve(path, stream=True)] if stream else [path]
            if stream and path.slot == device and lends(name):  # and applied straight from the slot
                setups.append(attrs.evolve(path, in_place=True))
    todo = {k: why for k, why in baselines.available(cuda).items()} if with_baselines else {}
    tick = progress(1 + len(setups) * (versions + SLOTS) + sum(versions + 1 for why in todo.values() if why is None))
    try:
        nbytes = PRESETS[preset].bf16_bytes()
        tick.note("measuring the copy limits")
        lim = await anyio.to_thread.run_sync(limits.measure, nbytes, device)
        tick("limits")
        results = []
        serial: dict[str, Any] | None = None  # the path's serial figures, which its streamed ones follow
        for setup in setups:
            r = await run_flow(setup, tick, tick.note)
            _release(cuda)  # the next setup, or a baseline's processes, need this GPU's memory
            path = limits.for_path(lim, nbytes, setup.slot, "cpu" if not cuda else "cuda")
            r.update(
                {
                    "limit_gbps": path["pull_gbps"],
                    "limit": path["pull"],
                    "memcpy_gbps": lim["memcpy_gbps"],
                    "ratio_to_raw": _ratio(r["pull_gbps"], r["raw_gbps"]),
                    "ratio_to_limit": _ratio(r["pull_gbps"], path["pull_gbps"]),
                    "limits": {**lim, **path},
                }
            )
            if (setup.stream or setup.in_place) and serial is not None:  # the same path, serially, before
                r["serial_publish_to_serving_ms"] = serial["publish_to_serving_ms"]
                r["ratio_to_serial"] = _ratio(r["publish_to_serving_ms"], serial["publish_to_serving_ms"])
            if setup.stream and serial is not None:
                r["ratio_to_overlapped_limit"] = _ratio(r["publish_to_serving_ms"], path["overlapped_ms"])
            if setup.in_place:  # one copy in the trainer, one in the apply: nothing to overlap
                r["in_place_limit_ms"] = path["in_place_ms"]
                r["ratio_to_in_place_limit"] = _ratio(r["publish_to_serving_ms"], path["in_place_ms"])
            if not (setup.stream or setup.in_place):
                serial = r
            results.append(r)
        base = []
        for kind, why in todo.items():
            if why is None:
                tick.note(f"{kind}: starting two processes")
                base.append(await anyio.to_thread.run_sync(baselines.run_baseline, kind, preset, versions, tick))
            else:
                base.append({"name": kind, "what": baselines.KINDS[kind], "skipped": why})
    finally:
        tick.close()
    head = results[0] if results else {"size_bytes": nbytes}
    return {  # the first transport's figures, as `--size` reports them, then the rest
        **head,
        "preset": preset,
        "model": PRESETS[preset].model,
        "tensors": len(PRESETS[preset].shapes()),
        "tensor_bytes": nbytes,
        "versions": versions,
        "device": device,
        "machine": machine(),
        "limits": head.get("limits", lim),
        "baselines": base,
        "transports": results,
    }


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f} ms" if x < 1e4 else f"{x / 1e3:.2f} s"


def _rate(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f} GB/s"


def _limit_row(label: str, ms: float) -> list[str]:
    return [f"  {label}", "", "", "", _ms(ms), "", "", ""]


def _first_row(t: dict[str, Any]) -> list[str]:
    """The first version's publish->serving (slots and mirror mapped ahead), beside the steady one's."""
    ratio = t.get("first_to_steady")
    label = "  first version (slots mapped ahead" + (f"; x{ratio} of steady)" if ratio is not None else ")")
    return [label, "", "", "", _ms(t["first_publish_to_serving_s"] * 1e3), "", "", ""]


def table(r: dict[str, Any]) -> list[str]:
    """Rows for people: weightpull per transport, its limits, then the baselines."""
    lim = r["limits"]
    copies = ", ".join(f"{k.removesuffix('_gbps')} {v} GB/s" for k, v in lim.items() if k in limits.RATES)
    lines = [
        f"{r['preset']} ({r['model']}): {r['tensors']} tensors, {r['tensor_bytes'] / 1e9:.2f} GB bf16 on {r['device']}; "
        f"medians of {r['versions']} versions (after {SLOTS} to warm up; 1 for baselines)",
        f"machine: {r['machine']}",
        f"copy limits measured now: {copies}",
    ]
    rows = [["", "publish block", "pull", "apply pause", "publish->serving", "pull/raw", "pull/limit", "exact"]]
    for t in r["transports"]:
        lm = t["limits"]
        if t.get("in_place") or t.get("stream"):  # the same path, streamed or in place, beside its limit
            in_place = bool(t.get("in_place"))
            label, limit = (
                ("in place (applied straight from the slot", ("ratio_to_in_place_limit", "in-place limit"))
                if in_place
                else ("streamed (read while written", ("ratio_to_overlapped_limit", "overlapped limit"))
            )
            ratios = ", ".join(
                f"x{t[k]} of {what}" for k, what in (("ratio_to_serial", "serial"), limit) if t.get(k) is not None
            )
            rows.append(
                [
                    f"  {label}; {ratios})",
                    _ms(t["publish_block_ms"]),
                    "-" if in_place else _rate(t["pull_gbps"]),
                    _ms(t["apply_pause_ms"]),
                    _ms(t["publish_to_serving_ms"]),
                    "",
                    "",
                    "yes" if t["byte_exact"] else "NO",
                ]
            )
            rows.append(_first_row(t))
            if in_place:
                rows.append(_limit_row("in-place limit (cast into the slot, then apply)", lm["in_place_ms"]))
            elif lm.get("overlapped_ms") is not None:
                rows.append(
                    _limit_row("overlapped limit (slot copy and pull at once, then apply)", lm["overlapped_ms"])
                )
            continue
        rows.append(
            [
                f"weightpull {t['transport']} ({t['slot']} slot -> {t['mirror']} mirror)",
                _ms(t["publish_block_ms"]),
                _rate(t["pull_gbps"]),
                _ms(t["apply_pause_ms"]),
                _ms(t["publish_to_serving_ms"]),
                str(t["ratio_to_raw"]),
                str(t["ratio_to_limit"]),
                "yes" if t["byte_exact"] else "NO",
            ]
        )
        rows.append(
            [
                f"  limit ({lm['pull']})",
                _ms(lm["publish_block_ms"]),
                _rate(lm["pull_gbps"]),
                _ms(lm["apply_pause_ms"]),
                _ms(lm["publish_to_serving_ms"]),
                "",
                "",
                "",
            ]
        )
        rows.append([f"  raw ({t['raw']})", "", _rate(t["raw_gbps"]), "", "", "", "", ""])
        rows.append(_first_row(t))
    for b in r["baselines"]:
        if "skipped" in b:
            rows.append([f"baseline {b['name']}: skipped, {b['skipped']}", "", "", "", "", "", "", ""])
        else:
            rows.append(
                [
                    f"baseline {b['name']} (push)",
                    _ms(b["publish_block_ms"]),
                    _rate(b["update_gbps"]),
                    _ms(b["apply_pause_ms"]),
                    _ms(b["publish_to_serving_ms"]),
                    "",
                    "",
                    "yes" if b["byte_exact"] else "NO",
                ]
            )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return lines + ["  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]


def ok(r: dict[str, Any]) -> bool:
    return all(t["byte_exact"] for t in r["transports"]) and all(b.get("byte_exact", True) for b in r["baselines"])
