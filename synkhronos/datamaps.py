"""Data memory as the ranks see it: the commands that map, free and mirror it, and views of it.

The Data object itself (data_module.py) lives in the master; every rank maps
its segment by id when DATA_ALLOC says so.
"""

from typing import NamedTuple

from .commands import Command, handler, register
from .shmem import SharedArray


class DataDesc(NamedTuple):
    """A Data object as commands name it: ranks find its memory by ``data_id``."""

    data_id: int
    dtype: str
    shape: tuple
    minibatch: bool


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
    old = rt.registry.datas.pop(msg.data_id, None)
    if old is not None:
        old.close()
    rt.registry.datas[msg.data_id] = SharedArray.attach(msg.name, msg.nbytes)


@handler(Command.DATA_FREE, DataFreeMsg, node=_free_on_machine)
def _free_worker(rt, msg):
    old = rt.registry.datas.pop(msg.data_id, None)
    if old is not None:
        old.close()


def view(rt, desc):
    """Return this rank's NumPy view of the Data a ``DataDesc`` names."""
    seg = rt.registry.datas[desc.data_id]
    if rt.is_master:
        return seg._data
    return seg.cached_view(desc.dtype, desc.shape)
