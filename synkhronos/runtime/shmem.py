"""SharedArray: a POSIX shared-memory segment, mmap-ed and viewed as NumPy; run prefixes and sweeps.

Every segment of a run is named ``/synk_<master pid>_<run id>_...``, the run
id random, so names cannot be guessed or collide across PID namespaces that
share /dev/shm.  A run holds an flock on its ``..._lock`` segment for as long
as any of its processes lives (forked children share the lock), so a sweep
removes exactly the runs whose lock it can take: dead ones, whatever their
namespace.
"""

import errno
import fcntl
import logging
import mmap
import os
import secrets

import numpy as np
import posix_ipc

from ..errors import SharedMemoryError
from . import janitor_proc

logger = logging.getLogger(__name__)

SHM_DIR = janitor_proc.SHM_DIR
PREFIX = "synk"
LOCK = janitor_proc.LOCK


def run_prefix(master_pid):
    """Return a fresh name prefix for the segments of one run: ``/synk_<pid>_<run id>_``."""
    return f"/{PREFIX}_{master_pid}_{secrets.token_hex(6)}_"


def shm_space():
    """Return (free, total) bytes of /dev/shm, or (None, None) where it cannot be read."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return None, None
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def read_only():
    """Whether /dev/shm is mounted read-only (False where that cannot be read)."""
    try:
        return bool(os.statvfs(SHM_DIR).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def shm_read_only_text(where):
    """The message for a read-only /dev/shm, where its free space would mislead."""
    return (f"{where}: {SHM_DIR} is mounted read-only, so no shared memory can be made "
            f"there; remount it read-write (mount -o remount,rw {SHM_DIR}), or in a "
            "container drop the read-only mount of /dev/shm")


def _size_text(n):
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{n} B"


def _full_error(name, nbytes):
    if read_only():
        return SharedMemoryError(errno.EROFS, shm_read_only_text(f"segment {name}"))
    free, total = shm_space()
    where = ("" if free is None else
             f"; {SHM_DIR} has {_size_text(free)} free of {_size_text(total)}")
    return SharedMemoryError(
        errno.ENOSPC,
        f"cannot allocate {_size_text(nbytes)} of shared memory for segment {name}{where}. "
        f"Enlarge {SHM_DIR} (docker run --shm-size=8g ..., or "
        f"mount -o remount,size=8G {SHM_DIR}) or free what other programs keep there")


class SharedArray:
    """A named shared-memory segment of ``nbytes`` bytes, mapped in this process.

    The creator owns the name and unlinks it; other processes ``attach`` by name.
    Processes forked after creation inherit the mapping and need not attach.
    A new segment's pages are reserved at once, so a full /dev/shm raises
    SharedMemoryError here rather than SIGBUS at the first write.

    Raises:
        SharedMemoryError: /dev/shm has too little space, or the segment
            cannot be created (a name taken, no permission).
    """

    def __init__(self, name, nbytes, create=True):
        self.name = name
        self.nbytes = int(nbytes)
        # mmap refuses length 0; a page is the smallest real allocation anyway.
        size = max(self.nbytes, 1)
        if create:
            free, _ = shm_space()
            if free is not None and size > free:
                raise _full_error(name, size)  # at once, even for terabytes
        try:
            shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX if create else 0,
                                         mode=0o600, size=size if create else 0)
        except (posix_ipc.Error, OSError, ValueError) as exc:
            if create and read_only():
                raise _full_error(name, size) from exc
            action = "create" if create else "open"
            raise SharedMemoryError(
                errno.EEXIST if isinstance(exc, posix_ipc.ExistentialError) else errno.EIO,
                f"cannot {action} shared-memory segment {name}: {exc}") from exc
        try:
            if create:
                try:
                    os.posix_fallocate(shm.fd, 0, size)
                except OSError as exc:
                    if exc.errno not in (errno.ENOSPC, errno.ENOMEM):
                        raise
                    shm.unlink()
                    raise _full_error(name, size) from None
            self._mmap = mmap.mmap(shm.fd, size)
        finally:
            shm.close_fd()
        self.owner = create
        self._views = {}  # (dtype str, shape) -> view, for views asked for again and again

    @classmethod
    def attach(cls, name, nbytes):
        """Map an existing segment created by another process."""
        return cls(name, nbytes, create=False)

    def view(self, dtype=np.uint8, shape=None, offset=0):
        """Return a NumPy view of the segment (no copy)."""
        dtype = np.dtype(dtype)
        if shape is None:
            shape = ((self.nbytes - offset) // dtype.itemsize,)
        # frombuffer holds a buffer export, so close() cannot unmap memory a
        # view still uses (np.ndarray(buffer=...) does not, and would segfault).
        count = 1
        for s in shape:
            count *= int(s)
        return np.frombuffer(self._mmap, dtype, count, offset).reshape(shape)

    def cached_view(self, dtype, shape):
        """Return a view of the segment's start as ``shape`` of ``dtype``, made once per pair.

        Calls repeat the same shapes, and making a view costs about 1 us.
        """
        key = (dtype, shape)
        v = self._views.get(key)
        if v is None:
            if len(self._views) > 64:
                self._views.clear()
            v = self._views[key] = self.view(dtype, shape)
        return v

    @property
    def buffer(self):
        return self._mmap

    def close(self):
        """Unmap; views made earlier must no longer be used."""
        self._views = {}
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                # A NumPy view still exports the buffer; the mapping goes with it.
                pass
            self._mmap = None

    def unlink(self):
        """Remove the name; the memory is freed once every process unmaps it."""
        try:
            posix_ipc.unlink_shared_memory(self.name)
        except posix_ipc.ExistentialError:
            pass

    def __repr__(self):
        return f"SharedArray({self.name!r}, {self.nbytes} bytes)"


def hold_run_lock(prefix):
    """Create and lock the run's lock segment; return its descriptor (inherited by fork).

    Raises:
        SharedMemoryError: the lock cannot be created.
    """
    path = os.path.join(SHM_DIR, prefix[1:] + LOCK)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno == errno.EROFS:
            raise SharedMemoryError(exc.errno, shm_read_only_text("fork")) from exc
        raise SharedMemoryError(exc.errno, f"cannot create the run's lock {path}: {exc}") \
            from exc
    return fd


def sweep(prefix):
    """Unlink every segment whose name starts with ``prefix`` (a run's); return their names."""
    return janitor_proc.sweep(prefix, SHM_DIR)


def dead_runs(shm_dir=SHM_DIR):
    """Return the prefixes of runs whose lock no process holds: no process of theirs lives."""
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return []
    dead = []
    for fname in names:
        parts = fname.split("_")
        if len(parts) != 4 or parts[0] != PREFIX or parts[3] != LOCK:
            continue
        try:
            fd = os.open(os.path.join(shm_dir, fname), os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # held: the run is alive, in this namespace or another
        finally:
            os.close(fd)
        dead.append("/" + fname[:-len(LOCK)])
    return dead


def sweep_stale():
    """Unlink the segments of runs that are provably dead (their lock is free)."""
    removed = []
    for prefix in dead_runs():
        removed += sweep(prefix)
    if removed:
        logger.info("removed %d stale shared-memory segments", len(removed))
    return removed
