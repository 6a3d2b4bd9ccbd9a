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

from . import rank_call as execution
from ..variables import access as sv
from ..comm import compressed
from ..runtime.control import Command, handler, run_command

__all__ = ["step"]


class OverlapMsg(NamedTuple):
    """OVERLAP_STEP: run gradient call ``call`` (or none) while all-reducing the previous one."""

    call: object          # a calls.CallMsg, or None to only flush
    grad_id: int          # the gradient function (writes ``cur``)
    update_id: int        # the update function (reads and zeroes ``prev``)
    cur_idx: int
    prev_idx: int
    op: str
    dtype: object         # None or a 16-bit transport type
    pending: bool         # ``prev`` holds a gradient to reduce and apply


def step(rt, f_grad, f_update, cur, prev, op, dtype, pending, call):
    """Run one overlapped step (or, with ``call`` None, apply the pending gradient).  Master only.

    Returns the gradient function's outputs, reduced as for a call, or None.
    """
    msg = OverlapMsg(call, f_grad._ID, f_update._ID, rt.registry.shared_ids[id(cur)],
                     rt.registry.shared_ids[id(prev)], op, dtype, pending)
    spec = f_grad.spec
    after = None
    if call is not None:
        def after(mine):
            return execution.collect(spec, rt, mine, call.subset, f_grad.name or "train step")
    return run_command(rt, Command.OVERLAP_STEP, msg, lambda seq: _local(rt, msg), after)


def _reduce(rt, arr, msg):
    be = rt.backend.host
    if msg.dtype is None:
        return be.all_reduce([arr], msg.op, out=[arr])[0]
    return compressed.all_reduce(be, [arr], msg.op, msg.dtype, out=[arr])[0]


def _local(rt, msg):
    prev, cur = rt.registry.shareds[msg.prev_idx], rt.registry.shareds[msg.cur_idx]
    box = {}
    thread = None
    if msg.pending:
        arr = sv.get_array(prev)

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
            results, weight = execution.run_share(rt.registry.functions[msg.grad_id].spec, rt, msg.call)
    finally:
        if thread is not None:
            thread.join()
    if "exc" in box:
        raise box["exc"]
    if msg.pending:
        # Others may still read this rank's buffers: meet before anyone packs results.
        rt.backend.barrier()
        sv.adopt(rt, prev, box["out"])
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


@handler(Command.OVERLAP_STEP, OverlapMsg, collected=True)
def _overlap_worker(rt, msg):
    results, weight = _local(rt, msg)
    if msg.call is not None:
        rt.backend.contribute(results, weight)
