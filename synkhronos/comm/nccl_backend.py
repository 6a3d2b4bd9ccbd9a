"""NCCL backend: collectives on device arrays through cupy.cuda.nccl, buffers passed by DLPack.

A backend like the others, chosen in GPU mode with one GPU per rank.  It
wraps a host backend (shared memory) and delegates to it whatever NCCL cannot
do exactly: every collective first exchanges a small header (dtypes and
shapes, and whether the rank has a communicator) through the host backend, so
that all ranks decide alike, before any rank enters NCCL, whether the call
can run there.  Shapes that differ between ranks, a dtype or op NCCL lacks,
weighted averages, scatter and function results take the host path; NCCL
itself would hang on counts that differ, or crop and pad gathered data
silently (the original's caveat).  The headers, names and unique id they
agree on are nccl_wire.py's.

The communicator is created in every rank inside one command: the first
collective that finds a rank without one has the master rank make a unique
id and broadcast it through the host backend.  A communicator aborted after a
failure is replaced the same way by the next collective.

Inputs are read in place (JAX arrays via DLPack; NumPy arrays are copied to
the device); NCCL results are CuPy arrays in fresh buffers, never JAX's,
which JAX assumes immutable.  Waits for the GPU poll the stream and run the
command's check, so no wait is unbounded.
"""

import contextlib
import logging
import time

import numpy as np

from ..runtime import devices
from . import parts, reduce_ops
from .base import Backend
from .nccl_wire import decode_unique_id, encode_unique_id, header, nccl_op_name, parse_header
from .shm_backend import ShmBackend

logger = logging.getLogger(__name__)


