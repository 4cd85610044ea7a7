"""`CudaIpcTransport`: registration, export, connection and reads (see the package's docstring)."""

from __future__ import annotations

import ctypes
import json
import mmap
import os
from collections.abc import Sequence
from typing import Any

import anyio
import attrs

from weightpull.errors import DriverUnavailableError, InvalidArgumentError, RegionNotRegisteredError, TransportError
from weightpull.transport import (
    Read2D,
    Region,
    RegionTable,
    Remote,
    Transport,
    address_of,
    check_2d,
    check_span,
    span_2d,
    writable_bytes,
)

from . import mappings
from .driver_api import ALREADY_REGISTERED, HOSTREGISTER_PORTABLE, DeviceMemory, IpcHandle, cuda
from .lanes import Lane, Wait
from .mappings import Import
from .owners import CLOSED, DATA_OFFSET, DEREGISTERED, FILE_PREFIX, RECORD, OwnerFile, boot_id, sweep_dead_owners

_MERGE_UP_TO = 1 << 30  # adjacent reads go as one copy up to this; the stream starts on the first meanwhile


def _torch() -> Any:
    import torch

    return torch


@attrs.define(eq=False)
class _Registration:
    """`Region.handle`: where the memory is, and what this driver did to it."""

    pointer: int
    device: int | None  # None: host memory
    pinned: bool = False  # page-locked by us, to undo
    owner: Any = None  # the allocation, when this driver made it: kept while registered
    export: OwnerFile | None = None
    key: str = ""  # what readers map, once exported: the IPC handle (hex) or the host slot's file
    descriptor: bytes | None = None


class _Mapped:
    """A peer's mapped device memory, as torch takes it (`__cuda_array_interface__`);
    the mapping is the connection's: it lasts until the remote is disconnected."""

    def __init__(self, pointer: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (pointer, False),  # read-only in truth, the peer's (torch takes no such flag)
            "version": 2,
            "strides": None,
        }


def _connected(remote: Remote) -> Import:
    """The import behind `remote`, while this driver's connection to it stands."""
    imp = remote.handle
    if not isinstance(imp, Import) or not imp.connected:
        raise InvalidArgumentError("that remote was not connected by this cuda_ipc transport, or was disconnected")
    return imp


def _device_index(device: str) -> int:
    torch = _torch()
    d = torch.device(device)
    if d.type != "cuda":
        raise InvalidArgumentError(f"{device!r} is not a CUDA device")
    return d.index if d.index is not None else torch.cuda.current_device()


