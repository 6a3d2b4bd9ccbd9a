"""Data memory as the ranks see it: the commands that map, free and mirror it, and views of it.

The Data object itself (data_object.py) lives in the master; every rank maps
its segment by id when DATA_ALLOC says so.
"""

import pickle
from typing import NamedTuple, Optional

import numpy as np

from . import machine_rows
from .machine_rows import REPLICATED
from ..runtime.commands import Command, handler, register
from ..runtime.shmem import SharedArray

GROW = 1.5  # headroom of a call's per-machine input memory, so that it is rarely made again


class DataDesc(NamedTuple):
    """A Data object as commands name it: ranks find its memory by ``data_id``.

    ``shape`` is the whole's; a placed Data's machine holds only some rows of it.
    """

    data_id: int
    dtype: str
    shape: tuple
    minibatch: bool
    placed: int = REPLICATED  # or PLACED_ROWS, PLACED_POSITIONS (named in machine_rows)


class DataAllocMsg(NamedTuple):
    """DATA_ALLOC: map the segment ``name`` of ``nbytes`` as Data ``data_id``'s memory."""

    data_id: int
    name: str
    nbytes: int


class DataFreeMsg(NamedTuple):
    """DATA_FREE: unmap Data ``data_id``'s memory."""

    data_id: int


class DataSyncMsg(NamedTuple):
    """DATA_SYNC (cluster): ``nbytes`` written at byte ``offset`` of Data ``data_id`` follow."""

    data_id: int
    offset: int
    nbytes: int


# In a cluster each node master holds its machine's copy of every Data (cluster/node.py):
# ``machine`` below is that node master, and each step returns what its ranks run.

def _alloc_on_machine(machine, msg):
    return DataAllocMsg(msg.data_id, machine.make_segment(msg.data_id, msg.nbytes), msg.nbytes)


def _free_on_machine(machine, msg):
    machine.free_segments([msg.data_id])
    return msg


def _sync_on_machine(machine, msg):
    machine.receive_segment(msg.data_id, msg.offset, msg.nbytes)  # the ranks map it already


register(Command.DATA_SYNC, None, DataSyncMsg, node=_sync_on_machine)


@handler(Command.DATA_ALLOC, DataAllocMsg, node=_alloc_on_machine)
def _alloc_worker(rt, msg):
    _map(rt, msg)


def map_segments(rt, segments):
    """In a worker started after Data were made (``process.respawn``): map each of them.

    ``segments``: ``(data_id, name, nbytes)`` of every Data, as DATA_ALLOC named them.
    """
    for data_id, name, nbytes in segments:
        _map(rt, DataAllocMsg(data_id, name, nbytes))


@handler(Command.DATA_FREE, DataFreeMsg, node=_free_on_machine)
def _free_worker(rt, msg):
    rt.registry.epoch += 1
    old = rt.registry.datas.pop(msg.data_id, None)
    if old is not None:
        old.close()


def view(rt, desc):
    """Return this rank's NumPy view of the Data a ``DataDesc`` names (a worker's, by its mapping)."""
    seg = rt.registry.datas[desc.data_id]
    if desc.placed != REPLICATED:
        return seg  # this machine holds some rows only: machine_rows.take_share views them
    return seg.cached_view(desc.dtype, desc.shape)


# Data placed machine by machine (produced.py): each node master makes or receives its part.

class ProduceMsg(NamedTuple):
    """DATA_PRODUCE: make Data ``data_id`` on every machine by ``produce`` (cloudpickled)."""

    data_id: int
    dtype: str
    ndim: int
    produce: bytes
    parts: Optional[list]      # machine -> (lo, hi) asked for, or None: the rows each has
    force_cast: bool


class MapMsg(NamedTuple):
    """DATA_MAP, and a machine's answer to DATA_PRODUCE or DATA_SEND: map segment ``name``."""

    data_id: int
    name: Optional[str]        # None: the ranks' mapping stays
    nbytes: int
    shape: Optional[tuple] = None  # DATA_PRODUCE: (machine, *shape of its rows)


class SendMsg(NamedTuple):
    """DATA_SEND: ``nbytes[m]`` bytes of Data ``data_id`` follow to machine ``m``."""

    data_id: int
    name: Optional[str]        # the controller's machine: its new segment, or None
    capacity: int
    nbytes: tuple


def _produce_on_machine(machine, msg):
    m, n_machines = machine.node, machine.layout.n_machines
    span = (None, None) if msg.parts is None else tuple(msg.parts[m])
    produce = pickle.loads(msg.produce)
    arr = machine_rows.check_produced_rows(produce(machine_rows.Part(m, n_machines, *span)), None,
                               np.dtype(msg.dtype), msg.ndim, msg.force_cast,
                               machine_rows.count(span), m)
    name = machine.make_segment(msg.data_id, max(arr.nbytes, 1))
    seg = machine.segments[msg.data_id]
    seg.view(arr.dtype, arr.shape)[...] = arr
    return MapMsg(msg.data_id, name, seg.nbytes, (m,) + arr.shape)


def _send_on_machine(machine, msg):
    need = msg.nbytes[machine.node]
    seg = machine.segments.get(msg.data_id)
    answer = None
    if seg is None or seg.nbytes < need:
        name = machine.make_segment(msg.data_id, max(int(need * GROW), 1))
        answer = MapMsg(msg.data_id, name, machine.segments[msg.data_id].nbytes)
    machine.receive_segment(msg.data_id, 0, need)
    return answer


def _map(rt, msg):
    """Map segment ``msg.name`` as Data ``msg.data_id``'s memory here (None: keep the mapping)."""
    if msg.name is None:
        return
    rt.registry.epoch += 1
    old = rt.registry.datas.pop(msg.data_id, None)
    if old is not None:
        old.close()
    rt.registry.datas[msg.data_id] = SharedArray.attach(msg.name, msg.nbytes)


@handler(Command.DATA_PRODUCE, ProduceMsg, collected=True, node=_produce_on_machine)
def _produce_worker(rt, msg):
    # On a node master's machine ``msg`` is its answer (a MapMsg); on the controller's, the order.
    if isinstance(msg, MapMsg):
        _map(rt, msg)
        if rt.place.local_index == rt.place.leader:
            rt.backend.contribute([np.array(msg.shape, dtype=np.int64)])
            return
    rt.backend.contribute(None)


@handler(Command.DATA_SEND, SendMsg, node=_send_on_machine)
def _send_worker(rt, msg):
    _map(rt, MapMsg(msg.data_id, msg.name, msg.capacity) if isinstance(msg, SendMsg) else msg)


@handler(Command.DATA_MAP, MapMsg, local=True)
def _map_worker(rt, msg):
    _map(rt, msg)
