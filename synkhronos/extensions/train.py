"""One callable training step: gradient function, one all-reduce, update function; and its serial twin."""

import logging

import numpy as np
import pytensor
import pytensor.tensor as pt
from pytensor.compile import SharedVariable

import synkhronos as synk

# The library's internals read here are the declared seams of tests/extensions/test_extension_seams.py.
from ..comm.compressed import check_16bit
from ..functions.overlap import OverlappedStep
from ..inputs.conditioning import check_bool
from ..inputs.rank_rows import RowRange, normalize_batch
from . import updates as _updates

logger = logging.getLogger(__name__)

__all__ = ["make_train_function", "make_serial_train_function", "TrainFunction",
           "SerialTrainFunction"]


def _rule(update_rule):
    """Return the ``apply_*`` function for a rule name or a rule function."""
    if callable(update_rule):
        name = update_rule.__name__
        name = name[len("apply_"):] if name.startswith("apply_") else name
    else:
        name = update_rule
    apply = _updates.RULES.get(name)
    if apply is None:
        raise ValueError(f"make_train_function: update_rule must be one of "
                         f"{', '.join(_updates.RULES)} (a name or the function); "
                         f"got {update_rule!r}")
    return apply


# Gradients add up over ranks: "sum" gives the full batch's gradient (its parts
# weighted by rows), "avg" the same scaled; max, min or prod of gradients mean nothing.
GRAD_OPS = ("sum", "avg")


def _check_options(where, all_reduce_op, weighted, overlap):
    if all_reduce_op not in GRAD_OPS or not isinstance(all_reduce_op, str):
        raise ValueError(f"{where}: all_reduce_op must be 'sum' or 'avg' (the ops that "
                         f"combine gradients); got {all_reduce_op!r}")
    check_bool(weighted, f"{where}: weighted")
    check_bool(overlap, f"{where}: overlap")


def _output_list(outputs):
    """``outputs`` as a list: None, one expression or pair, or a list of them."""
    if outputs is None:
        return []
    if isinstance(outputs, list) or (isinstance(outputs, tuple) and not
                                     (len(outputs) == 2 and isinstance(outputs[1], (str, type(None))))):
        return list(outputs)
    return [outputs]


def _data_vars(x, y):
    """Split x and y into explicit inputs and shared variables holding data."""
    vars_ = [v for v in (x, y) if v is not None]
    inputs = [v for v in vars_ if not isinstance(v, SharedVariable)]
    shared = [v for v in vars_ if isinstance(v, SharedVariable)]
    if inputs and shared:
        raise TypeError("make_train_function: x and y must both be inputs or both be shared "
                        "variables")
    return inputs, shared


class TrainFunction:
    """A data-parallel training step made by ``make_train_function``.

    Calling it runs, on every rank and in one command: the gradient function
    over the rank's share of the batch, one all-reduce of the flat gradient,
    and the update function.  Every rank then holds the same parameters.  The
    two functions stay callable on their own (``f_grad``, then
    ``synk.all_reduce(grad_shared)``, then ``f_update``): the same step in
    three commands.

    Attributes:
        f_grad: the synkhronos function computing the loss (and outputs) and
            writing the flat gradient.
        f_update: the synkhronos function applying the rule.
        grad_shared: the flat gradient shared variable.
        all_reduce_op: the op of the all-reduce ("sum" by default).
    """

    def __init__(self, f_grad, f_update, grad_shared, all_reduce_op, all_reduce_dtype=None,
                 grad_prev=None):
        self.f_grad = f_grad
        self.f_update = f_update
        self.grad_shared = grad_shared
        self.all_reduce_op = all_reduce_op
        self.all_reduce_dtype = all_reduce_dtype
        self.grad_prev = grad_prev
        self.overlap = grad_prev is not None
        if self.overlap:
            self._step = OverlappedStep(f_grad, f_update, grad_shared, grad_prev, all_reduce_op,
                                        all_reduce_dtype)
        else:
            # One command per step: gradient, all-reduce and update run inside the call.
            self._step = f_grad.then_all_reduce(grad_shared, all_reduce_op, f_update,
                                                dtype=all_reduce_dtype)

    def __call__(self, *data, batch=None, batch_s=None, num_slices=1):
        """Run one training step on every rank; return the loss (and outputs).  Master only.

        Args:
            *data: Data objects (or arrays) for x and y, when they are inputs.
            batch: rows of the inputs (as for ``Function.__call__``).
            batch_s: rows of each rank's shared data, when x and y are shared.
            num_slices: run each rank's rows in this many slices.

        Returns:
            The loss averaged over the batch, or a list ``[loss, *outputs]``
            when ``outputs`` were given.
        """
        return self._step(*data, batch=batch, batch_s=batch_s, num_slices=num_slices)

    def flush(self):
        """Apply the gradient still waiting in an overlapped step (no-op otherwise).  Master only.

        Call it at the end of training and before ``checkpoint.save``: an
        overlapped step applies each gradient one step later.
        """
        if self.overlap:
            self._step.flush()


