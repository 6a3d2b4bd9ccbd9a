"""synk.function and Function: build a data-parallel function, and the object the user calls.

How a call runs (its checks, the CALL command and its message) is in ``calls``.
"""

import logging

import numpy as np
import pytensor

from ..inputs import conditioning, data_object as data_module
from . import rank_call as execution
from ..runtime import devices as gpu
from ..comm import reduce_ops as reducers
from .call import FusedCall, run_call
from ..comm import compressed
from ..errors import SynkStateError
from .arguments import parse_outputs, parse_updates, var_list
from ..runtime.state import require_forked, serialized

logger = logging.getLogger(__name__)


@serialized
def function(inputs, outputs=None, bcast_inputs=None, updates=None, givens=None,
             sliceable_shareds=None, **kwargs):
    """Build a data-parallel function; use it like ``pytensor.function``.  Master only.

    Call after ``fork()`` and before ``distribute()``.

    Args:
        inputs: variables whose data is scattered along axis 0 over the ranks.
        outputs: a variable, ``(variable, op)``, or a list of either.  ``op``
            is how per-rank results combine: "avg" (default; weighted by rows,
            so exact for uneven splits), "sum", "prod", "max", "min", None (the
            list of per-rank results, in rank order) or "gather" (per-rank
            results concatenated along axis 0, in rank order).
        bcast_inputs: variables whose data every rank uses whole.
        updates: ``(shared, update)`` pairs, or ``(shared, update, op)``
            triples; ``op`` ("avg" default, or sum/prod/max/min) combines the
            update over slices (``num_slices``) within a rank.  Updates apply in
            each rank locally.
        givens: as in ``pytensor.function``.
        sliceable_shareds: shared variables holding data-parallel data, to be
            selected by ``batch_s`` and split by ``num_slices``.
        **kwargs: passed on to every internal ``pytensor.function`` call.

    Returns:
        Function

    Raises:
        SynkStateError: not forked yet, or already distributed (a ``RuntimeError``);
            or a JAX-mode function when JAX ran in this process before fork().
        TypeError: an argument of the wrong form.
        ValueError: an unknown reduce op, or a sliceable shared variable the
            function does not use.
    """
    rt = require_forked("function()")
    if rt.registry.distributed:
        raise SynkStateError("function() must be called before distribute()")
    inputs = var_list(inputs, "inputs")
    bcast_inputs = var_list(bcast_inputs, "bcast_inputs")
    seen = set()
    for v in inputs + bcast_inputs:
        if id(v) in seen:
            raise ValueError(f"function: variable {v} appears twice among inputs and bcast_inputs")
        seen.add(id(v))
    out_vars, out_ops, return_list = parse_outputs(outputs)
    upd_pairs, upd_ops = parse_updates(updates)
    sliceable = var_list(sliceable_shareds, "sliceable_shareds", shared=True)
    if rt.config.device == "gpu":
        # GPU mode: shared variables live on the device as JAX arrays.
        kwargs.setdefault("mode", "JAX")
    fn = pytensor.function(inputs + bcast_inputs, out_vars, updates=upd_pairs or None,
                           givens=givens, **kwargs)
    used = {id(s) for s in fn.get_shared()}
    for s in sliceable:
        if id(s) not in used:
            raise ValueError(f"function: sliceable_shareds entry {s} is not used by this function")
    if gpu.uses_jax(fn) and rt.jax_before_fork:
        raise SynkStateError(
            "function: JAX already ran in this process before fork(), so the workers "
            "cannot run JAX-mode functions (their first JAX call would hang). Call "
            "synk.fork() before any JAX computation, or use another mode.")
    spec = execution.FunctionSpec(fn, inputs, bcast_inputs, out_vars, out_ops, return_list,
                                  upd_pairs, upd_ops, givens, sliceable, kwargs)
    f = Function(len(rt.registry.functions), spec)
    f.attach(rt)
    rt.registry.functions.append(f)
    return f


