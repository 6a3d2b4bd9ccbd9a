"""The latency path of a small all_reduce across machines of one rank each: a plan made once.

A loop that all-reduces a few small variables (a step counter, a loss, a
flat gradient of a small model) pays, on the general path
(``MpiBackend.all_reduce``), more in Python than the message between
machines costs.  Here a leader whose machine has no other rank keeps, per
(variables, op), a plan: the arrays packed into kept buffers by (op, dtype),
``avg``'s mass slot, and flat views of the variables' own arrays.  A call
copies the arrays in, runs one in-place ``Iallreduce`` per buffer, and writes
the results back into the variables' arrays.

It makes exactly the MPI calls ``mpi_reduce.reduce_across`` makes for the
same arrays (the same buffers' lengths and dtypes, in the same order, the
mass slot where it puts it) and computes the same bytes (``avg`` divided by
the summed mass the same way), so a machine on this path and one on the
general path (several ranks, or a plan that declined) meet in the same
collectives.
"""

import numpy as np

from . import reduce_ops
from .mpi_leaders import PACK_BYTES


class SmallPlan:
    """How one (arrays, op) is all-reduced in place; ``ok`` is False where the path never applies.

    Args:
        leaders: the leaders' collectives (``mpi_leaders.Leaders``).
        arrays: the variables' own host arrays (the results are written into them).
        op: the reduce op, one name for every array.
    """

    __slots__ = ("ok", "checked", "epoch", "sends", "members", "mass_at", "op")

    def __init__(self, leaders, arrays, op):
        self.checked = list(arrays)
        self.epoch = leaders.epoch
        self.op = op
        self.sends = []     # per buffer: (kept typed buffer, op)
        self.members = []   # per array: (flat view of it, buffer index, offset, size)
        self.mass_at = None
        self.ok = _takes(leaders, arrays, op)
        if not self.ok:
            return
        groups = {}  # dtype.str -> indices, in order of first appearance (as reduce_across)
        for i, a in enumerate(arrays):
            groups.setdefault(a.dtype.str, []).append(i)
        for j, (dstr, idx) in enumerate(groups.items()):
            dtype = np.dtype(dstr)
            count = sum(arrays[i].size for i in idx) + (op == "avg")
            buf = np.empty(count, dtype)
            at = 0
            for i in idx:
                a = arrays[i]
                self.members.append((a.reshape(-1), j, at, a.size))
                at += a.size
            if op == "avg" and self.mass_at is None:
                self.mass_at = (j, at)
            elif op == "avg":
                buf[at] = 0  # the masses travel once
            self.sends.append((buf, op))

    def fits(self, leaders, arrays):
        """Whether this plan still serves ``arrays`` (the same objects, the same communicator)."""
        checked = self.checked
        if len(arrays) != len(checked) or self.epoch != leaders.epoch:
            return False
        for a, b in zip(arrays, checked):
            if a is not b:
                return False
        return True

    def run(self, leaders, check):
        """All-reduce the arrays in place (every leader at once)."""
        sends = self.sends
        for flat, j, at, k in self.members:
            sends[j][0][at:at + k] = flat
        mass_at = self.mass_at
        if mass_at is not None:
            sends[mass_at[0]][0][mass_at[1]] = 1.0  # one rank here, of weight 1
        leaders.all_reduce_kept(sends, check)
        if mass_at is None:
            for flat, j, at, k in self.members:
                flat[...] = sends[j][0][at:at + k]
            return
        scale = 1.0 / float(sends[mass_at[0]][0][mass_at[1]])
        for flat, j, at, k in self.members:
            np.multiply(sends[j][0][at:at + k], scale, out=flat)


def _takes(leaders, arrays, op):
    """Whether every array is a plain host array the path can reduce and write in place."""
    if not isinstance(op, str) or op not in reduce_ops.COLLECTIVE_OPS or not arrays:
        return False
    for a in arrays:
        if (type(a) is not np.ndarray or not a.flags.c_contiguous or not a.flags.writeable
                or a.nbytes >= PACK_BYTES or reduce_ops.result_dtype(op, a.dtype) != a.dtype
                or not leaders.reduces(op, a.dtype)):
            return False
    return True
