"""Overlapped training steps (ChainerMN's double buffering): all-reduce step t during step t+1.

One command per step runs, on every rank: a thread all-reducing the flat
gradient of the previous step (the ``prev`` buffer) while the rank computes
this step's gradient into the ``cur`` buffer; then the update from the
reduced previous gradient; then the buffers swap.  So the update of step t+1
uses the gradient of step t, one step old, and the communication hides
behind the computation as far as the cores and the GIL allow (the compiled
gradient function holds the GIL; NumPy reductions and copies release it).
``make_train_function(overlap=True)`` builds the functions; this module runs them.
"""

import threading
from typing import NamedTuple

from ..comm import compressed
from ..runtime.commands import Command, handler
from ..runtime.run import run_command
from ..runtime.state import serialized
from ..variables import access
from .outputs import collect, machine_part
from .rank_call import run_share

__all__ = ["OverlappedStep"]


class OverlapMsg(NamedTuple):
    """OVERLAP_STEP: run gradient call ``call`` (or none) while all-reducing the previous one."""

    call: object          # a rank_call.CallMsg, or None to only flush
    grad_id: int          # the gradient function (writes ``cur``)
    update_id: int        # the update function (reads and zeroes ``prev``)
    cur_idx: int
    prev_idx: int
    op: str
    dtype: object         # None or a 16-bit transport type
    pending: bool         # ``prev`` holds a gradient to reduce and apply


class OverlappedStep:
    """A training step whose all-reduce overlaps the next step's gradient.  Master only.

    ``f_grad`` writes each step's gradient into ``cur``; ``f_update`` applies
    the gradient in ``prev`` (and zeroes it); the two buffers swap after
    every step.  ``make_train_function(overlap=True)`` builds one.

    Args:
        f_grad: the gradient Function (the step's inputs are its inputs).
        f_update: the update Function, without inputs.
        cur: the shared variable ``f_grad`` writes.
        prev: the shared variable ``f_update`` reads.
        op: "sum" or "avg".
        dtype: None, or a 16-bit transport type for the all-reduce.
    """

    def __init__(self, f_grad, f_update, cur, prev, op, dtype=None):
        self.f_grad = f_grad
        self.f_update = f_update
        self.cur = cur
        self.prev = prev
        self.op = op
        self.dtype = dtype
        self.pending = False  # ``prev`` holds a gradient not applied yet

    @serialized
    def __call__(self, *args, batch=None, batch_s=None, num_slices=1):
        """Run one step: this step's gradient while the previous one is all-reduced and applied.

        Returns the gradient function's outputs, reduced as for a call.
        """
        call, arrays = self.f_grad.plan_call(args, None, None, batch, batch_s, num_slices)
        out = self._run(call, arrays)
        self.pending = True
        return out

    @serialized
    def flush(self):
        """Apply the gradient still waiting, if any."""
        if self.pending:
            self._run(None, None)
            self.pending = False

    def _run(self, call, arrays):
        rt = self.f_grad.runtime()
        ids = rt.registry.shared_ids
        msg = OverlapMsg(call, self.f_grad.spec.id, self.f_update.spec.id, ids[id(self.cur)],
                         ids[id(self.prev)], self.op, self.dtype, self.pending)
        spec = self.f_grad.spec
        after = None
        if call is not None:
            def after(mine):
                return collect(spec, rt, mine, call.subset, self.f_grad.name or "train step")
        return run_command(rt, Command.OVERLAP_STEP, msg, lambda seq: _local(rt, msg, arrays),
                           after)


def _reduce(rt, arr, msg):
    be = rt.backend.host
    if msg.dtype is None:
        return be.all_reduce([arr], msg.op, out=[arr])[0]
    return compressed.all_reduce_16bit(be, [arr], msg.op, msg.dtype, out=[arr])[0]


def _local(rt, msg, arrays=None):
    prev, cur = rt.registry.shareds[msg.prev_idx], rt.registry.shareds[msg.cur_idx]
    box = {}
    thread = None
    if msg.pending:
        arr = access.get_array(prev)

        def communicate():
            try:
                box["out"] = _reduce(rt, arr, msg)
            except BaseException as exc:  # noqa: BLE001 - raised in the rank's main thread
                box["exc"] = exc
        thread = threading.Thread(target=communicate, name="synk-overlap", daemon=True)
        thread.start()
    results, weight = None, 1.0
    try:
        if msg.call is not None:
            results, weight = run_share(rt.registry.functions[msg.grad_id].spec, rt, msg.call,
                                        arrays)
    finally:
        if thread is not None:
            thread.join()
    if "exc" in box:
        raise box["exc"]
    if msg.pending:
        # Others may still read this rank's buffers: meet before anyone packs results.
        rt.backend.barrier()
        access.adopt(rt, prev, box["out"])
        rt.registry.functions[msg.update_id].spec.fn()   # applies the rule, zeroes ``prev``
    if msg.call is not None:
        # Double buffering: this step's gradient waits in ``prev`` for the next step.
        a = cur.get_value(borrow=True, return_internal_type=True)
        b = prev.get_value(borrow=True, return_internal_type=True)
        cur.set_value(b, borrow=True)
        prev.set_value(a, borrow=True)
    if rt.is_master:
        return None if results is None else (results, weight)
    return results, weight


def _combine(rt, msg, entries):
    """A node master: its machine's ranks' outputs of the gradient call, combined before they travel."""
    if msg.call is None:
        return entries
    place = rt.place
    return machine_part(rt.registry.functions[msg.grad_id].spec, msg.call.subset, entries,
                        place.rank_offset, place.n_local)


@handler(Command.OVERLAP_STEP, OverlapMsg, collected=True, combine=_combine)
def _overlap_worker(rt, msg):
    results, weight = _local(rt, msg)
    if msg.call is not None:
        rt.backend.contribute(results, weight)
