"""Where the ranks are: ``Layout``, ``layout()``, and the LAYOUT command that numbers ranks globally."""

import socket
from typing import NamedTuple

from ..runtime.commands import Command, handler
from ..runtime.run import run_command
from ..runtime.state import require_forked, serialized


class Layout:
    """Where the ranks are: machine by machine, ``n_local[m]`` ranks on machine ``m``.

    Attributes:
        n_local: ranks on each machine (machine 0 holds the controller).
        offsets: the first global rank of each machine.
        hosts: each machine's host name.
        generation: how many times machines joined or were lost before this
            layout (where machines come and go; compare it to learn of a change).
    """

    def __init__(self, n_local, hosts, generation=0):
        self.n_local = list(n_local)
        self.hosts = list(hosts)
        self.generation = generation
        self.offsets = [sum(self.n_local[:m]) for m in range(len(self.n_local))]

    @property
    def n_machines(self):
        """The number of machines (1 without a cluster)."""
        return len(self.n_local)

    @property
    def n_parallel(self):
        """The number of ranks on every machine together."""
        return sum(self.n_local)

    def ranks(self, machine):
        """Return the global ranks on ``machine`` (a ``range``).

        Raises:
            ValueError: no machine numbered ``machine`` (valid: 0 to ``n_machines - 1``).
        """
        if isinstance(machine, bool) or not isinstance(machine, int) \
                or not 0 <= machine < self.n_machines:
            valid = "0" if self.n_machines == 1 else f"0 to {self.n_machines - 1}"
            raise ValueError(f"Layout.ranks: machine must be {valid} (the run has "
                             f"{self.n_machines} machine{'s' * (self.n_machines > 1)}); "
                             f"got {machine!r}")
        lo = self.offsets[machine]
        return range(lo, lo + self.n_local[machine])

    def machine_of(self, rank):
        """Return the machine that holds global ``rank``.

        Raises:
            ValueError: ``rank`` is not one of the run's ranks.
        """
        for m in range(self.n_machines):
            if rank < self.offsets[m] + self.n_local[m]:
                return m
        raise ValueError(f"rank {rank} is not in the run's {self.n_parallel} ranks")

    def describe(self, machine):
        """Return ``machine`` in words: its number, host name and ranks.

        A machine past the layout (one that was joining when it failed) is
        named by its number alone: this runs on error paths too.
        """
        if not 0 <= machine < self.n_machines:
            return f"machine {machine} (joining)"
        r = self.ranks(machine)
        return f"machine {machine} ({self.hosts[machine]}, ranks {r.start}..{r.stop - 1})"

    def __repr__(self):
        return f"Layout(n_local={self.n_local}, hosts={self.hosts})"


class LayoutMsg(NamedTuple):
    """LAYOUT: this machine's first global rank and the run's number of ranks."""

    offset: int
    n_parallel: int


def set_layout(rt, offset, n_parallel):
    """Give this process its global rank, once the layout is known."""
    place = rt.place
    place.rank_offset = offset
    place.rank = offset + place.local_index
    place.n_parallel = n_parallel
    rt.registry.epoch += 1  # what kept calls prepared holds each rank's rows: made again


# Each machine posts its own LAYOUT (its offset differs): never forwarded.
@handler(Command.LAYOUT, LayoutMsg, local=True)
def _layout_worker(rt, msg):
    set_layout(rt, msg.offset, msg.n_parallel)


@serialized
def layout():
    """Return where the run's ranks are: a ``Layout`` (machines, ranks on each, host names).

    On one machine: one machine holding every rank.  Master (controller) only,
    after ``fork()``.  Where machines come and go, machines that asked to join
    are admitted first (as at every call).

    Example:
        On one machine with 2 cores:

        ```python
        synk.fork()
        lay = synk.layout()
        lay.n_machines, lay.n_local, lay.ranks(0)   # 1, [2], range(0, 2)
        ```

        Under ``mpiexec -n 2`` with ``synk.fork(2)``, two machines:
        ``lay.n_machines, lay.n_local, lay.ranks(1)`` are ``2, [2, 2], range(2, 4)``.

    Returns:
        A ``Layout``.

    Raises:
        SynkStateError: before ``fork()``.
    """
    rt = require_forked("layout()")
    if rt.peers.layout is not None:
        return rt.peers.layout
    return Layout([rt.place.n_parallel], [socket.gethostname()])


def on_machines(callback):
    """Call ``callback(event, machine, layout)`` in the controller whenever machines change.

    Where machines come and go (``SYNK_LISTEN``, docs/clusters.md): ``event``
    is ``"joined"`` or ``"lost"``, ``machine`` describes the machine ("machine 2
    (node3, ranks 4..5)", numbered as before the change), and ``layout`` is the
    run's new ``Layout``.  It runs where the change is made (a join: before
    the call that admits it; a loss in a call: before the ``MachineLostError``
    is raised; a loss while the program sits between calls: at once, from the
    controller's door thread, while no call runs), so a program can rescale
    its learning rate or batch size there.  Without it, compare ``synk.layout().generation``.
    Master only, after ``fork()``; never called on one machine or under MPI
    without machines that come and go.

    Args:
        callback: a callable taking (event, machine, layout); its exceptions are logged.
    """
    if not callable(callback):
        raise TypeError(f"on_machines: callback must be callable; got {callback!r}")
    require_forked("on_machines()").peers.watch(callback)


def take_place(rt, link, make_peers):
    """This machine's last step of joining, on every carrier: number its ranks, set its Peers.

    The same for a cluster under MPI (``join_cluster``) and for machines that
    come and go (``elastic.door``, ``elastic.join``): the LAYOUT command numbers
    the machine's ranks from ``link.layout``, ``make_peers()`` (a Controller
    on machine 0, a NodeMaster elsewhere) becomes ``rt.peers``, and the
    backend's leader sends through ``link``.  Returns the Peers.
    """
    layout = link.layout
    offset = layout.offsets[link.node]
    run_command(rt, Command.LAYOUT, LayoutMsg(offset, layout.n_parallel),
                local=lambda seq: set_layout(rt, offset, layout.n_parallel))
    peers = rt.peers = make_peers()
    if link.node == 0:
        rt.backend.attach(link, peers.contributions)
    else:
        rt.registry.datas = {}  # segments mapped here, as in a worker (Data objects live in the controller)
        rt.backend.attach(link, None)
    return peers
