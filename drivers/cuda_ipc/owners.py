"""An exported region's liveness file, and the sweep of dead owners' files.

CUDA keeps a handle mapped in a reader whatever its owner does, so each exported region
has a small file (in /dev/shm; a host slot's bytes follow in the same file) on which the
owner holds an exclusive lock while the region is exported, with a byte saying why it let
go. The kernel drops a dead process's locks, so a reader can tell deregistered, closed
and died apart.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import struct
import tempfile
import uuid
from typing import Any

from weightpull.errors import TransportError

FILE_PREFIX = "weightpull-cuda-ipc-"
RECORD = struct.Struct("<c7xQ")  # state, exported bytes
EXPORTED, DEREGISTERED, CLOSED = b"A", b"D", b"C"
DATA_OFFSET = mmap.ALLOCATIONGRANULARITY  # where a host slot's bytes start in its file


def boot_id() -> str:
    with open("/proc/sys/kernel/random/boot_id") as f:
        return f.read().strip()


def files_dir() -> str:
    return "/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


class OwnerFile:
    """The owner's side of an exported region's liveness file: locked while exported. With
    `data`, the file also holds the region's bytes (a host slot), mapped at `self.data`."""

    def __init__(self, nbytes: int, data: bool = False) -> None:
        self.path = os.path.join(files_dir(), f"{FILE_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}")
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        os.pwrite(self.fd, RECORD.pack(EXPORTED, nbytes), 0)
        self.data: Any = None
        if data:
            try:  # reserve it all now: a full /dev/shm fails here, not as SIGBUS mid-copy
                os.posix_fallocate(self.fd, 0, DATA_OFFSET + nbytes)
            except OSError as exc:
                self.release(CLOSED)
                raise TransportError(
                    f"cannot reserve {nbytes} bytes of shared memory in {files_dir()}: {os.strerror(exc.errno or 0)}"
                ) from None
            self.data = mmap.mmap(self.fd, nbytes, offset=DATA_OFFSET) if nbytes else bytearray()

    def release(self, state: bytes) -> None:
        """Say why, then let go: readers see it at their next read."""
        if self.fd < 0:
            return
        os.pwrite(self.fd, state, 0)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        os.close(self.fd)  # drops the lock
        self.fd = -1


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def sweep_dead_owners(directory: str | None = None) -> list[str]:
    """Remove the files of owners that died without closing (SIGKILL, say): a host slot's
    holds gigabytes of shared memory. A file goes when its owner's process is gone and no
    one holds its lock; a reader that still has it open reads `PeerGoneError`.

    Args:
        directory: Where the files are (default: the host's, in /dev/shm).

    Returns:
        The names of the files removed.
    """
    directory = directory or files_dir()
    removed = []
    for name in os.listdir(directory):
        pid = name.removeprefix(FILE_PREFIX).split("-")[0]
        if not name.startswith(FILE_PREFIX) or not pid.isdigit() or _alive(int(pid)):
            continue
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.unlink(path)
            removed.append(path)
        except OSError:  # locked after all (another pid namespace), or already gone
            pass
        finally:
            os.close(fd)
    return removed