class CudaIpcTransport(RegionTable, Transport):
    """The `cuda_ipc` driver: processes of one host, GPU slots over CUDA IPC and host slots
    in page-locked shared memory, read by device copies (a GPU on the host reads a slot
    on another peer-to-peer). Needs torch and a CUDA device; `unavailable_reason` says
    why not.
    """

    name = "cuda_ipc"
    reads_into_gpu = True
    native_2d = True

    def __init__(self, *, device: str | None = None) -> None:
        """Make an endpoint; it removes the files of owners on this host that died without
        closing.

        Args:
            device: The GPU that copies into host regions (default: the current CUDA
                device); reads into a GPU region run on that region's own GPU.
        """
        self._device = device
        self._index: int | None = None
        self._regions: dict[_Registration, Region] = {}
        self._imports: set[Import] = set()
        self._lanes: dict[int, Lane] = {}
        self._closed = False
        sweep_dead_owners()

    @classmethod
    def unavailable_reason(cls) -> str | None:
        try:
            torch = _torch()
        except ImportError as exc:
            return f"torch is not installed ({exc}); pip install 'weightpull[torch]'"
        if not torch.cuda.is_available():
            return f"no CUDA device here (torch {torch.__version__} sees none)"
        try:
            cuda()
        except (DriverUnavailableError, TransportError) as exc:
            return str(exc)
        return None

    @property
    def device(self) -> int:
        """The index of the GPU that copies into host regions.

        Raises:
            InvalidArgumentError: The `device` given is not a CUDA device.
        """
        if self._index is None:
            self._index = _device_index(self._device or "cuda")
        return self._index

    # -- registration ---------------------------------------------------------------------

    def allocate(self, nbytes: int, device: str = "cpu") -> Region:
        """A GPU region is a plain device allocation; a host one is page-locked shared memory.
        Both are exportable."""
        if device == "cpu":
            self._check_open()
            shared = OwnerFile(nbytes, data=True)
            try:
                region = self.register(shared.data)
            except BaseException:
                shared.release(CLOSED)
                raise
            region.handle.export = shared  # the file is the region: it goes when the region does
            return region
        if not (device == "cuda" or device.startswith("cuda:")):
            raise InvalidArgumentError(f"cuda_ipc transport cannot allocate on {device!r} (cpu or cuda[:N])")
        index = _device_index(device)
        torch = _torch()
        if not nbytes:
            return self.register(torch.empty(0, dtype=torch.uint8, device=f"cuda:{index}"), f"cuda:{index}")
        owner = DeviceMemory(nbytes, index)
        region = self.register(torch.as_tensor(owner, device=f"cuda:{index}"), f"cuda:{index}")
        region.handle.owner = owner
        return region

    def register(self, memory: Any, device: str = "cpu") -> Region:
        self._check_open()
        torch = _torch()
        if isinstance(memory, torch.Tensor):
            if not memory.is_contiguous():
                raise InvalidArgumentError("cuda_ipc transport needs a contiguous tensor")
            flat = memory.detach().reshape(-1).view(torch.uint8)
            if flat.is_cuda:
                where = f"cuda:{flat.device.index}"
                if device not in ("cpu", "cuda", where):
                    raise InvalidArgumentError(f"the tensor lives on {where}, not {device!r}")
                reg = _Registration(flat.data_ptr(), flat.device.index)
                return self._add(Region(nbytes=flat.numel(), device=where, memory=flat, handle=reg))
            if flat.device.type != "cpu" or device != "cpu":
                raise InvalidArgumentError(
                    f"cuda_ipc transport registers host or CUDA tensors, not {flat.device} as {device!r}"
                )
            view = memoryview(flat.numpy()) if flat.numel() else memoryview(bytearray())
            region = Region(nbytes=flat.numel(), device="cpu", memory=flat, view=view)
            if flat.is_pinned():  # by its allocator: nothing to do, or undo
                region.handle = _Registration(flat.data_ptr(), None)
                return self._add(region)
            return self._pin(region, flat.data_ptr())
        if device != "cpu":
            raise InvalidArgumentError(f"cuda_ipc transport registers {device!r} memory as a torch tensor only")
        view = writable_bytes("cuda_ipc", memory)
        return self._pin(Region(nbytes=view.nbytes, device="cpu", memory=memory, view=view), address_of(view))

    def _pin(self, region: Region, address: int) -> Region:
        """Page-lock host memory once, so copies into it run at DMA speed."""
        pinned = False
        if region.nbytes:
            cu = cuda()
            with cu.on(self.device):
                result = cu.cuMemHostRegister_v2(address, region.nbytes, HOSTREGISTER_PORTABLE)
            if result not in (0, ALREADY_REGISTERED):  # already: pinned by its allocator
                cu.check(result, f"page-locking {region.nbytes} bytes of host memory")
            pinned = result == 0
        region.handle = _Registration(address, None, pinned)
        return self._add(region)

    def _add(self, region: Region) -> Region:
        self._regions[region.handle] = region
        return region

    def deregister(self, region: Region) -> None:
        reg = region.handle
        if self._regions.pop(reg, None) is None:
            return
        if reg.pinned:
            cu = cuda()
            with cu.on(self.device):
                cu.check(cu.cuMemHostUnregister(reg.pointer), f"unpinning {region.nbytes} bytes of host memory")
            reg.pinned = False
        if reg.export is not None:
            mappings.own_exports.pop(reg.key, None)
            reg.export.release(DEREGISTERED)

    def export(self, region: Region) -> bytes:
        """Export once: the same descriptor every time after."""
        reg = self._mine(region, "export")
        if reg.descriptor is None:
            reg.descriptor = self._export_host(region, reg) if reg.device is None else self._export_device(region, reg)
        return reg.descriptor

    def _export_host(self, region: Region, reg: _Registration) -> bytes:
        if reg.export is None or reg.export.data is None:
            raise InvalidArgumentError(
                "cuda_ipc exports host memory it allocated itself (shared memory a reader "
                "can map): let this transport allocate the slot"
            )
        reg.key = reg.export.path
        mappings.own_exports[reg.key] = reg.pointer
        return self._descriptor(reg, "host", "", DATA_OFFSET, region.nbytes)

    def _export_device(self, region: Region, reg: _Registration) -> bytes:
        offset = 0
        if region.nbytes:
            cu = cuda()
            with cu.on(reg.device):
                base, _ = cu.address_range(reg.pointer) or (reg.pointer, 0)
                raw = IpcHandle()
                result = cu.cuIpcGetMemHandle(ctypes.byref(raw), base)
            if result:
                raise InvalidArgumentError(
                    f"CUDA cannot export that memory ({cu.error_name(result)}): CUDA IPC exports plain "
                    "device allocations, not expandable segments; let this transport allocate the slot"
                )
            reg.key, offset = bytes(raw).hex(), reg.pointer - base  # all 64 bytes, NULs too
            mappings.own_exports[reg.key] = base
        reg.export = OwnerFile(region.nbytes)
        return self._descriptor(reg, "device", reg.key, offset, region.nbytes)

    @staticmethod
    def _descriptor(reg: _Registration, memory: str, handle: str, offset: int, nbytes: int) -> bytes:
        assert reg.export is not None
        return json.dumps(
            {
                "cuda_ipc": 1,
                "memory": memory,
                "handle": handle,
                "offset": offset,
                "nbytes": nbytes,
                "device": reg.device,
                "pid": os.getpid(),
                "boot": boot_id(),
                "file": reg.export.path,
            }
        ).encode()

    def connect(self, descriptor: bytes) -> Remote:
        self._check_open()
        try:
            d = json.loads(descriptor)
            handle, offset, nbytes = bytes.fromhex(d["handle"]), int(d["offset"]), int(d["nbytes"])
            pid, boot, path, host = int(d["pid"]), str(d["boot"]), str(d["file"]), d["memory"] == "host"
            if (
                d["cuda_ipc"] != 1
                or d["memory"] not in ("host", "device")
                or len(handle) not in ((0,) if host else (0, 64))
                or not os.path.basename(path).startswith(FILE_PREFIX)
                or offset % mmap.ALLOCATIONGRANULARITY * host
            ):
                raise ValueError("unknown fields")
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise InvalidArgumentError(f"not a cuda_ipc descriptor ({exc}): {bytes(descriptor[:80])!r}") from exc
        if boot != boot_id():
            raise InvalidArgumentError("that region was exported on another host: CUDA IPC reads within one host")
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise RegionNotRegisteredError(
                "that region is no longer exported (deregistered, or its owner closed its transport)"
            ) from None
        _, exported = RECORD.unpack(os.pread(fd, RECORD.size, 0))
        imp = Import(handle, offset, exported, pid, fd, path, host)
        self._imports.add(imp)
        return Remote(nbytes, descriptor, handle=imp)

    def prepare(self, remote: Remote, device: str = "cpu") -> None:
        """Map `remote` for reads into `device` memory now: a host slot is page-locked
        (seconds for gigabytes), a GPU slot's IPC handle opened on that GPU."""
        self._check_open()
        imp = _connected(remote)
        index = self.device if device == "cpu" else _device_index(device)
        imp.check_owner(f"mapping a region of process {imp.owner_pid}")
        if imp.needs_host_map:
            mappings.map_host(imp, index)
        mappings.map_device(imp, index)

    def view(self, remote: Remote, device: str = "cpu") -> Region | None:
        """A GPU slot, opened on `device` (a CUDA device: the slot's own GPU, or a peer it
        reaches over NVLink), as a uint8 CUDA tensor; a host slot, for "cpu", as a
        read-only view of its mapping. None for the other pairings: those cross PCIe,
        which a copy into a mirror crosses once and a read in place on every use."""
        self._check_open()
        imp = _connected(remote)
        if imp.host != (device == "cpu"):
            return None
        imp.check_owner(f"viewing a region of process {imp.owner_pid}")
        check_span("exported", 0, remote.nbytes, imp.exported)
        where = "cpu" if imp.host else f"cuda:{_device_index(device)}"
        region = imp.views.get(where)  # made once: callers key their typed views by it
        if region is None:
            region = imp.views[where] = self._view(imp, remote.nbytes, where)
        return region

    def _view(self, imp: Import, nbytes: int, where: str) -> Region:
        if imp.host:
            if imp.needs_host_map:
                mappings.map_host(imp, self.device)
            address = mappings.map_device(imp, self.device)
            raw = (ctypes.c_char * nbytes).from_address(address) if nbytes else bytearray()
            return Region(nbytes, "cpu", memory=imp, view=memoryview(raw).cast("B").toreadonly())
        torch = _torch()
        if not nbytes:
            return Region(0, where, torch.empty(0, dtype=torch.uint8, device=where))
        pointer = mappings.map_device(imp, torch.device(where).index) + imp.offset
        return Region(nbytes, where, torch.as_tensor(_Mapped(pointer, nbytes), device=where))

    def disconnect(self, remote: Remote) -> None:
        if isinstance(remote.handle, Import):
            self._drop(remote.handle)

    def _drop(self, imp: Import) -> None:
        if not imp.connected:
            return
        imp.connected = False
        mappings.unmap(imp)
        os.close(imp.fd)
        self._imports.discard(imp)

    # -- reading -------------------------------------------------------------------------

    async def read(self, remote: Remote, remote_offset: int, local: Region, local_offset: int, nbytes: int) -> None:
        await self.read_many([(remote, remote_offset, local, local_offset, nbytes)])

    async def read_many(self, reads: Sequence[tuple[Remote, int, Region, int, int]]) -> None:
        """Check each read and queue its copy (reads adjacent on both sides merge into one),
        then wait once per stream, for its last copy: copies on a stream land in order."""
        self._check_open()
        checked: set[Import] = set()  # owners asked once per call
        for imp in {r[0].handle for r in reads if r[4] and isinstance(r[0].handle, Import)}:
            if imp.needs_host_map:
                imp.check_owner(f"reading a region of process {imp.owner_pid}")  # before pinning gigabytes
                checked.add(imp)
                await anyio.to_thread.run_sync(mappings.map_host, imp, self.device)
        gathering: dict[Lane, list[Any]] = {}  # per lane: [dst, src, nbytes, remote, local] of the next copy
        last: dict[Lane, Wait] = {}  # per lane, its last copy queued
        try:
            for remote, remote_offset, local, local_offset, nbytes in reads:
                lane, dst, src = self._route(remote, remote_offset, local, local_offset, nbytes, checked)
                if not nbytes:
                    continue
                g = gathering.get(lane)
                if (
                    g
                    and g[3] is remote.handle
                    and g[4] is local
                    and g[0] + g[2] == dst
                    and g[1] + g[2] == src
                    and g[2] + nbytes <= _MERGE_UP_TO
                ):  # adjacent on both sides: one copy
                    g[2] += nbytes
                    continue
                if g:
                    last[lane] = lane.copy(*g[:3])
                gathering[lane] = [dst, src, nbytes, remote.handle, local]
            for lane, g in gathering.items():
                last[lane] = lane.copy(*g[:3])
        except BaseException:
            for lane in last:
                lane.drain()
            raise
        for lane, wait in last.items():
            await lane.fence(wait)
        for lane, wait in last.items():
            if wait.result:
                owners = sorted({r[0].handle.owner_pid for r in reads})
                raise TransportError(
                    f"reading {len(reads)} span(s) of regions of process(es) {owners} "
                    f"on cuda:{lane.device}: {cuda().error_name(wait.result)}"
                )

    async def read_2d_many(self, reads: Sequence[Read2D]) -> None:
        """Each 2-D read as one cuMemcpy2DAsync on its lane (rows closer than their width
        go one copy per row); then wait once per lane, as `read_many` does."""
        self._check_open()
        for read in reads:
            check_2d(read)
        checked: set[Import] = set()
        for imp in {r[0].handle for r in reads if r[6] and r[7] and isinstance(r[0].handle, Import)}:
            if imp.needs_host_map:
                imp.check_owner(f"reading a region of process {imp.owner_pid}")
                checked.add(imp)
                await anyio.to_thread.run_sync(mappings.map_host, imp, self.device)
        last: dict[Lane, Wait] = {}
        try:
            for remote, r_off, r_pitch, local, l_off, l_pitch, width, height in reads:
                if not width or not height:
                    continue
                r_span, l_span = span_2d(r_off, r_pitch, width, height), span_2d(l_off, l_pitch, width, height)
                check_span("remote", *r_span, remote.nbytes)
                check_span("local", *l_span, local.nbytes)
                lane, dst, src = self._route(remote, r_off, local, l_off, width, checked)
                check_span("exported", *r_span, remote.handle.exported)
                if r_pitch >= width and height > 1:
                    last[lane] = lane.copy_2d(dst, l_pitch, src, r_pitch, width, height)
                else:
                    for i in range(height):
                        last[lane] = lane.copy(dst + i * l_pitch, src + i * r_pitch, width)
        except BaseException:
            for lane in last:
                lane.drain()
            raise
        for lane, wait in last.items():
            await lane.fence(wait)
        for lane, wait in last.items():
            if wait.result:
                owners = sorted({r[0].handle.owner_pid for r in reads})
                raise TransportError(
                    f"reading {len(reads)} 2-D span(s) of regions of process(es) {owners} "
                    f"on cuda:{lane.device}: {cuda().error_name(wait.result)}"
                )

    def _route(
        self, remote: Remote, remote_offset: int, local: Region, local_offset: int, nbytes: int, checked: set[Import]
    ) -> tuple[Lane, int, int]:
        """Check one read; return (the lane that copies it, destination, source)."""
        imp = _connected(remote)
        reg = self._mine(local, "read into")
        check_span("remote", remote_offset, nbytes, remote.nbytes)
        check_span("local", local_offset, nbytes, local.nbytes)
        if imp not in checked:
            imp.check_owner(f"reading a region of process {imp.owner_pid}")
            checked.add(imp)
        check_span("exported", remote_offset, nbytes, imp.exported)  # the owner's record, not the descriptor's
        device = self.device if reg.device is None else reg.device
        lane = self._lanes.get(device)
        if lane is None:
            lane = self._lanes[device] = Lane(device)
        base = (
            mappings.map_device(imp, device) + (0 if imp.host else imp.offset) if nbytes else 0
        )  # a host map starts at its offset
        source = base + remote_offset if nbytes else 0
        return lane, reg.pointer + local_offset, source

    # -- lifetime ------------------------------------------------------------------------

    async def aclose(self) -> None:
        if self._closed:
            return
        for imp in list(self._imports):
            self._drop(imp)
        for region in list(self._regions.values()):
            if region.handle.export is not None:
                region.handle.export.release(CLOSED)
            self.deregister(region)
        for lane in self._lanes.values():
            lane.close()
        self._lanes.clear()
        self._closed = True
