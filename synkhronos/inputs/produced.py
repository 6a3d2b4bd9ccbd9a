"""Data that lives where it is used: each machine of a cluster holds only its own rows.

``synk.data(produce=fn)`` runs ``fn`` on every machine for that machine's
rows (``machine_rows.Part``), and the machine keeps them in its own shared
memory: the controller never holds or sends the others.  Calls then split
each machine's rows among its ranks (``machine_rows.owner_plan``).  NumPy
inputs of a call in a cluster travel the same way: each machine is sent
only the rows its ranks use (``send_rows``).  On one machine a produced Data
is an ordinary Data.
"""

import logging
import math

import cloudpickle
import numpy as np

from . import machine_rows
from ..runtime.commands import Command
from ..runtime.run import run_command
from .data_object import Data, new_id
from .mappings import GROW, DataDesc, MapMsg, ProduceMsg, SendMsg
from ..errors import MachineLostError, SynkError
from .machine_rows import PLACED_POSITIONS, PLACED_ROWS, Part
from ..runtime.shmem import SharedArray

logger = logging.getLogger(__name__)


class PlacedData(Data):
    """A Data whose rows live on the machines that use them; made by ``synk.data(produce=...)``.

    Machine ``m`` holds rows ``parts[m]`` of the whole; only function calls
    (as a scattered input, with or without ``batch``) read it.  Its contents
    are written where they are made: there is no ``set_value``.
    """

    placed = True

    def __init__(self, ID, dtype, ndim, minibatch, name, kind, layout, remake=None):
        super().__init__(ID, dtype, ndim, minibatch=minibatch, name=name)
        self._kind = kind          # machine_rows.PLACED_ROWS, or PLACED_POSITIONS (a call's input)
        self._layout = layout      # the machines it was placed on
        self._parts = None         # machine -> (lo, hi) rows of the whole
        self._whole = None         # the whole's shape
        self._remake = remake      # how to produce it again on other machines (produce())

    @property
    def data(self):
        raise TypeError(f"Data {self._name or self._ID}: its rows live on the machines that use "
                        "them; .local is this machine's part (rows .parts[0])")

    @property
    def local(self):
        """This machine's rows (read-only): rows ``parts[0]`` of the whole."""
        if self._data is None:
            return None
        ro = self._data.view()
        ro.flags.writeable = False
        return ro

    @property
    def parts(self):
        """Each machine's rows of the whole: a list of ``(lo, hi)``, machine by machine."""
        return list(self._parts or ())

    @property
    def shape(self):
        return self._whole

    @property
    def size(self):
        return 0 if self._whole is None else math.prod(self._whole)

    def __len__(self):
        return self._whole[0]

    def __getitem__(self, k):
        raise TypeError(f"Data {self._name or self._ID}: its rows live on the machines that use "
                        "them; index .local for this machine's part")

    def __setitem__(self, k, v):
        raise TypeError(f"Data {self._name or self._ID} was produced where it is used; "
                        "its rows are written there (make a new one with synk.data(produce=...))")

    def set_value(self, input_data, force_cast=False, oversize=1):
        self.__setitem__(None, None)

    def set_shape(self, shape, oversize=1):
        self.__setitem__(None, None)

    def set_length(self, length, oversize=1):
        self.__setitem__(None, None)

    def describe(self):
        desc = self._desc
        if desc is None or desc.shape != self._whole:
            desc = self._desc = self._make_desc()
        return desc

    def _make_desc(self):
        return DataDesc(self._ID, self._dtype.str, self._whole, self._minibatch, self._kind)

    def placed_on(self, layout):
        """Whether this Data was placed on the machines of ``layout``."""
        return self._layout is layout

    def replica(self):
        return None  # no machine holds a copy of another's rows

    def check_layout(self, rt, where):
        """Make this Data again on the run's machines if they changed since (its ``produce``).

        Machines lost or joined: each machine left produces its rows of the
        new layout, so every row is there again, the lost machine's included.

        Raises:
            SynkError: the machines changed and this Data cannot be produced again.
        """
        layout = rt.peers.layout
        if layout is None or layout is self._layout:
            return
        if self._remake is None:
            raise SynkError(f"{where}: Data {self._name or self._ID} was placed on machines "
                            "of which one was lost since; make it again")
        logger.info("data %s: produced again on %d machines (the machines changed)",
                    self._name or self._ID, layout.n_machines)
        self.make(*self._remake, None)

    def _own_segment(self, nbytes, headroom=1.0):
        """Make this machine's memory hold ``nbytes`` (``headroom`` times more if made anew).

        Returns whether it was made anew (the machine's ranks must map it).
        """
        if self._seg is not None and self._seg.nbytes >= nbytes:
            return False
        self._swap_segment(SharedArray(self._rt.segment_name(f"d{self._ID}"),
                                       max(int(nbytes * headroom), 1)))
        return True

    def make(self, fn, produce, force_cast, length, own):
        """Produce this Data on the run's machines: each its part (``own``: machine 0's, if made).

        ``fn`` is ``produce`` cloudpickled, for the other machines.  Returns self.
        """
        rt = self._rt
        layout = self._layout = rt.peers.layout
        parts = None if length is None else machine_rows.machine_rows(length, layout.n_local)
        mine = (None, None) if parts is None else parts[0]
        ID, ndim, name, dtype = self._ID, self._ndim, self._name, self._dtype
        msg = ProduceMsg(ID, dtype.str, ndim, fn, parts, force_cast)

        def local(seq):
            arr = own if own is not None else machine_rows.check_produced_rows(
                produce(Part(0, layout.n_machines, *mine)), None, dtype, ndim, force_cast,
                machine_rows.count(mine), 0)
            self._own_segment(arr.nbytes)
            self._data = self._seg.view(dtype, arr.shape)
            self._data[...] = arr
            return arr.shape

        def after(shape0):
            shapes = {0: shape0}
            for entry in rt.backend.collect():
                if entry is not None and entry[0]:
                    m, shape = int(entry[0][0][0]), tuple(int(s) for s in entry[0][0][1:])
                    shapes[m] = shape
            return shapes
        try:
            shapes = run_command(rt, Command.DATA_PRODUCE, msg, local, after,
                                 what=f"data({name or ID}): produce")
            rests = {m: s[1:] for m, s in shapes.items()}
            if len(set(rests.values())) > 1:
                raise TypeError("data: produce returned rows of different shapes: " + ", ".join(
                    f"machine {m}: {rests[m]}" for m in sorted(rests)))
            if rt.worker_ranks:
                run_command(rt, Command.DATA_MAP, MapMsg(ID, self._seg.name, self._seg.nbytes))
        except BaseException as exc:
            self._forget(exc)
            raise
        counts = [shapes[m][0] for m in range(layout.n_machines)]
        starts = np.concatenate([[0], np.cumsum(counts)]).astype(int).tolist()
        self._parts = [(starts[m], starts[m + 1]) for m in range(layout.n_machines)]
        self._whole = (starts[-1],) + rests[0]
        logger.debug("data %s: produced %s on %d machines, parts %s", name or ID, self._whole,
                     layout.n_machines, self._parts)
        return self

    def _forget(self, exc):
        """Failed to be made: free what some machines made of it."""
        rt = self._rt
        if not isinstance(exc, MachineLostError) and not rt.closed:
            try:
                self.free_memory()
            except Exception:  # noqa: BLE001 - the first error is the one to raise
                logger.debug("freeing a Data that failed to be made failed too", exc_info=True)
        if self._seg is not None:
            self.detach()
        rt.registry.datas.pop(self._ID, None)

    def send_rows(self, arr, plans):
        """Send each machine the rows of ``arr`` its ranks use in a call (``plans``, by machine).

        Machine ``m`` is sent ``arr[plans[m].sel]`` only; this Data (a call's
        per-machine memory, ``place_call_inputs``) then stands for ``arr`` in the call.
        """
        rt = self._rt
        peers = rt.peers
        rows = [machine_rows.gather_rows(arr, p.sel) for p in plans]
        rows = [r if r.flags.c_contiguous else np.ascontiguousarray(r) for r in rows]
        new = self._own_segment(rows[0].nbytes, GROW)
        msg = SendMsg(self._ID, self._seg.name if new else None, self._seg.nbytes,
                      tuple(r.nbytes for r in rows))

        def local(seq):
            for m in range(1, len(rows)):
                peers.send_data(m, rows[m].reshape(-1).view(np.uint8))
            self._data = self._seg.view(self._dtype, rows[0].shape)
            self._data[...] = rows[0]
        self._whole = (sum(p.n for p in plans),) + arr.shape[1:]
        self._parts = None
        try:
            run_command(rt, Command.DATA_SEND, msg, local, what="call inputs: rows to each machine")
        except MachineLostError as exc:
            if exc.survived:
                exc.settled(False, "the call did not start: call it again")
            raise


