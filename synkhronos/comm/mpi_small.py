"""The latency path of a small all_reduce across machines of one rank each: a plan made once.

A loop that all-reduces a few small variables (a step counter, a loss, a
flat gradient of a small model) pays, on the general path
(``MpiBackend.all_reduce``), more in Python than the message between
machines costs.  Here a leader whose machine has no other rank keeps, per
(variables, op), a plan: the arrays packed into kept buffers by dtype,
``avg``'s mass slot, and flat views of the variables' own arrays.  A call
copies the arrays in, runs one in-place ``Iallreduce`` per buffer, and writes
the results back into the variables' arrays.

It makes exactly the MPI calls ``mpi_reduce.reduce_across`` makes for the
same arrays (the same buffers' lengths and dtypes, in the same order, the
mass slot where it puts it) and computes the same bytes (``avg`` divided by
the summed mass the same way), so a machine on this path and one on the
general path (a plan that declined for its own arrays' flags) meet in the
same collectives.

Where every machine has one rank, the first message also carries a
``Ballot``: each leader votes whether its share of the command ends with this
collective (yes on this path, which writes nothing that can fail after it; no
on the general path).  A unanimous vote means every node master's report of
success is implied by the collective having completed, so none is sent and
the controller waits for none (cluster/controller.py, cluster/node.py): a small
all_reduce then costs the command's message and MPI's own collective.  Which
arrays get a ballot is decided from what every leader knows alike (dtypes,
sizes, op, the layout), never from one process's arrays.
"""

import numpy as np

from . import reduce_ops
from .leaders import PACK_BYTES

MAX_VOTERS = 127   # a vote is summed in the arrays' dtype: int8 counts this many exactly
# Per op, the vote for yes and for no, chosen so that the reduced vote is ``unanimous``
# exactly when every leader voted yes.
VOTES = {"sum": (1, 0), "avg": (1, 0), "prod": (1, 0), "min": (1, 0), "max": (0, 1)}


class Ballot:
    """One vote per leader in a small all-reduce: does every leader's share of the command end here?

    Args:
        op: the reduce op of the message it rides in.
        voters: the leaders (machines).
        yes: this leader's vote.
    """

    __slots__ = ("vote", "unanimous", "passed")

    def __init__(self, op, voters, yes):
        yes_vote, no_vote = VOTES[op]
        self.vote = yes_vote if yes else no_vote
        self.unanimous = voters * yes_vote if op in ("sum", "avg") else yes_vote
        self.passed = False

    def count(self, reduced):
        """Read the reduced vote."""
        self.passed = reduced == self.unanimous


def voters(n_local):
    """How many leaders vote in a small all-reduce of a layout with ``n_local`` ranks per machine.

    Every machine must have one rank (a leader with others shares its
    machine's result after the collective, which can fail), and a vote must
    count exactly in any dtype; 0: no ballot.
    """
    n = len(n_local)
    if 1 < n <= MAX_VOTERS and all(k == 1 for k in n_local):
        return n
    return 0


def eligible(leaders, arrays, op):
    """Whether ``arrays`` under ``op`` take this path, judged by what every leader sees alike.

    Dtypes, sizes and the op are the same on every machine (shared variables
    are replicas), so every leader gives the same answer; whether its own
    arrays can be written in place is ``SmallPlan``'s second test.
    """
    if not isinstance(op, str) or op not in reduce_ops.COLLECTIVE_OPS or not arrays:
        return False
    for a in arrays:
        if (type(a) is not np.ndarray or a.nbytes >= PACK_BYTES
                or reduce_ops.result_dtype(op, a.dtype) != a.dtype
                or not leaders.reduces(op, a.dtype)):
            return False
    return True


class SmallPlan:
    """How one (arrays, op) is all-reduced in place; ``ok`` is False where the path never applies.

    Args:
        leaders: the leaders' collectives (``leaders.Leaders``).
        arrays: the variables' own host arrays (the results are written into them).
        op: the reduce op, one name for every array.
        voters: the machines when a ballot rides along (``voters``), else 0.
    """

    __slots__ = ("ok", "checked", "epoch", "voters", "sends", "members", "mass_at", "ballot")

    def __init__(self, leaders, arrays, op, voters=0):
        self.checked = list(arrays)
        self.epoch = leaders.epoch
        self.voters = voters
        self.sends = []     # per buffer: (kept typed buffer, op)
        self.members = []   # per array: (flat view of it, buffer index, offset, size)
        self.mass_at = None
        self.ballot = None
        self.ok = eligible(leaders, arrays, op) and all(
            a.flags.c_contiguous and a.flags.writeable for a in arrays)
        if not self.ok:
            return
        if voters:
            self.ballot = Ballot(op, voters, yes=True)
        groups = {}  # dtype.str -> indices, in order of first appearance (as reduce_across)
        for i, a in enumerate(arrays):
            groups.setdefault(a.dtype.str, []).append(i)
        for j, (dstr, idx) in enumerate(groups.items()):
            dtype = np.dtype(dstr)
            voted = self.ballot is not None and j == 0
            count = sum(arrays[i].size for i in idx) + (op == "avg") + voted
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

    def fits(self, leaders, arrays, voters):
        """Whether this plan still serves ``arrays`` (the same objects, communicator and layout)."""
        checked = self.checked
        if len(arrays) != len(checked) or self.epoch != leaders.epoch or self.voters != voters:
            return False
        for a, b in zip(arrays, checked):
            if a is not b:
                return False
        return True

    def run(self, leaders, check):
        """All-reduce the arrays in place (every leader at once); return whether the ballot passed."""
        sends = self.sends
        for flat, j, at, k in self.members:
            sends[j][0][at:at + k] = flat
        mass_at = self.mass_at
        if mass_at is not None:
            sends[mass_at[0]][0][mass_at[1]] = 1.0  # one rank here, of weight 1
        ballot = self.ballot
        if ballot is not None:
            first = sends[0][0]
            first[-1] = ballot.vote
        leaders.all_reduce_kept(sends, check)
        passed = ballot is not None and first[-1] == ballot.unanimous
        if mass_at is None:
            for flat, j, at, k in self.members:
                flat[...] = sends[j][0][at:at + k]
            return passed
        scale = 1.0 / float(sends[mass_at[0]][0][mass_at[1]])
        for flat, j, at, k in self.members:
            np.multiply(sends[j][0][at:at + k], scale, out=flat)
        return passed