def make_train_function(loss, params, x, y, update_rule="sgd", update_kwargs=None,
                        outputs=None, extra_updates=None, weighted=True,
                        all_reduce_op="sum", all_reduce_dtype=None, overlap=False,
                        **kwargs):
    """Build a data-parallel training step; call it after ``distribute()``.  Master only.

    Call after ``fork()`` and before ``distribute()``: it builds two synkhronos
    functions.  ``x`` and ``y`` are either both inputs (their data is scattered
    and selected with ``batch=``) or both shared variables holding each rank's
    data (listed as ``sliceable_shareds``, selected with ``batch_s=``).

    Args:
        loss: the scalar training loss, a mean over the rows of ``x``.
        params: the shared variables to train.
        x: the input variable (or shared variable of inputs).
        y: the target variable (or shared variable of targets), or None.
        update_rule: a rule name ("sgd", "momentum", "nesterov_momentum",
            "adagrad", "rmsprop", "adadelta", "adam", "adamax") or one of the
            functions of ``synkhronos.extensions.updates``.
        update_kwargs: the rule's hyper-parameters, e.g.
            ``{"learning_rate": 0.01}`` (sgd, momentum and nesterov_momentum
            need a learning_rate).
        outputs: more expressions to compute and return with the loss,
            averaged over the batch (or ``(expression, op)`` pairs).
        extra_updates: more ``(shared, update)`` pairs for the gradient
            function, e.g. batch-norm running statistics (each rank keeps its
            own; all-reduce them with op "avg" when they must agree).
        weighted: weigh each rank's gradient by its rows (``x.shape[0]``), so
            uneven splits give exactly the full batch's gradient; False weighs
            ranks equally, as the original Synkhronos did.
        all_reduce_op: "sum" or "avg" (the same result, see ``updates``).
        all_reduce_dtype: None, or "bfloat16" / "float16": send the gradient
            in that 16-bit type (``synk.all_reduce(..., dtype=)``).
        overlap: double buffering (ChainerMN): each step all-reduces the
            previous step's gradient while it computes its own, and updates
            with the previous (one step old) gradient; call ``flush()`` on
            the step at the end.  Not with in-graph collectives.
        **kwargs: passed on to ``synk.function`` (e.g. ``mode=``).

    Returns:
        TrainFunction

    Raises:
        ValueError: unknown update rule, hyper-parameters missing, or an
            ``all_reduce_op`` other than "sum" and "avg".
        TypeError: one of x and y is shared and the other is not, or
            ``weighted`` or ``overlap`` is not a bool.
    """
    _check_options("make_train_function", all_reduce_op, weighted, overlap)
    if all_reduce_dtype is not None:
        check_16bit(all_reduce_dtype, all_reduce_op, [], "make_train_function")
    apply = _rule(update_rule)
    inputs, shared = _data_vars(x, y)
    params = _updates.check_params(params, "make_train_function")
    weight = x.shape[0] if weighted else None
    grad_shared, grad_updates = _updates.make_flat_grad(loss, params, weight)
    grad_prev = None
    if overlap:
        # The second buffer of double buffering: the update reads this one.
        grad_prev = pytensor.shared(np.zeros_like(grad_shared.get_value()),
                                    name=f"{grad_shared.name}_prev")
    param_updates = apply(grad_prev if overlap else grad_shared, params,
                          **(update_kwargs or {}))
    extra = _output_list(outputs)
    f_grad = synk.function(inputs, outputs=[loss] + extra if extra else loss,
                           updates=grad_updates + list(extra_updates or []),
                           sliceable_shareds=shared or None, **kwargs)
    if overlap and f_grad.spec.collective:
        raise ValueError("make_train_function: overlap=True cannot run a graph holding "
                         "in-graph collectives (they would share the backend with the "
                         "overlapped all-reduce)")
    f_update = synk.function([], updates=param_updates, **kwargs)
    logger.info("training step built: rule %s, %d parameters (%d values)",
                apply.__name__[len("apply_"):], len(params), _updates.flat_size(params))
    return TrainFunction(f_grad, f_update, grad_shared, all_reduce_op, all_reduce_dtype,
                         grad_prev)


