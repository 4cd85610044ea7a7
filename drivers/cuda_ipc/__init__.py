"""The `cuda_ipc` driver: the same-host fast path, over CUDA's driver API (ctypes).

A GPU slot is a plain device allocation (`cuMemAlloc`; CUDA IPC cannot export the caching
allocator's expandable segments), exported once as a CUDA IPC handle. A reader process
opens each handle once, per GPU it reads into, and reads with device copies on a stream
of its own; a batch of reads awaits the event recorded after its last copy, so all bytes
have landed before the puller checks its lease. A reader on another GPU of the host maps
the handle with peer access and copies peer-to-peer.

A host slot is shared memory (a file in /dev/shm), page-locked by its owner and, read-only,
by each reader process, which maps it once: a reader's GPU then pulls it by DMA at the
host-to-device limit, with no copy through the CPU. Host regions that are not exported
(a reader's host mirror) are page-locked on registration.

CUDA keeps a handle mapped in a reader whatever its owner does, so the owner's liveness
travels beside it: a small file per exported region (in /dev/shm; a host slot's bytes
follow in the same file) on which the owner holds an exclusive lock while the region is
exported, with a byte saying why it let go. A read checks it first: deregistered ->
`RegionNotRegisteredError`; closed or died -> `PeerGoneError`. Files of owners that died
without closing are removed by the next transport made on the host.
"""

from .driver_api import cuda
from .owners import sweep_dead_owners
from .transport import CudaIpcTransport

__all__ = ["CudaIpcTransport", "cuda", "sweep_dead_owners"]
