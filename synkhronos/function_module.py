"""synk.function and Function: build, call (scatter, slices, reduction), output modes."""

import logging
import numbers

import numpy as np
import pytensor
import pytensor.tensor as pt
from pytensor.compile import SharedVariable
from pytensor.graph.basic import Variable

from . import reducers, split
from . import data_module
from .control import Command, handler, run_command
from .errors import SynkStateError
from .runtime import require_forked

logger = logging.getLogger(__name__)


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
        SynkStateError: not forked yet, or already distributed (a ``RuntimeError``).
        TypeError: an argument of the wrong form.
        ValueError: an unknown reduce op, or a sliceable shared variable the
            function does not use.
    """
    rt = require_forked("function()")
    if rt.distributed:
        raise SynkStateError("function() must be called before distribute()")
    inputs = _var_list(inputs, "inputs")
    bcast_inputs = _var_list(bcast_inputs, "bcast_inputs")
    seen = set()
    for v in inputs + bcast_inputs:
        if id(v) in seen:
            raise ValueError(f"function: variable {v} appears twice among inputs and bcast_inputs")
        seen.add(id(v))
    out_vars, out_ops, return_list = _parse_outputs(outputs)
    upd_pairs, upd_ops = _parse_updates(updates)
    sliceable = _var_list(sliceable_shareds, "sliceable_shareds", shared=True)
    if rt.device == "gpu":
        # GPU mode: shared variables live on the device as JAX arrays.
        kwargs.setdefault("mode", "JAX")
    fn = pytensor.function(inputs + bcast_inputs, out_vars, updates=upd_pairs or None,
                           givens=givens, **kwargs)
    used = {id(s) for s in fn.get_shared()}
    for s in sliceable:
        if id(s) not in used:
            raise ValueError(f"function: sliceable_shareds entry {s} is not used by this function")
    f = Function(len(rt.functions), fn, inputs, bcast_inputs, out_vars, out_ops, return_list,
                 upd_pairs, upd_ops, givens, sliceable, kwargs)
    f._rt = rt
    rt.functions.append(f)
    return f


def _var_list(value, what, shared=False):
    if value is None:
        return []
    if isinstance(value, Variable):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"function: {what} must be a variable or a list of variables; "
                        f"got {type(value).__name__}")
    for v in value:
        if not isinstance(v, Variable):
            raise TypeError(f"function: {what} must hold PyTensor variables; got {type(v).__name__}")
        if shared and not isinstance(v, SharedVariable):
            raise TypeError(f"function: {what} must hold shared variables; got {v}")
        if not shared and isinstance(v, SharedVariable):
            raise TypeError(f"function: {what} cannot hold shared variable {v}; "
                            "shared variables are implicit inputs")
    return list(value)


def _is_op_pair(x):
    return (isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], Variable)
            and (x[1] is None or isinstance(x[1], str)))


def _parse_outputs(outputs):
    if outputs is None:
        return [], [], True
    single = isinstance(outputs, Variable) or _is_op_pair(outputs)
    entries = [outputs] if single else outputs
    if not isinstance(entries, (list, tuple)):
        raise TypeError(f"function: outputs must be a variable, a (variable, op) pair or a "
                        f"list of them; got {type(outputs).__name__}")
    out_vars, out_ops = [], []
    for e in entries:
        if _is_op_pair(e):
            var, op = e
        elif isinstance(e, Variable):
            var, op = e, "avg"
        else:
            raise TypeError(f"function: each output must be a variable or a (variable, op) "
                            f"pair; got {e!r}")
        out_vars.append(var)
        out_ops.append(reducers.check_op(op, "function: output op", reducers.OUTPUT_OPS))
    return out_vars, out_ops, not single


def _parse_updates(updates):
    if updates is None:
        return [], []
    if isinstance(updates, dict):
        updates = list(updates.items())
    if not isinstance(updates, (list, tuple)):
        raise TypeError("function: updates must be a list of (shared, update) pairs or "
                        f"(shared, update, op) triples; got {type(updates).__name__}")
    pairs, ops = [], []
    for u in updates:
        if not isinstance(u, (list, tuple)) or len(u) not in (2, 3):
            raise TypeError("function: each update must be a (shared, update) pair or a "
                            f"(shared, update, op) triple; got {u!r}")
        if not isinstance(u[0], SharedVariable):
            raise TypeError(f"function: an update must target a shared variable; got {u[0]!r}")
        op = u[2] if len(u) == 3 else "avg"
        ops.append(reducers.check_op(op, "function: update op"))
        pairs.append((u[0], u[1]))
    return pairs, ops


class Function:
    """A data-parallel function, made by ``synkhronos.function()``.

    Call it like a PyTensor function, with Data objects (or NumPy arrays) as
    inputs, once ``distribute()`` has run.
    """

    def __init__(self, ID, fn, inputs, bcast_inputs, outputs, output_ops, return_list,
                 updates, update_ops, givens, sliceable, kwargs):
        self._ID = ID
        self._fn = fn
        self._inputs = inputs
        self._bcast_inputs = bcast_inputs
        self._outputs = outputs
        self._output_ops = output_ops
        self._return_list = return_list
        self._updates = updates
        self._update_ops = update_ops
        self._givens = givens
        self._sliceable = sliceable
        self._kwargs = kwargs
        self._variants = {}
        self._scratch = {}
        self._rt = None
        self._all_inputs = inputs + bcast_inputs
        self._simple = len(outputs) == 1 and output_ops[0] in reducers.COLLECTIVE_OPS
        # Inputs are checked in the master (dtype, ndim) before any rank runs,
        # so PyTensor's per-call input validation is skipped.
        fn.trust_input = True
        self._dtypes = [np.dtype(v.dtype) for v in self._all_inputs]
        self._ndims = [v.ndim for v in self._all_inputs]

    # ---- reference properties -----------------------------------------
    @property
    def name(self):
        """The name, as given to ``pytensor.function`` through ``name=``."""
        return self._fn.name

    @property
    def output_modes(self):
        """The reduce op of each output."""
        return list(self._output_ops)

    @property
    def update_modes(self):
        """The op that combines each update over slices."""
        return list(self._update_ops)

    # ---- pickling for distribute() ------------------------------------
    def __getstate__(self):
        state = dict(self.__dict__)
        state["_variants"] = {}
        state["_scratch"] = {}
        state["_rt"] = None
        return state

    def _detach(self):
        self._scratch = {}

    # ---- calls in the master only ---------------------------------------
    def as_theano(self, *args, **kwargs):
        """Call the underlying PyTensor function in the master only (updates apply there)."""
        args = [a.data if isinstance(a, data_module.Data) else a for a in args]
        kwargs = {k: v.data if isinstance(v, data_module.Data) else v for k, v in kwargs.items()}
        self._fn.trust_input = False  # user values: let PyTensor check and convert them
        try:
            out = self._fn(*args, **kwargs)
        finally:
            self._fn.trust_input = True
        return out if self._return_list else out[0]

    def build_inputs(self, *args, force_cast=False, oversize=1.0, minibatch=False, **kwargs):
        """Make a Data object for each input from values given as for a call.

        Returns:
            One Data, or a list of them in input order (inputs, then bcast_inputs).
        """
        values = self._bind(args, kwargs, "build_inputs")
        out = [data_module.data(value=v, var=var, force_cast=force_cast, oversize=oversize,
                                minibatch=minibatch)
               for var, v in zip(self._inputs + self._bcast_inputs, values)]
        return out[0] if len(out) == 1 else out

    def _bind(self, args, kwargs, where):
        """Match positional and keyword arguments to inputs; return values in input order."""
        allvars = self._inputs + self._bcast_inputs
        if len(args) > len(allvars):
            raise TypeError(f"{where}: takes {len(allvars)} inputs; got {len(args)}")
        values = list(args) + [None] * (len(allvars) - len(args))
        names = {v.name: i for i, v in enumerate(allvars) if v.name}
        for key, value in kwargs.items():
            if key not in names:
                raise TypeError(f"{where}: no input named {key!r}")
            i = names[key]
            if i < len(args):
                raise TypeError(f"{where}: input {key!r} given twice")
            values[i] = value
        missing = [str(allvars[i]) for i, v in enumerate(values) if v is None]
        if missing:
            raise TypeError(f"{where}: missing inputs: {', '.join(missing)}")
        return values

    # ---- data-parallel call ---------------------------------------------
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

        Returns:
            The outputs, reduced by their ops: one value, or a list as
            ``outputs`` was given.  A rank with no rows (fewer rows than
            ranks) does not run: it adds nothing to reductions, applies no
            updates, and appears as None under op None.

        Raises:
            SynkStateError: before ``distribute()``, or after ``close()``.
            TypeError, ValueError: bad inputs or call options (nothing runs).
            WorkerError: a rank raised; the runtime stays usable.
        """
        rt = self._rt
        if rt is None or rt.closed:
            raise SynkStateError("this function belongs to a closed synkhronos run; "
                                 "build it again after fork()")
        if not rt.distributed:
            raise SynkStateError("call distribute() before calling synkhronos functions")
        msg = self._prepare(rt, args, kwargs, output_subset, batch, batch_s, num_slices)
        return run_command(rt, Command.CALL, msg, lambda seq: self._execute(rt, msg),
                           lambda mine: self._collect(rt, mine, msg[-1]))

    def _prepare(self, rt, args, kwargs, output_subset, batch, batch_s, num_slices):
        """Check everything in the master and build the call message."""
        if kwargs or len(args) != len(self._all_inputs):
            args = self._bind(args, kwargs, self.name or "function")
        datas = []
        for i, v in enumerate(args):
            # The common case inline: a live Data of the right type with memory.
            if (type(v) is data_module.Data and v._rt is rt and v._data is not None
                    and v._dtype == self._dtypes[i] and v._ndim == self._ndims[i]):
                datas.append(v)
            else:
                datas.append(self._as_data(rt, i, v))
        n_scattered = len(self._inputs)
        scattered = datas[:n_scattered]
        sel = None if batch is None else split.normalize_batch(batch)
        n_rows = self._check_lengths(scattered, sel)
        if sel is not None:
            sel = split.resolve(sel, _common_length(scattered))
        if type(num_slices) is not int or num_slices != 1:
            if not (isinstance(num_slices, numbers.Integral) and not isinstance(num_slices, bool)
                    and num_slices >= 1):
                raise ValueError(f"{self.name or 'function'}: num_slices must be an int >= 1; "
                                 f"got {num_slices!r}")
            if num_slices > 1 and None in self._output_ops:
                raise ValueError(f"{self.name or 'function'}: num_slices > 1 cannot combine the "
                                 "slices of an output with op None; use 'gather' or a reduce op")
        sel_s = None
        if batch_s is not None:
            if not self._sliceable:
                raise ValueError(f"{self.name or 'function'}: batch_s needs sliceable_shareds "
                                 "in function()")
            sel_s = split.normalize_batch_s(batch_s, rt.n_parallel)
        subset = None
        if output_subset is not None:
            subset = self._check_subset(output_subset)
        descs = [(d._ID, d._dtype.str, d._data.shape, d._minibatch) for d in datas]
        return (self._ID, descs, n_scattered, sel, n_rows, sel_s, int(num_slices), subset)

    def _check_subset(self, output_subset):
        try:
            subset = [int(i) for i in output_subset]
        except (TypeError, ValueError):
            subset = None
        n = len(self._outputs)
        if subset is None or any(not 0 <= i < n for i in subset) or len(set(subset)) != len(subset):
            raise ValueError(f"{self.name or 'function'}: output_subset must list distinct "
                             f"indices in range({n}); got {output_subset!r}")
        return subset

    def _as_data(self, rt, i, value):
        """Return ``value`` as a Data for input ``i``, or raise naming what is wrong."""
        var = self._all_inputs[i]
        name = self.name or "function"
        if isinstance(value, data_module.Data):
            if value._rt is not rt:
                raise ValueError(f"{name}: input {var} is a Data object of a closed run")
            if value.dtype != np.dtype(var.dtype):
                raise TypeError(f"{name}: input {var} needs dtype {var.dtype}; "
                                f"got Data of {value.dtype}")
            if value.ndim != var.ndim:
                raise TypeError(f"{name}: input {var} needs ndim {var.ndim}; "
                                f"got Data of ndim {value.ndim}")
            if value.data is None:
                raise ValueError(f"{name}: input {var} is a Data object holding no memory")
            return value
        if isinstance(value, np.ndarray) or np.isscalar(value) or isinstance(value, (list, tuple)):
            arr = np.asarray(value)
            if arr.dtype != np.dtype(var.dtype):
                # Same rule as pytensor: only lossless casts happen silently.
                if not np.can_cast(arr.dtype, var.dtype, "safe"):
                    raise TypeError(f"{name}: input {var} needs dtype {var.dtype}; got {arr.dtype}")
                arr = arr.astype(var.dtype)
            if arr.ndim != var.ndim:
                raise TypeError(f"{name}: input {var} needs ndim {var.ndim}; got ndim {arr.ndim}")
            scratch = self._scratch.get(i)
            if scratch is None or scratch._rt is not rt:
                scratch = data_module.data(value=arr, var=var, oversize=1.5)
                self._scratch[i] = scratch
            else:
                scratch.set_value(arr, oversize=1.5)
            return scratch
        raise TypeError(f"{name}: input {var} must be a synkhronos Data or a NumPy array; "
                        f"got {type(value).__name__}")

    def _check_lengths(self, scattered, sel):
        """Check every scattered input against the selection; return the rows selected."""
        name = self.name or "function"
        if sel is None and len(scattered) == 1 and scattered[0]._ndim:
            return len(scattered[0]._data)
        if not scattered:
            if sel is not None:
                raise ValueError(f"{name}: batch needs at least one scattered input")
            return 0
        for d, var in zip(scattered, self._inputs):
            if d.ndim == 0:
                raise ValueError(f"{name}: input {var} is 0-d and cannot be scattered; "
                                 "put it in bcast_inputs")
        full = [(d, v) for d, v in zip(scattered, self._inputs) if not (d.minibatch and sel is not None)]
        if sel is None:
            lengths = {len(d) for d in scattered}
            if len(lengths) > 1:
                desc = ", ".join(f"{v}: {len(d)}" for d, v in zip(scattered, self._inputs))
                raise ValueError(f"{name}: scattered inputs must have equal lengths; got {desc}")
            return lengths.pop()
        if full:
            length = min(len(d) for d, _ in full)
            need = split.rows_needed(sel, length)
            for d, v in full:
                if len(d) < need:
                    raise ValueError(f"{name}: batch needs {need} rows but input {v} has {len(d)}")
            n_rows = split.selection_length(sel, length)
        else:
            if sel[0] == "range" and sel[2] is None:
                raise ValueError(f"{name}: an open-ended batch slice needs a non-minibatch input")
            n_rows = split.selection_length(sel, 0)
        for d, v in zip(scattered, self._inputs):
            if d.minibatch and len(d) < n_rows:
                raise ValueError(f"{name}: minibatch input {v} has {len(d)} rows; "
                                 f"batch selects {n_rows}")
        return n_rows

    # ---- on every rank -------------------------------------------------
    def _execute(self, rt, msg):
        """Run this rank's share of a call and take part in the reduction."""
        _, descs, n_scattered, sel, n_rows, sel_s, num_slices, subset = msg
        rank = rt.rank
        if rt.is_master:
            datas = rt.datas
            arrays = [datas[desc[0]]._data for desc in descs]
        else:
            arrays = [data_module.view(rt, desc) for desc in descs]
        rows = None
        if n_scattered:
            lo, hi = split.rank_range(n_rows, rt.n_parallel, rank)
            for i in range(n_scattered):
                arrays[i] = split.take(arrays[i], sel, lo, hi, descs[i][3] and sel is not None)
            rows = hi - lo
        shared_sel = None
        if self._sliceable and (sel_s is not None or num_slices > 1):
            shared_sel = []
            for s in self._sliceable:
                value = s.get_value(borrow=True)
                my = None if sel_s is None else sel_s[rank]
                my = split.resolve(my, len(value))
                length = split.selection_length(my, len(value))
                if my is not None and split.rows_needed(my, len(value)) > len(value):
                    raise IndexError(f"batch_s selects row {split.rows_needed(my, len(value)) - 1}"
                                     f" but shared variable {s} has {len(value)} rows in rank {rank}")
                shared_sel.append((value, my, length))
            if rows is None:
                rows = shared_sel[0][2]
        elif self._sliceable and rows is None:
            # Weigh "avg" by the shared rows used, as with batch_s.
            rows = len(self._sliceable[0].get_value(borrow=True))
        out_idx = list(range(len(self._outputs))) if subset is None else subset
        if rows == 0:
            results = None
        elif shared_sel is None and (num_slices == 1 or not n_scattered):
            results = self._fn(*arrays)
            if subset is not None:
                # PyTensor 3 functions take no output_subset: compute all, keep some.
                results = [results[i] for i in subset]
        else:
            results = self._run_slices(arrays, n_scattered, shared_sel, num_slices, out_idx)
        weight = 1.0 if rows is None else float(rows)
        if results is not None:
            # Backends other than NumPy's (JAX) return their own array types.
            results = [r if type(r) is np.ndarray else np.asarray(r) for r in results]
        if rt.is_master:
            return None if results is None else (results, weight)
        rt.backend.contribute(results, weight)

    def _variant(self, slice_shareds, defer):
        """Compile (once per process) the function used for batch_s and slicing."""
        key = (slice_shareds, defer)
        fn = self._variants.get(key)
        if fn is None:
            ins = self._inputs + self._bcast_inputs
            givens = dict(self._givens.items() if isinstance(self._givens, dict)
                          else (self._givens or []))
            if slice_shareds:
                reps = [pt.tensor(dtype=s.dtype, shape=(None,) * s.ndim, name=f"{s.name}_slice")
                        for s in self._sliceable]
                givens.update(zip(self._sliceable, reps))
                ins = ins + reps
            outs = list(self._outputs)
            updates = self._updates or None
            if defer:
                outs += [u for _, u in self._updates]
                updates = None
            fn = pytensor.function(ins, outs, updates=updates, givens=givens or None, **self._kwargs)
            fn.trust_input = True
            self._variants[key] = fn
        return fn

    def _run_slices(self, arrays, n_scattered, shared_sel, num_slices, out_idx):
        defer = num_slices > 1
        fn = self._variant(shared_sel is not None, defer)
        n_out = len(self._outputs)
        scat_len = len(arrays[0]) if n_scattered else None
        scat_parts = split.split_ranges(scat_len, num_slices) if n_scattered else None
        sh_parts = [split.split_ranges(length, num_slices) for _, _, length in shared_sel] \
            if shared_sel else None
        acc_out = [None] * n_out
        acc_upd = [None] * len(self._updates)
        w_acc = 0.0
        for k in range(num_slices):
            call = list(arrays)
            if n_scattered:
                lo, hi = scat_parts[k]
                for i in range(n_scattered):
                    call[i] = arrays[i][lo:hi]
                w = float(hi - lo)
            if shared_sel:
                for j, (value, my, _) in enumerate(shared_sel):
                    lo, hi = sh_parts[j][k]
                    call.append(split.take(value, my, lo, hi))
                if not n_scattered:
                    w = float(sh_parts[0][k][1] - sh_parts[0][k][0])
            if w == 0 and num_slices > 1:
                continue
            res = fn(*call)
            if not defer:
                return [res[i] for i in out_idx]
            for i in out_idx:
                acc_out[i] = _fold(self._output_ops[i], acc_out[i], res[i], w_acc, w)
            for j, op in enumerate(self._update_ops):
                acc_upd[j] = reducers.accumulate(op, acc_upd[j], res[n_out + j], w_acc, w)
            w_acc += w
        for (var, _), value in zip(self._updates, acc_upd):
            if value is not None:
                var.set_value(value, borrow=True)
        return [_finish_fold(self._output_ops[i], acc_out[i]) for i in out_idx]

    def _collect(self, rt, mine, subset):
        """In the master, after the end barrier: combine every rank's results by op."""
        if not self._outputs:
            return []
        parts = rt.backend.collect()
        parts[rt.rank] = mine
        if self._simple and subset is None and None not in parts:
            # Fast path: one reducible output, every rank contributed.
            values = [p[0][0] for p in parts]
            if len({v.shape for v in values}) == 1:
                out = reducers.combine(self._output_ops[0], values, [p[1] for p in parts])
                return [out] if self._return_list else out
        out_idx = range(len(self._outputs)) if subset is None else subset
        final = []
        for j, i in enumerate(out_idx):
            op = self._output_ops[i]
            if op is None:
                final.append([None if p is None else np.array(p[0][j]) for p in parts])
                continue
            have = [p for p in parts if p is not None]
            if op == "gather":
                final.append(_concat([p[0][j] for p in have]))
                continue
            if not have:
                final.append(None)
                continue
            values = [p[0][j] for p in have]
            shapes = {v.shape for v in values}
            if len(shapes) > 1:
                raise ValueError(
                    f"{self.name or 'function'}: output {i} has different shapes across ranks "
                    f"({', '.join(str(v.shape) for v in values)}); op {op!r} needs equal shapes "
                    "(use 'gather' or None)")
            final.append(reducers.combine(op, values, [p[1] for p in have]))
        return final if self._return_list else final[0]


def _fold(op, acc, value, w_acc, w):
    if op == "gather":
        return (acc or []) + [np.asarray(value)]
    return reducers.accumulate(op, acc, value, w_acc, w)


def _finish_fold(op, acc):
    if op == "gather":
        return _concat(acc)
    return acc


def _concat(parts):
    if not parts:
        return None
    if np.ndim(parts[0]) == 0:
        return np.stack(parts)
    return np.concatenate(parts, axis=0)


def _common_length(scattered):
    full = [d for d in scattered if not d.minibatch]
    return min(len(d) for d in (full or scattered))


@handler(Command.CALL)
def _call_worker(rt, msg):
    rt.functions[msg[0]]._execute(rt, msg)
