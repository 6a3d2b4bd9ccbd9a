"""The NCCL path of the collectives: when a call takes it, and running it on shared variables.

A collective asks ``wanted()`` in the master and sends the answer in its
command's payload; then every rank calls the function here named like the
collective.  Each returns None (or False) when the call must take the host
path after all: the ranks agreed on that through the host backend
(``comm.nccl_backend``), so they all take the same path.
"""

import logging

from . import gpu
from . import sharedvars as sv
from .errors import BackendUnavailableError

logger = logging.getLogger(__name__)


def wanted(rt, nccl):
    """Return True if a collective called with ``nccl`` should run through NCCL.  Master only.

    NCCL needs GPU mode, one GPU per rank, and CuPy with NCCL.  When the user
    asked for it (``nccl=True``, the default) in GPU mode and cannot have it,
    a WARNING says why, once per run.
    """
    if not nccl or rt.device != "gpu":
        return False
    if rt.nccl_off is None:
        rt.nccl_off = why_not(rt)
        if rt.nccl_off:
            logger.warning("NCCL not used (%s); GPU collectives go through host memory",
                           rt.nccl_off)
    return not rt.nccl_off


def why_not(rt):
    """Return why NCCL cannot serve this run's collectives, or "" if it can."""
    if rt.n_parallel > rt.n_gpus:
        return (f"{rt.n_parallel} ranks share {rt.n_gpus} GPU{'s' if rt.n_gpus > 1 else ''}; "
                "NCCL needs one GPU per rank")
    try:
        gpu.import_cupy()
    except BackendUnavailableError as exc:
        return str(exc)
    return ""


def backend(rt):
    """Return this rank's NcclBackend, made on first use (its communicator connects later)."""
    if rt.nccl is None:
        from .comm.nccl_backend import NcclBackend  # imports CuPy: only on the NCCL path

        rt.nccl = NcclBackend(rt)
    return rt.nccl


def _values(shareds):
    return [sv.raw(v) for v in shareds]


def all_reduce(rt, shareds, op):
    """Every rank: all_reduce on the device; False if the host path must run instead."""
    got = backend(rt).all_reduce(_values(shareds), op)
    if got is None:
        return False
    for var, value in zip(shareds, got):
        sv.store(var, value)
    return True


def reduce(rt, shareds, op, in_place):
    """Every rank: reduce into the master on the device.

    Returns None for the host path; else, in the master, the results (in
    each variable's kind) or, in place, an empty list; elsewhere an empty list.
    """
    root = rt.master_rank
    got = backend(rt).reduce(_values(shareds), op, root)
    if got is None:
        return None
    if rt.rank != root:
        return []
    if in_place:
        for var, value in zip(shareds, got):
            sv.store(var, value)
        return []
    return [sv.like(var, value) for var, value in zip(shareds, got)]


def broadcast(rt, shareds):
    """Every rank: broadcast the master's values on the device; False for the host path."""
    root = rt.master_rank
    mine = rt.rank == root
    got = backend(rt).broadcast(_values(shareds) if mine else None, root)
    if got is None:
        return False
    if not mine:
        for var, value in zip(shareds, got):
            sv.store(var, value)
    return True


def gather(rt, shareds, nd_up):
    """Every rank: gather into the master on the device.

    Returns None for the host path (shapes differ between ranks); else, in
    the master, each variable's values stacked (``nd_up=1``) or concatenated
    (``nd_up=0``) in rank order, in the variable's kind; elsewhere an empty list.
    """
    got = backend(rt).gather(_values(shareds), rt.master_rank)
    if got is None:
        return None
    if rt.rank != rt.master_rank:
        return []
    if not nd_up:
        got = [g.reshape((-1,) + tuple(g.shape[2:])) for g in got]
    return [sv.like(var, value) for var, value in zip(shareds, got)]


def all_gather(rt, shareds):
    """Every rank: concatenate all ranks' values on the device; False for the host path."""
    got = backend(rt).all_gather(_values(shareds))
    if got is None:
        return False
    for var, value in zip(shareds, got):
        sv.store(var, value.reshape((-1,) + tuple(value.shape[2:])))
    return True