class Function:
    """A data-parallel function, made by ``synkhronos.function()``.

    Call it like a PyTensor function, with Data objects (or NumPy arrays) as
    inputs, once ``distribute()`` has run.
    """

    def __init__(self, ID, spec):
        self._ID = ID
        self.spec = spec
        self._scratch = {}  # per input: the Data a NumPy value is copied into
        self._wire = None   # the last call's (message, pickled bytes, ids of its Data)
        self._rt = None
        self._all_inputs = spec.inputs + spec.bcast_inputs
        self._what = f"call of {spec.fn.name or 'function'}"  # in profiles and stall errors
        self._dtypes = [np.dtype(v.dtype) for v in self._all_inputs]
        self._ndims = [v.ndim for v in self._all_inputs]

    def attach(self, rt):
        """Bind to run ``rt`` (in the master at function(), in each worker at distribute())."""
        self._rt = rt
        # Inputs are checked in the master (dtype, ndim) before any rank runs,
        # so PyTensor's per-call input validation is skipped.
        self.spec.fn.trust_input = True

    @property
    def name(self):
        """The name, as given to ``pytensor.function`` through ``name=``."""
        return self.spec.fn.name

    @property
    def output_modes(self):
        """The reduce op of each output."""
        return list(self.spec.output_ops)

    @property
    def update_modes(self):
        """The op that combines each update over slices."""
        return list(self.spec.update_ops)

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_scratch"] = {}
        state["_wire"] = None
        state["_rt"] = None
        return state

    def _detach(self):
        self._scratch = {}
        self._wire = None

    @serialized
    def as_theano(self, *args, **kwargs):
        """Call the underlying PyTensor function in the master only (updates apply there)."""
        args = [a.data if isinstance(a, data_module.Data) else a for a in args]
        kwargs = {k: v.data if isinstance(v, data_module.Data) else v for k, v in kwargs.items()}
        fn = self.spec.fn
        fn.trust_input = False  # user values: let PyTensor check and convert them
        try:
            out = fn(*args, **kwargs)
        finally:
            fn.trust_input = True
        return out if self.spec.return_list else out[0]

    @serialized
    def build_inputs(self, *args, force_cast=False, oversize=1.0, minibatch=False, **kwargs):
        """Make a Data object for each input from values given as for a call.

        Returns:
            One Data, or a list of them in input order (inputs, then bcast_inputs).
        """
        conditioning.check_bool(force_cast, "build_inputs: force_cast")
        conditioning.check_bool(minibatch, "build_inputs: minibatch")
        values = self._bind(args, kwargs, "build_inputs")
        out = [data_module.data(value=v, var=var, force_cast=force_cast, oversize=oversize,
                                minibatch=minibatch)
               for var, v in zip(self._all_inputs, values)]
        return out[0] if len(out) == 1 else out

    def _bind(self, args, kwargs, where):
        """Match positional and keyword arguments to inputs; return values in input order."""
        allvars = self._all_inputs
        if len(args) > len(allvars):
            raise TypeError(f"{where}: takes {len(allvars)} inputs; got {len(args)}")
        values = list(args) + [None] * (len(allvars) - len(args))
        names = {}
        for i, v in enumerate(allvars):
            if v.name:
                names.setdefault(v.name, []).append(i)
        for key, value in kwargs.items():
            if key not in names:
                raise TypeError(f"{where}: no input named {key!r}")
            if len(names[key]) > 1:
                raise TypeError(f"{where}: inputs {', '.join(map(str, names[key]))} are all "
                                f"named {key!r}, so {key}= is ambiguous; pass them by position")
            i = names[key][0]
            if i < len(args):
                raise TypeError(f"{where}: input {key!r} given twice")
            values[i] = value
        missing = [f"{allvars[i]} (input {i})" if len(names.get(allvars[i].name, ())) > 1
                   else str(allvars[i]) for i, v in enumerate(values) if v is None]
        if missing:
            raise TypeError(f"{where}: missing inputs: {', '.join(missing)}")
        return values

    @serialized
    def __call__(self, *args, output_subset=None, batch=None, batch_s=None, num_slices=1,
                 **kwargs):
        """Run on every rank over its share of the inputs; return reduced outputs.

        Scattered inputs are split as evenly as possible along axis 0 (views
        of contiguous ranges; with an index list each rank gathers its own
        rows).  ``bcast_inputs`` are used whole.  NumPy arrays are accepted
        and copied into shared memory first (a copy per call; pass Data to
        avoid it).

        Args:
            *args: Data (or arrays), in input order; ``**kwargs`` by input name.
            output_subset: indices of the outputs to compute and return.
            batch: rows to use, applied before scattering: an int ``k``
                (rows ``[:k]``), a slice, or a list / 1-d int array of
                indices.  Minibatch Data are selected by position: with an
                int or slice, shifted so the slice start maps to row 0; with
                an index list, row ``j`` pairs with ``batch[j]``.
            batch_s: rows of the ``sliceable_shareds`` to use, applied in
                each rank after scattering: one slice / list / array for all
                ranks, or a list with one per rank.
            num_slices: split each rank's rows into this many slices, run
                them one after another and accumulate outputs and updates
                (every slice sees the original values; updates apply once).
                A rank never runs more slices than it has rows, so slicing
                never costs more calls than rows.  A 0-d output under
                "gather" adds up its slices: still one value per rank.

        Returns:
            The outputs, reduced by their ops: one value, or a list as
            ``outputs`` was given.  A rank with no rows (fewer rows than
            ranks) does not run: it adds nothing to reductions, applies no
            updates, and appears as None under op None.  When the selection
            has no rows at all, the result is PyTensor's on the empty input
            (0 for a sum; a max raises, as it does in PyTensor).

        Raises:
            SynkStateError: before ``distribute()``, after ``close()``, or
                from inside a running call (a graph Op).
            TypeError, ValueError: bad inputs or call options (nothing runs).
            IndexError: ``batch`` indices past 2**63, or ``batch_s`` rows
                beyond the master's sliceable shareds (nothing runs).
            WorkerError: a rank raised; the runtime stays usable.
        """
        return run_call(self, args, kwargs, output_subset, batch, batch_s, num_slices, None)

    def then_all_reduce(self, shared_vars, op, then, dtype=None):
        """Return a callable that runs this function, an all-reduce and ``then`` as one command.

        The fused step of data-parallel training: every rank computes its
        share (writing, say, its gradient into a shared variable), all ranks
        all-reduce ``shared_vars`` inside the same command, and every rank
        calls ``then`` (a function without inputs, say the update).  One
        command and one pair of barriers instead of three.  The callable
        takes the arguments of ``__call__`` and returns this function's
        outputs.  Master only.

        Args:
            shared_vars: a shared variable, its name, or a list of either.
            op: "avg", "sum", "prod", "max" or "min".
            then: a synkhronos Function of the same run that takes no inputs.
            dtype: None, or "bfloat16" / "float16" to send the reduction in
                16 bits (as ``all_reduce(..., dtype=)``).

        Raises:
            TypeError: ``then`` is not a Function without inputs.
            ValueError: an unknown op.
        """
        if not isinstance(then, Function) or then._all_inputs:
            raise TypeError("then_all_reduce: then must be a synkhronos Function without "
                            f"inputs; got {then!r}")
        reducers.check_op(op, "then_all_reduce: op")
        if dtype is not None:
            compressed.check(dtype, op, [], "then_all_reduce")
        return FusedCall(self, shared_vars, op, then, dtype)
