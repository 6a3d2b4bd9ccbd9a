"""SharedArray: a POSIX shared-memory segment, mmap-ed and viewed as NumPy."""

import logging
import mmap
import os

import numpy as np
import posix_ipc

from .liveness import pid_alive

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
PREFIX = "synk"


def segment_prefix(master_pid):
    """Return the name prefix of every segment a run with this master creates."""
    return f"/{PREFIX}_{master_pid}_"


class SharedArray:
    """A named shared-memory segment of ``nbytes`` bytes, mapped in this process.

    The creator owns the name and unlinks it; other processes ``attach`` by name.
    Processes forked after creation inherit the mapping and need not attach.
    """

    def __init__(self, name, nbytes, create=True):
        self.name = name
        self.nbytes = int(nbytes)
        # mmap refuses length 0; a page is the smallest real allocation anyway.
        size = max(self.nbytes, 1)
        flags = posix_ipc.O_CREX if create else 0
        shm = posix_ipc.SharedMemory(name, flags, size=size if create else 0)
        try:
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


def sweep(master_pid):
    """Unlink every segment whose name carries ``master_pid``; return their names."""
    head = segment_prefix(master_pid)[1:]
    removed = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return removed
    for fname in names:
        if fname.startswith(head):
            try:
                posix_ipc.unlink_shared_memory("/" + fname)
                removed.append(fname)
            except posix_ipc.Error:
                pass
    return removed


def sweep_stale():
    """Unlink segments left by runs whose master process no longer exists."""
    removed = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return removed
    pids = set()
    for fname in names:
        parts = fname.split("_")
        if len(parts) >= 3 and parts[0] == PREFIX and parts[1].isdigit():
            pids.add(int(parts[1]))
    for pid in pids:
        if not pid_alive(pid):
            removed += sweep(pid)
    if removed:
        logger.info("removed %d stale shared-memory segments", len(removed))
    return removed
