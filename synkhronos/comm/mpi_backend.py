"""MPI backend: collectives over the ranks of several machines, in two levels.

Inside a machine the shared-memory backend moves the bytes among that
machine's ranks; between machines only the leaders (the controller and the
node masters) talk, through the MPI library's own non-blocking collectives
on a communicator of the leaders that a failed command replaces
(mpi_leaders.py), or, where machines come and go, through gloo
(gloo_leaders.py, the same interface).  A reduction is: the machine's contributions to its
leader, reduced there (a partial and its weight), partials all-reduced among
leaders (the same bytes on every leader, mpi_reduce.py), the result
broadcast inside each machine.  Workers never touch MPI: they only take part
in the shared-memory stages.
"""

import numpy as np

from . import reduce_ops
from ..errors import SynkError
from . import parts
from .base import Backend, as_arrays
from .leaders import PACK_BYTES
from .mpi_reduce import reduce_across
from .mpi_small import Ballot, SmallPlan, eligible
from .mpi_small import voters as ballot_voters
from .shm_backend import ShmBackend

SMALL_PLANS_MAX = 64


class MpiBackend(Backend):
    """Collectives across machines: shared memory inside, MPI among the leaders."""

    def __init__(self, wiring):
        super().__init__(wiring)
        self.machine = wiring.machine
        self.local = ShmBackend(wiring._replace(ranks=wiring.machine))
        self.link = None     # the leader's cluster.mpi_link.MpiLink, after MPI starts
        self.remote = None   # the controller's: the other machines' contributions to a call
        self.mine = None     # a node master's own contribution to a call's outputs
        self.kept = {}       # key -> (leaders' epoch, two buffers MPI reduces into in turn)
        self.small_plans = {}  # (keys, op) -> mpi_small.SmallPlan
        self.implied = False   # the current command ended in a small all-reduce whose ballot passed
        self.voting = (None, 0)  # (layout, its machines if each has one rank, else 0)

    @property
    def is_leader(self):
        machine = self.machine
        return machine.rank == machine.master_rank

    @property
    def rank_offset(self):
        """The global rank of this machine's first rank (known once MPI has started)."""
        return self.ranks.rank - self.machine.rank

    def attach(self, link, remote_contributions):
        """In the leader: collectives between machines go through ``link``.

        ``remote_contributions()`` (the controller's) returns {global rank:
        (arrays, weight)} that the other machines' ranks contributed to a call.
        """
        self.link = link
        self.remote = remote_contributions

    def bind_check(self, check):
        self.check = check
        self.local.bind_check(check)

    def begin(self, seq):
        self.seq = seq
        self.local.begin(seq)
        self.mine = None
        self.implied = False

    def reports_implied(self):
        """Whether the command ending now ended with a small all-reduce whose ballot passed.

        Then every leader's share of it ended with that collective
        (mpi_small.py): node masters send no report of success, and the
        controller waits for none.  Asked once per command, by the leader
        about to report or wait for reports: the answer is cleared, so a
        command that runs nothing here (a node step that was all of it)
        never inherits the last one's.
        """
        implied, self.implied = self.implied, False
        return implied

    def _voters(self):
        """The leaders voting in a small all-reduce's ballot (``mpi_small.voters``), or 0."""
        layout = self.link.layout
        seen, voters = self.voting
        if seen is not layout:
            voters = ballot_voters(layout.n_local)
            self.voting = (layout, voters)
        return voters

    def is_kept(self, key, array):
        entry = self.kept.get(key)
        return self.local.is_kept(key, array) or (
            entry is not None and any(array is b for b in entry[1]))

    @property
    def _multi(self):
        return self.machine.n_parallel > 1

    # -- the machine-level steps ------------------------------------------------------
    def _to_leader(self, arrays):
        """Every local rank's arrays (or None), at the leader; None elsewhere."""
        if not self._multi:
            return [None if arrays is None else list(arrays)]
        return self.local.gather(arrays, self.machine.master_rank)

    def _from_leader(self, arrays, out=None, keys=None):
        """The leader's arrays on every local rank (in ``out`` entries that fit)."""
        if self._multi:
            got = self.local.broadcast(arrays if self.is_leader else None, self.machine.master_rank,
                                       out=out, keys=keys)
            if not self.is_leader:
                return got
        if out is None:
            return arrays
        return [_place(a, parts.out_entry(out, i)) for i, a in enumerate(arrays)]

    @property
    def _leaders(self):
        return self.link.leaders

    # -- collectives ------------------------------------------------------------------
    def barrier(self):
        self.implied = False
        self.local.barrier()
        if self.is_leader:
            self._leaders.barrier(self.check)
        self.local.barrier()

    def reduce(self, arrays, op, root, weight=None, out=None):
        result = self._reduce(arrays, op, weight, out)
        if self.rank != root:
            return None
        return result

    def all_reduce(self, arrays, op, weight=None, out=None, keys=None):
        into = None
        if keys is not None and not self._multi and arrays is not None:
            into = self._into(as_arrays(arrays), parts.op_list(op, len(arrays)), keys)
            # What lands in a kept buffer stays there: no copy into ``out``.
            out = [None if b is not None else parts.out_entry(out, i) for i, b in enumerate(into)]
        result = self._reduce(arrays, op, weight, out, into)
        # Every leader holds the same bytes (mpi_reduce.py), which its local ranks now read.
        return self._from_leader(result, out=out, keys=keys)

    def small_all_reduce(self, keys, arrays, op):
        """All-reduce small host arrays in place on a kept plan (mpi_small.py); False if it cannot.

        The latency path of ``all_reduce`` for the values of shared variables,
        in a leader whose machine has no other rank (every rank calls it with
        the same ``keys``, which name the arrays, and ``op``).  Declines before
        any message, and then the general path makes the same MPI calls.
        """
        if self._multi:
            return False
        leaders = self._leaders
        voters = self._voters()
        key = (tuple(keys), op)
        plan = self.small_plans.get(key)
        if plan is None or not plan.fits(leaders, arrays, voters):
            plan = SmallPlan(leaders, arrays, op, voters)
            if len(self.small_plans) >= SMALL_PLANS_MAX:
                self.small_plans.clear()
            self.small_plans[key] = plan
        if not plan.ok:
            return False
        self.implied = False
        if plan.run(leaders, self.check):
            self.implied = True
        return True

    def _into(self, arrays, ops, keys):
        """Per large array, the kept buffer (of two per key) MPI reduces into: not the input.

        The result is then the caller's to keep (``is_kept``), with no copy
        out of a communication buffer.  Buffers given to MPI before the
        leaders' communicator was renewed are never given again: an abandoned
        collective may still write them.
        """
        epoch = self._leaders.epoch
        into = []
        for a, o, k in zip(arrays, ops, keys):
            dtype = reduce_ops.result_dtype(o, a.dtype)
            if a.nbytes < PACK_BYTES or not self._leaders.reduces(o, dtype):
                into.append(None)
                continue
            entry = self.kept.get(k)
            if entry is None or entry[0] != epoch or entry[1][0].shape != a.shape \
                    or entry[1][0].dtype != dtype:
                entry = self.kept[k] = (epoch, [np.empty(a.shape, dtype), np.empty(a.shape, dtype)])
            into.append(entry[1][1] if np.may_share_memory(a, entry[1][0]) else entry[1][0])
        return into

    def _reduce(self, arrays, op, weight, out, into=None):
        """The reduced arrays at every leader (None elsewhere).

        The machine's ranks reduce to their leader first, through shared
        memory (each reducing its part of large arrays), then the leaders
        combine their machines' partials.
        """
        self.implied = False
        arrays = as_arrays(arrays)
        if self._multi:
            partials, mass = self.local.reduce_with_mass(arrays, op, self.machine.master_rank,
                                                         weight)
            if not self.is_leader:
                return None
        else:
            partials = arrays
            mass = None if arrays is None else (1.0 if weight is None else float(weight))
        if not partials:
            # The other leaders are inside the reduction by now: this error aborts the
            # command, and the leaders' communicator is renewed after it.
            raise SynkError(f"reduce across machines: no rank of "
                            f"{self.link.layout.describe(self.link.node)} gave arrays; every "
                            "machine must contribute")
        ballot = None
        voters = self._voters()
        if voters and eligible(self._leaders, partials, op):
            # The small path's message on another machine carries a ballot: so does this one.
            ballot = Ballot(op, voters, yes=False)
        return reduce_across(self._leaders, partials, parts.op_list(op, len(partials)), mass,
                             out, self.check, into, ballot)

    def broadcast(self, arrays, root, out=None, keys=None):
        self.implied = False
        machine, offset = self.machine, self.rank_offset
        here = offset <= root < offset + machine.n_parallel
        root_local = root - offset
        if here and root_local != machine.master_rank:
            # The root is a worker: every rank here, the leader too, reads it first.
            got = self.local.broadcast(arrays if self.rank == root else None, root_local,
                                       out=out, keys=keys)
            if self.is_leader:
                self._leaders.broadcast(got, self.link.node, self.check)
            return got
        if self.is_leader:
            got = self._leaders.broadcast(arrays if here else None,
                                          self.link.layout.machine_of(root), self.check)
            if not here and keys is not None:
                # Results the caller keeps must not be the leaders' buffers (reused).
                got = [_place(a, parts.out_entry(out, i), copy=True) for i, a in enumerate(got)]
            arrays = got
        if self.rank == root:
            if self._multi:
                self.local.broadcast(arrays, machine.master_rank)
            return list(arrays)
        return self._from_leader(arrays, out=out, keys=keys)

    def gather(self, arrays, root, keys=None):
        self.implied = False
        got = self._to_leader(None if arrays is None else as_arrays(arrays))
        if self.is_leader:
            every = self._leaders.gather(got, self.link.layout.machine_of(root), self.check)
            if self.rank == root:
                return [e for machine in every for e in machine]
        if keys is not None and arrays is not None:
            return list(arrays)
        return None

    def all_gather(self, arrays):
        self.implied = False
        got = self._to_leader(None if arrays is None else as_arrays(arrays))
        if self.is_leader:
            every = [e for machine in self._leaders.all_gather(got, self.check) for e in machine]
            flat, counts = [], []
            for e in every:
                counts.append(-1 if e is None else len(e))
                flat.extend([] if e is None else e)
            packed = flat + [np.array(counts, dtype=np.int64)]
        else:
            packed = None
        packed = self._from_leader(packed) if self._multi else packed
        counts = [int(c) for c in packed[-1]]
        out, i = [], 0
        for c in counts:
            if c < 0:
                out.append(None)
            else:
                out.append(list(packed[i:i + c]))
                i += c
        return out

    def scatter(self, per_rank, root):
        self.implied = False
        me = self.rank
        if me == root:
            self._check_scatter(per_rank)
        mine_sub = None
        if self.is_leader:
            cl = self.link
            root_machine = cl.layout.machine_of(root)
            if cl.node == root_machine and me != root:
                raise ValueError("scatter in a cluster needs the root to be its machine's leader")
            per_machine = None
            if me == root:
                per_machine = [[[np.asarray(a, order="C") for a in per_rank[q]]
                                for q in cl.layout.ranks(m)] for m in range(cl.layout.n_machines)]
            mine_sub = self._leaders.scatter(per_machine, root_machine, self.check)
        if not self._multi:
            return mine_sub[0]
        return self.local.scatter(mine_sub, self.machine.master_rank)

    # -- call outputs -----------------------------------------------------------------
    def contribute(self, arrays, weight=1.0):
        if self.is_leader:
            self.mine = (None if arrays is None else [np.array(a) for a in arrays], weight)
        else:
            self.local.contribute(arrays, weight)

    def settle(self):
        self.local.settle()

    def node_contributions(self):
        """Node master, after its machine's end barrier: [(global rank, arrays, weight)]."""
        offset, leader = self.rank_offset, self.machine.master_rank
        out = []
        local = self.local.collect() if self._multi else [None]
        for i, entry in enumerate(local):
            if i == leader:
                entry = self.mine
            if entry is not None and entry[0] is not None:
                out.append((offset + i, [np.asarray(a, order="C") for a in entry[0]],
                            entry[1]))
        return out

    def collect(self):
        out = [None] * self.n_parallel
        if self._multi:
            for i, entry in enumerate(self.local.collect()):
                out[i] = entry
        out[self.rank] = None
        for rank, entry in self.remote().items():
            out[rank] = entry
        return out

    def _contribution(self, q):
        raise NotImplementedError  # collect() is overridden

    def close(self):
        self.local.close()


def _place(a, out, copy=False):
    if out is not None and out.shape == a.shape and out.dtype == a.dtype:
        if a is not out:
            np.copyto(out, a)
        return out
    return np.array(a) if copy else a