def produce(rt, produce, var, dtype, ndim, minibatch, force_cast, name, length):
    """A Data made on every machine by ``produce`` (``synk.data(produce=...)`` in a cluster)."""
    layout = rt.peers.layout
    try:
        fn = cloudpickle.dumps(produce)
    except Exception as exc:  # noqa: BLE001 - any pickling failure means the same to the user
        raise TypeError(f"data: produce does not pickle ({exc}); it runs on every machine") \
            from None
    parts = None if length is None else machine_rows.machine_rows(length, layout.n_local)
    mine = (None, None) if parts is None else parts[0]
    own = None
    if var is not None:
        dtype, ndim = var.dtype, var.ndim
    elif dtype is None or ndim is None:
        # The dtype and ndim the machines cast to come from machine 0's rows.
        own = machine_rows.check_produced_rows(produce(Part(0, layout.n_machines, *mine)), var, dtype, ndim,
                                   force_cast, machine_rows.count(mine), 0)
        dtype, ndim = own.dtype, own.ndim
    obj = PlacedData(new_id(rt), dtype, ndim, minibatch, name, PLACED_ROWS, layout,
                     remake=(fn, produce, force_cast, length))
    return obj.make(fn, produce, force_cast, length, own)


def place_call_inputs(rt, name, datas, inputs, sel, n_rows, scratch):
    """Cluster: which machine uses which rows of a call; send each machine its rows of NumPy inputs.

    ``datas`` are the call's scattered inputs: Data, or ``Rows`` of a NumPy
    input (replaced here by a Data placed machine by machine, kept in
    ``scratch`` by input index).  Returns {first rank of each machine: its
    ``machine_rows.MachinePlan``}.
    """
    layout = rt.peers.layout
    placed_in = [(d, var) for d, var in zip(datas, inputs) if isinstance(d, PlacedData)]
    for d, var in placed_in:
        d.check_layout(rt, name)
        if d.parts != placed_in[0][0].parts:
            raise ValueError(f"{name}: inputs {placed_in[0][1]} and {var} are placed on the "
                             f"machines in different parts ({placed_in[0][0].parts} and "
                             f"{d.parts}); a call pairs rows machine by machine")
    if placed_in:
        plans = machine_rows.owner_plan(sel, placed_in[0][0].parts)
    else:
        plans = machine_rows.even_plan(sel, n_rows, layout.n_local)
    for i, d in enumerate(datas):
        if not isinstance(d, Data):
            kept = scratch.get(i)
            if kept is None or not isinstance(kept, PlacedData) or not kept.placed_on(layout):
                kept = scratch[i] = _scratch(rt, inputs[i])
            kept.send_rows(d.array, plans)
            datas[i] = kept
    return {layout.offsets[m]: p for m, p in enumerate(plans)}


def _scratch(rt, var):
    """A call input's per-machine memory in a cluster (its rows are sent by ``send_rows``)."""
    return PlacedData(new_id(rt), var.dtype, var.ndim, False, None, PLACED_POSITIONS,
                      rt.peers.layout)