class SerialTrainFunction:
    """The serial twin of ``TrainFunction``: one plain PyTensor function per step.

    Attributes:
        fn: the compiled function (data inputs; or, for shared data, row indices).
    """

    def __init__(self, inputs, shared, outs, upd, return_list, kwargs):
        self._inputs = inputs
        self._shared = shared
        self._outs = outs
        self._upd = upd
        self._return_list = return_list
        self._kwargs = kwargs
        self._fns = {}
        self.fn = self._function(indexed=False)

    def _function(self, indexed):
        fn = self._fns.get(indexed)
        if fn is None:
            if indexed:
                idx = pt.lvector("rows")
                givens = [(s, s[idx]) for s in self._shared]
                fn = pytensor.function([idx], self._outs, updates=self._upd, givens=givens,
                                       **self._kwargs)
            else:
                fn = pytensor.function(self._inputs, self._outs, updates=self._upd,
                                       **self._kwargs)
            self._fns[indexed] = fn
        return fn

    def __call__(self, *data, batch=None, batch_s=None, num_slices=1):
        """Run one training step in this process; return the loss (and outputs).

        Args:
            *data: arrays (or Data objects) for x and y, when they are inputs.
            batch: rows of ``data`` to use (int, slice, or index list).
            batch_s: rows of the shared data to use (slice or index list).
            num_slices: only 1 (serial steps are not sliced).
        """
        if isinstance(num_slices, bool) or num_slices != 1:
            raise ValueError(f"serial train function: num_slices must be 1; got {num_slices!r}")
        if self._shared:
            if data:
                raise TypeError("serial train function: x and y are shared variables; "
                                "select rows with batch_s, not data")
            if batch_s is None:
                out = self._function(indexed=False)()
            else:
                rows = np.arange(len(self._shared[0].get_value(borrow=True)))[batch_s]
                out = self._function(indexed=True)(rows.astype(np.int64))
        else:
            arrays = [d.data if isinstance(d, synk.Data) else np.asarray(d) for d in data]
            if batch is not None:
                # The rows a data-parallel step would use (an int k: rows [:k]).
                sel = normalize_batch(batch, "serial train function: batch")
                arrays = [a[sel.start:sel.stop] if isinstance(sel, RowRange) else a[sel.rows]
                          for a in arrays]
            out = self.fn(*arrays)
        return out if self._return_list else out[0]


def make_serial_train_function(loss, params, x, y, update_rule="sgd", update_kwargs=None,
                               outputs=None, extra_updates=None, weighted=True,
                               all_reduce_op="sum", all_reduce_dtype=None, overlap=False,
                               **kwargs):
    """Build the serial twin of ``make_train_function``: plain PyTensor, no fork needed.

    Same arguments (``weighted``, ``all_reduce_op``, ``all_reduce_dtype`` and
    ``overlap`` are checked and ignored), same rule code applied to the full batch's gradient, so the two
    give the same parameter trajectory.  Use it for baselines and speedups.

    Returns:
        SerialTrainFunction
    """
    _check_options("make_serial_train_function", all_reduce_op, weighted, overlap)
    apply = _rule(update_rule)
    inputs, shared = _data_vars(x, y)
    params = _updates.check_params(params, "make_serial_train_function")
    grads = pytensor.grad(loss, params)
    upd = apply(grads, params, **(update_kwargs or {})) + list(extra_updates or [])
    extra = [o[0] if isinstance(o, tuple) else o for o in _output_list(outputs)]
    return SerialTrainFunction(inputs, shared, [loss] + extra, upd, bool(extra), kwargs)

