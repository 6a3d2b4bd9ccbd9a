"""Homes: persistent shared-memory buffers, one per (rank, key), that callers keep as storage.

A large array that lives in its rank's home can be read by the other ranks
in place, so collectives on it skip copying it into a slab.  The shm backend
returns large all_reduce and broadcast results in homes keyed by the
caller's keys (shared-variable indices); a variable that keeps its home as
its value costs no copy-in the next time.  A home only changes in calls that
name its key; a home that must grow is replaced under a new generation, and
the old memory stays mapped while arrays still view it.
"""

import numpy as np

from ..runtime.shmem import SharedArray

PAGE = 1 << 12
GEN_BITS = 24  # a home travels in slab headers as key << GEN_BITS | generation


def _size(nbytes):
    return max((nbytes + PAGE - 1) // PAGE * PAGE, PAGE)


def _view(entry, shape, dtype):
    views = entry[3]
    key = (shape, dtype)
    v = views.get(key)
    if v is None:
        count = 1
        for d in shape:
            count *= d
        # frombuffer holds a buffer export, so the mapping outlives close()
        # while a variable still uses the view.
        v = views[key] = np.frombuffer(entry[1].buffer, dtype, count).reshape(shape)
    return v


class Homes:
    """This process's homes and its attachments to the other ranks' homes."""

    def __init__(self, prefix, populate):
        self.prefix = prefix + "home"
        self.populate = populate
        self.own = {}    # key -> [gen, SharedArray, nbytes mapped, views]
        self.peers = {}  # (rank, key) -> [gen, SharedArray, nbytes mapped, views]

    def _name(self, rank, key, gen):
        return f"{self.prefix}{rank}_{key}_{gen}"

    def get(self, rank, key, shape, dtype):
        """Return (ref, view): this rank's home for ``key`` as an array of ``shape``."""
        nbytes = int(np.prod(shape)) * dtype.itemsize
        e = self.own.get(key)
        if e is None or e[2] < nbytes:
            gen = 0 if e is None else e[0] + 1
            if gen >= 1 << GEN_BITS:
                raise RuntimeError(f"home {key} was regrown {gen} times")
            seg = SharedArray(self._name(rank, key, gen), _size(nbytes))
            self.populate(seg)
            if e is not None:
                e[1].unlink()
                e[1].close()
            e = self.own[key] = [gen, seg, seg.nbytes, {}]
        return (key << GEN_BITS) | e[0], _view(e, shape, dtype)

    def holds(self, key, a):
        """Whether ``a`` is exactly this rank's home for ``key`` (same memory and shape)."""
        e = self.own.get(key)
        if e is None:
            return False
        v = e[3].get((a.shape, a.dtype))
        return v is not None and (a is v or (a.flags.c_contiguous and a.ctypes.data == v.ctypes.data))

    def peer(self, rank, ref, shape, dtype):
        """Return a view of another rank's home named by ``ref`` (from its slab header)."""
        key, gen = ref >> GEN_BITS, ref & ((1 << GEN_BITS) - 1)
        nbytes = int(np.prod(shape)) * dtype.itemsize
        e = self.peers.get((rank, key))
        if e is None or e[0] != gen or e[2] < nbytes:
            if e is not None:
                e[1].close()
            seg = SharedArray.attach(self._name(rank, key, gen), _size(nbytes))
            e = self.peers[(rank, key)] = [gen, seg, seg.nbytes, {}]
        return _view(e, shape, dtype)

    def close(self):
        for e in self.own.values():
            e[1].unlink()
            e[1].close()
        for e in self.peers.values():
            e[1].close()
        self.own.clear()
        self.peers.clear()
