"""Function: the object the user calls, and the master's side of the CALL command.

A call checks its arguments (``plan_call``, with the checks of
``call_inputs``), posts one ``CallMsg`` that every rank runs
(``rank_call``), and combines the ranks' results (``outputs``).  A loop
calling with the same Data sends the same message: the Function keeps it,
checked and pickled, and skips both the next time.
"""

import numpy as np

from .. import compat
from ..comm import compressed, reduce_ops
from ..errors import MachineLostError, SynkStateError
from ..inputs import conditioning, rank_rows
from ..inputs.create import data as new_data
from ..inputs.data_object import Data
from ..inputs.produced import place_call_inputs
from ..runtime import trace
from ..runtime.commands import Command
from ..runtime.run import run_command
from ..runtime.state import CALL_LOCK, serialized
from ..variables.access import resolve
from . import call_inputs, spread
from .outputs import collect
from .chunks import MasterChunks
from .kept import KeptCall, builds_together, share_runner, static_call
from .rank_call import CallMsg, Share, ThenMsg

_trace = trace.ON


class Function:
    """A data-parallel function, made by ``synkhronos.function()``.

    Call it like a PyTensor function, with Data objects (or NumPy arrays) as
    inputs, once ``distribute()`` has run: see ``__call__`` for ``batch``,
    ``batch_s`` and ``num_slices``.
    """

    def __init__(self, spec):
        self.spec = spec   # what every rank runs: the compiled PyTensor function and its parts
        self._rt = None
        self._scratch = {}  # per input: the Data a NumPy value is copied into
        self._kept = None   # the last call with Data only and no options (KeptCall)
        self._chunks = MasterChunks()  # its board, where calls run in chunks (chunks.py)
        self._together = False  # its first call: the master builds after posting (builds_together)
        self._all_inputs = spec.inputs + spec.bcast_inputs
        self.what = f"call of {spec.fn.name or 'function'}"  # in profiles and stall errors
        self._dtypes = [np.dtype(v.dtype) for v in self._all_inputs]
        self._ndims = [v.ndim for v in self._all_inputs]

    def attach(self, rt):
        """Bind to run ``rt`` (in the master at function(), in each worker at distribute())."""
        self._rt = rt
        # Inputs are checked in the master (dtype, ndim): no PyTensor checks at each call.
        self.spec.fn.trust_input = True

    def forget_run(self):
        """Drop what this Function keeps of its run (its messages and input copies); close() calls it."""
        self._scratch, self._kept = {}, None
        self._chunks.close()

    def __getstate__(self):
        state = dict(self.__dict__)
        state.update(_scratch={}, _kept=None, _chunks=MasterChunks(), _rt=None)
        return state

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

    @property
    def chunk_fit(self):
        """The latest chunked call's ``pace.Fit`` (chunks, each one's fixed cost, a row's time), or None."""
        return self._chunks.fit()

    def runtime(self):
        """Return the run this function belongs to, where it can be called now.  Master only.

        Raises:
            SynkStateError: the run is closed, not distributed yet, or busy in
                a call (from inside one of its graph Ops).
        """
        rt = self._rt
        if rt is None or rt.closed:
            raise SynkStateError("this function belongs to a closed synkhronos run; "
                                 "build it again after fork()")
        if not rt.registry.distributed:
            raise SynkStateError("call distribute() before calling synkhronos functions")
        if rt.in_call or not rt.is_master:   # inside a graph Op of a running call
            raise SynkStateError(f"{self.what}: no call inside a call; synkhronos functions "
                                 "run from the master's program only (called in rank "
                                 f"{rt.place.rank}{' while it ran a call' if rt.in_call else ''})")
        return rt

    @serialized
    def as_theano(self, *args, **kwargs):
        """Call the underlying PyTensor function in the master only (updates apply there).

        Args:
            *args: values (Data or arrays) for the inputs, in order; ``**kwargs``
                by input name.

        Returns:
            What the PyTensor function returns, on the master's whole inputs.
        """
        args = [a.data if isinstance(a, Data) else a for a in args]
        kwargs = {k: v.data if isinstance(v, Data) else v for k, v in kwargs.items()}
        fn = self.spec.ready()
        fn.trust_input = False  # user values: let PyTensor check and convert them
        try:
            out = fn(*args, **kwargs)
        finally:
            fn.trust_input = True
        return out if self.spec.return_list else out[0]

    @serialized
    def build_inputs(self, *args, force_cast=False, oversize=1.0, minibatch=False, **kwargs):
        """Make a Data object for each input from values given as for a call.

        Args:
            *args: values for the inputs, in order; ``**kwargs`` by input name.
            force_cast: cast values whatever they lose (as ``synk.data``).
            oversize: allocate this factor more (in [1, 2]).
            minibatch: make minibatch Data (see ``synk.data``).

        Returns:
            One Data, or a list of them in input order (inputs, then bcast_inputs).
        """
        conditioning.check_bool(force_cast, "build_inputs: force_cast")
        conditioning.check_bool(minibatch, "build_inputs: minibatch")
        values = self._bind(args, kwargs, "build_inputs")
        out = [new_data(value=v, var=var, force_cast=force_cast, oversize=oversize,
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

    def __call__(self, *args, output_subset=None, batch=None, batch_s=None, num_slices=1,
                 **kwargs):
        """Run on every rank over its share of the inputs; return reduced outputs.

        Scattered inputs are split as evenly as possible along axis 0 (views of contiguous
        ranges; with an index list each rank gathers its own rows).  ``bcast_inputs`` are
        used whole.  NumPy arrays are accepted and copied into shared memory first (a copy
        per call; pass Data to avoid it).

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
        # Reuse: no call options, the kept call's Data (KeptCall.ready; _run keeps calls).
        plain = (output_subset is None and batch is None and batch_s is None
                 and type(num_slices) is int and num_slices == 1 and not kwargs)
        kept = self._kept
        if plain and kept is not None and kept.rt is self._rt:
            with CALL_LOCK:
                if kept.ready(args):
                    return kept.run()
        return self._call(args, kwargs, output_subset, batch, batch_s, num_slices, plain)

    def _call(self, args, kwargs, output_subset, batch, batch_s, num_slices, plain):
        """``__call__``'s general path, a public entry point (its errors name ``__call__``)."""
        kept = self._kept   # a cluster's repeat
        if plain and kept is not None and kept.rt is self._rt and kept.ready(args, True):
            return kept.run()
        return self._run(args, kwargs, output_subset, batch, batch_s, num_slices, None, plain)
    _call.__qualname__ = "Function.__call__"
    _call = serialized(_call)

    def then_all_reduce(self, shared_vars, op, then, dtype=None):
        """Return a callable that runs this function, an all-reduce and ``then`` as one command.

        The fused step of data-parallel training: every rank computes its share (writing,
        say, its gradient into a shared variable), all ranks all-reduce ``shared_vars``
        inside the same command, and every rank calls ``then`` (a function without inputs,
        say the update).  One command and one pair of barriers instead of three.  The
        callable takes the arguments of ``__call__`` and returns this function's outputs.
        Master only.

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
        reduce_ops.check_op(op, "then_all_reduce: op")
        if dtype is not None:
            compressed.check_16bit(dtype, op, [], "then_all_reduce")
        return FusedCall(self, shared_vars, op, then, dtype)

    def plan_call(self, args, kwargs=None, output_subset=None, batch=None, batch_s=None,
                  num_slices=1):
        """Check a call's arguments in the master; return its ``CallMsg`` and the master's arrays.

        What ``__call__`` posts, without running it: NumPy inputs are copied into shared
        memory (in a cluster, sent to the machines that use them).

        Raises:
            TypeError, ValueError, IndexError: bad inputs or call options.
            MachineLostError: a machine was lost while inputs were sent (the call never began).
        """
        try:
            return self._plan_call(args, kwargs, output_subset, batch, batch_s, num_slices)
        except MachineLostError as exc:
            if exc.survived:  # lost while the inputs were sent: the call never began
                exc.settled(False, "the call did not start: call it again")
            raise

    def _plan_call(self, args, kwargs, output_subset, batch, batch_s, num_slices):
        rt = self.runtime()
        name = self.name or "function"
        spec = self.spec
        if spec.compile_at_first_call:
            spec.compile_at_first_call = False
            self._together = builds_together(rt)
            if not self._together:  # the ranks' first call loads the code compiled here
                compat.precompile(spec.ready())
            self._chunks.static_once()
        if kwargs or len(args) != len(self._all_inputs):
            args = self._bind(args, kwargs or {}, name)
        datas = []
        n_scattered = len(spec.inputs)
        spans = rt.peers.layout is not None
        for i, v in enumerate(args):
            # The common case inline: a live Data of the right type with memory.
            if type(v) is Data and v.ready_for(rt, self._dtypes[i], self._ndims[i]):
                datas.append(v)
            elif spans and i < n_scattered and not isinstance(v, Data):
                # Each machine will be sent only the rows its ranks use.
                datas.append(call_inputs.Rows(call_inputs.input_array(name, self._all_inputs[i], v)))
            else:
                datas.append(call_inputs.as_data(name, self._all_inputs[i], v, rt, self._scratch,
                                                 i, placed_ok=i < n_scattered))
        scattered = datas[:n_scattered]
        sel = None if batch is None else rank_rows.normalize_batch(batch)
        n_rows = call_inputs.check_lengths(name, spec.inputs, scattered, sel)
        if sel is not None:
            sel = rank_rows.resolve_selection(sel, call_inputs.common_length(scattered))
        plan = None
        if spans and any(type(d) is not Data for d in scattered):
            plan = place_call_inputs(rt, name, scattered, spec.inputs, sel, n_rows,
                                     self._scratch)
            datas[:n_scattered] = scattered
        if type(num_slices) is not int or num_slices != 1:
            call_inputs.check_num_slices(name, num_slices, spec)
        sel_s = subset = None
        if batch_s is not None:
            sel_s = call_inputs.check_batch_s(name, spec, batch_s, rt.place.rank, rt.place.n_parallel)
        if output_subset is not None:
            subset = call_inputs.check_subset(name, len(spec.outputs), output_subset)
        # tuple.__new__: a named tuple's own constructor runs Python code at every call.
        msg = tuple.__new__(CallMsg, (spec.id, [d.describe() for d in datas], n_scattered, sel,
                                      n_rows, sel_s, int(num_slices), subset, None, plan, None))
        return msg, [d.memory() for d in datas]

    def _run(self, args, kwargs, output_subset, batch, batch_s, num_slices, then, plain=False):
        """Run this function on every rank as one CALL command; return its reduced outputs.

        ``then``, if given, builds the ``ThenMsg`` of a fused step.  A ``plain`` call (no
        options: ``__call__``'s rule) with Data only is kept (``KeptCall``): its repeats
        with the same Data skip the checks, the pickling and the preparation.
        """
        rt = self.runtime()
        prof = rt.profiler
        if prof is not None:
            prof.begin(self.what)   # checking the arguments is the master's control overhead too
        try:
            msg, arrays = self.plan_call(args, kwargs, output_subset, batch, batch_s, num_slices)
            if then is not None:
                msg = msg._replace(then=then(rt))
            spec, together, self._together = self.spec, self._together, False
            if self._chunks.build_first(spec, rt, msg):  # every rank builds it first (static_once)
                static_call(spec, rt, msg, arrays, self.what, together)
                together = False
            msg, first = self._chunks.plan_for(spec, rt, msg, arrays)  # chunks.py, where they apply
            kept = None
            if (plain and then is None and not together and len(args) == len(self._all_inputs)
                    and all(type(a) is Data for a in args) and Share.reusable_for(spec, msg)):
                old = self._kept
                kept = KeptCall(self, rt, msg, arrays,
                                old.kept if old is not None and old.msg == msg
                                else rt.control.keep(Command.CALL, msg), self._chunks.board)
                self._kept = kept
                if prof is None:
                    return kept.run(first)
                kept = kept.kept  # posted as kept; run the long way, which books the profile's laps
            if _trace:
                trace.stamp(trace.CHECKED)
            if msg.chunks is not None:  # chunks.py; a cluster's spread over its ranks: spread.py
                run = self._chunks.run if msg.chunks.name else spread.run
                return run(spec, rt, msg, arrays, first, self.what, kept)
            return run_command(rt, Command.CALL, msg, share_runner(spec, rt, msg, arrays, together),
                               lambda mine: collect(spec, rt, mine, msg.subset, self.name or "function"),
                               what=self.what, kept=kept)
        finally:
            if prof is not None:
                prof.end("control")


class FusedCall:
    """A function call fused with an all-reduce and a follow-up call (``then_all_reduce``)."""

    def __init__(self, f, shared_vars, op, then, dtype):
        self.f = f
        self.shared_vars = shared_vars
        self.op = op
        self.then = then
        self.dtype = dtype

    def _then(self, rt):
        if self.then._rt is not rt:
            raise ValueError("then_all_reduce: then belongs to another synkhronos run")
        idx, _ = resolve(rt, self.shared_vars, "then_all_reduce")
        if self.dtype is not None:
            shareds = rt.registry.shareds
            compressed.check_16bit(self.dtype, self.op, [(shareds[i], shareds[i].dtype) for i in idx],
                             "then_all_reduce")
        return ThenMsg(idx, self.op, self.then.spec.id, self.dtype)

    @serialized
    def __call__(self, *args, output_subset=None, batch=None, batch_s=None, num_slices=1,
                 **kwargs):
        """Run the fused step; arguments and result as for ``Function.__call__``."""
        return self.f._run(args, kwargs, output_subset, batch, batch_s, num_slices, self._then)