class NcclBackend(Backend):
    """Collectives on device arrays among the ranks of one run, one GPU per rank.

    NCCL results are CuPy arrays; results of the host path are NumPy arrays.
    The communicator and the CUDA stream are made on first use, after fork:
    the master must not touch CUDA before its workers exist.

    Raises:
        BackendUnavailableError: CuPy or NCCL is not installed.
    """

    device_arrays = True

    def __init__(self, wiring, host_backend=ShmBackend):
        super().__init__(wiring)
        self.cupy, self.nccl = devices.import_cupy()
        self._host = host_backend(wiring)
        self.comm = None
        self._stream = None
        # True: a one-rank collective goes through NCCL too (bench/gpu.py times the path).
        self.nccl_alone = False

    @property
    def host(self):
        """The wrapped host backend: headers, the unique id and the host path go there."""
        return self._host

    @property
    def stream(self):
        # Its own stream: NCCL kernels queue behind nothing else, and waiting
        # for them waits for nothing else.
        if self._stream is None:
            self._stream = self.cupy.cuda.Stream(non_blocking=True)
        return self._stream

    def bind_check(self, check):
        super().bind_check(check)
        self._host.bind_check(check)

    def begin(self, seq):
        self.seq = seq
        self._host.begin(seq)

    def is_kept(self, key, array):
        return self._host.is_kept(key, array)

    def barrier(self):
        self._host.barrier()

    def scatter(self, per_rank, root):
        return self._host.scatter(per_rank, root)

    def contribute(self, arrays, weight=1.0):
        self._host.contribute(_to_host(arrays), weight)

    def settle(self):
        self._host.settle()

    def _contribution(self, q):
        raise NotImplementedError  # collect() goes to the host backend whole

    def collect(self):
        return self._host.collect()

    def scalar_result(self, op, value, weight):
        return self._host.scalar_result(op, value, weight)

    def scalar_combiner(self, op):
        return self._host.scalar_combiner(op)

    def output_combiner(self, op):
        return self._host.output_combiner(op)

    def _agree(self, values):
        """Exchange headers through the host backend; return every rank's (parsed) header.

        Connects first if any rank has no communicator, so that every rank
        connects, or none.
        """
        mine = np.concatenate([[0 if self.comm is None else 1], header(values)])
        got = self._host.all_gather([mine])
        # Copies: the host backend's results are valid until its next call.
        hdrs = [np.array(got[q][0]) for q in range(self.n_parallel)]
        if any(h[0] == 0 for h in hdrs):
            self._connect()
        return [parse_header(h[1:]) for h in hdrs]

    def _connect(self):
        root = self.master_rank
        uid = None
        if self.rank == root:
            uid = [encode_unique_id(self.nccl.get_unique_id())]
        got = self._host.broadcast(uid, root)
        uid = decode_unique_id(got[0])
        self._drop()
        t0 = time.perf_counter()
        self.comm = self.nccl.NcclCommunicator(self.n_parallel, uid, self.rank)
        logger.info("rank %d joined an NCCL communicator of %d ranks in %.3f s",
                    self.rank, self.n_parallel, time.perf_counter() - t0)

    def _drop(self):
        comm, self.comm = self.comm, None
        if comm is not None:
            try:
                comm.destroy()
            except Exception:  # noqa: BLE001 - a broken communicator: nothing left to release
                pass

    def _abort(self):
        comm, self.comm = self.comm, None
        if comm is not None:
            try:
                comm.abort()
            except Exception:  # noqa: BLE001 - aborting is best effort; the next call reconnects
                pass

    @contextlib.contextmanager
    def _group(self):
        # One NCCL group per collective: a list of variables goes in one launch.
        self.nccl.groupStart()
        try:
            yield
        finally:
            self.nccl.groupEnd()

    def _wait(self):
        """Wait for this collective's NCCL work; raise if a rank died or aborted meanwhile."""
        stream = self.stream
        spins = 0
        while not stream.done:
            try:
                self.check()
            except BaseException:
                # The other ranks may never join: free the GPU from the waiting kernels.
                self._abort()
                raise
            spins += 1
            if spins > 1000:
                time.sleep(50e-6)

    def _run(self, launch, then=None):
        """Launch NCCL calls in one group on this backend's stream (then ``then()``); wait."""
        try:
            with self.stream, self._group():
                launch()
            if then is not None:
                with self.stream:
                    then()
        except BaseException:
            self._abort()
            raise
        self._wait()

    def _prepare(self, values):
        """Device views of ``values`` for NCCL, made on this backend's stream.

        On its stream, host-to-device copies (NumPy values) and the DLPack
        hand-over are ordered before the NCCL kernels that read them.
        """
        with self.stream:
            return [devices.to_cupy(v) for v in values]

    def _empty(self, shape, dtype):
        with self.stream:
            return self.cupy.empty(shape, dtype)

    def _const(self, name):
        return getattr(self.nccl, name)

    @staticmethod
    def _same(hdrs):
        return all(h == hdrs[0] for h in hdrs[1:])

    @property
    def alone(self):
        """One rank: a reduction or broadcast gives back its inputs.

        Spares the GPU round trips of the NCCL path (~0.4 ms, bench/gpu.py).
        """
        return self.n_parallel == 1 and not self.nccl_alone

    def _identity(self, arrays, op, weight):
        """True where reducing ``arrays`` over this one rank leaves them as they are."""
        return (self.alone and weight is None and arrays is not None
                and all(reduce_ops.result_dtype(o, a.dtype) == a.dtype
                        for o, a in zip(parts.op_list(op, len(arrays)), arrays)))

    def all_reduce(self, arrays, op, weight=None, out=None, keys=None):
        if self._identity(arrays, op, weight):
            return _into(list(arrays), out)
        names = None if weight is not None else self._reduce_names(self._agree(arrays), op)
        if names is None:
            return self._host.all_reduce(_to_host(arrays), op, weight, out, keys)
        src = self._prepare(arrays)
        dst = [self._empty(s.shape, s.dtype) for s in src]

        def launch():
            for s, d, (nop, ndt) in zip(src, dst, names):
                if s.size:
                    self.comm.allReduce(s.data.ptr, d.data.ptr, s.size, self._const(ndt),
                                        self._const(nop), self.stream.ptr)
        self._run(launch, lambda: self._scale(dst, op))
        return _into(dst, out)

    def reduce(self, arrays, op, root, weight=None, out=None):
        if self._identity(arrays, op, weight):
            return _into(list(arrays), out)
        names = None if weight is not None else self._reduce_names(self._agree(arrays), op)
        if names is None:
            return self._host.reduce(_to_host(arrays), op, root, weight, out)
        src = self._prepare(arrays)
        mine = self.rank == root
        # Only the root receives; elsewhere NCCL ignores the receive buffer.
        dst = [self._empty(s.shape, s.dtype) if mine else s for s in src]

        def launch():
            for s, d, (nop, ndt) in zip(src, dst, names):
                if s.size:
                    self.comm.reduce(s.data.ptr, d.data.ptr, s.size, self._const(ndt),
                                     self._const(nop), root, self.stream.ptr)
        self._run(launch, (lambda: self._scale(dst, op)) if mine else None)
        return _into(dst, out) if mine else None

    def broadcast(self, arrays, root, out=None, keys=None):
        if self.alone:
            return list(arrays)
        mine = self.rank == root
        meta = self._agree(arrays if mine else None)[root]
        if any(name is None for name, _ in meta):
            return self._host.broadcast(_to_host(arrays) if mine else None, root, out, keys)
        if mine:
            bufs = self._prepare(arrays)
        else:
            bufs = [self._empty(shape, name) for name, shape in meta]

        def launch():
            for b in bufs:
                if b.nbytes:
                    # In place at the root (send == receive buffer): its data is only read.
                    self.comm.broadcast(b.data.ptr, b.data.ptr, b.nbytes,
                                        self._const("NCCL_UINT8"), root, self.stream.ptr)
        self._run(launch)
        return list(arrays) if mine else _into(bufs, out)

    def all_gather(self, arrays):
        stacked = self._all_gather(arrays)
        if stacked is None:
            return self._host.all_gather(_to_host(arrays))
        return [[d[q] for d in stacked] for q in range(self.n_parallel)]

    def gather(self, arrays, root, keys=None):
        # NCCL has no gather: an all_gather whose result only the root keeps.
        stacked = self._all_gather(arrays)
        if stacked is None:
            return self._host.gather(_to_host(arrays), root, keys)
        if self.rank != root:
            return None if keys is None else list(arrays)
        return [[d[q] for d in stacked] for q in range(self.n_parallel)]

    def _all_gather(self, values):
        """Each array stacked over ranks, shape ``(n, *shape)``; None for the host path.

        NCCL only when every rank's arrays have the same shapes.
        """
        hdrs = self._agree(values)
        if not self._same(hdrs) or any(name is None for name, _ in hdrs[0]):
            return None
        src = self._prepare(values)
        dst = [self._empty((self.n_parallel,) + s.shape, s.dtype) for s in src]

        def launch():
            for s, d in zip(src, dst):
                if s.nbytes:
                    self.comm.allGather(s.data.ptr, d.data.ptr, s.nbytes,
                                        self._const("NCCL_UINT8"), self.stream.ptr)
        self._run(launch)
        return dst

    def close(self):
        """Release the communicator and the host backend."""
        self._drop()
        self._host.close()

    def _reduce_names(self, hdrs, op):
        """Return each array's NCCL (op, dtype) names, or None for the host path."""
        if not self._same(hdrs) or not hdrs[0]:
            return None
        names = []
        for o, (dtype, _) in zip(parts.op_list(op, len(hdrs[0])), hdrs[0]):
            pair = None if dtype is None else nccl_op_name(o, dtype)
            if pair is None:
                return None
            names.append(pair)
        return names

    def _scale(self, arrays, op):
        """``avg``: the sum, scaled in place by 1/n on the current (this backend's) stream."""
        if self.n_parallel == 1:
            return
        for o, a in zip(parts.op_list(op, len(arrays)), arrays):
            if o == "avg":
                a *= 1.0 / self.n_parallel


def _into(results, out):
    """Each result, or the ``out`` entry of its shape and dtype after the result is copied there."""
    if out is None:
        return results
    final = []
    for r, o in zip(results, out):
        if o is not None and o.shape == r.shape and o.dtype == r.dtype:
            if devices.is_cupy_array(o):
                o[...] = r
            else:
                np.copyto(o, devices.to_host(r))
            r = o
        final.append(r)
    return final


def _to_host(arrays):
    return None if arrays is None else [devices.to_host(a) for a in arrays]
