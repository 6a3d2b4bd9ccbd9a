"""PyTensor version differences: the one place that knows which PyTensor is installed.

synkhronos supports PyTensor 2.36 (the release that removed ``AbstractConv``)
through 3.x.  What differs between them, as far as synkhronos is concerned:

- PyTensor 2.x functions take ``output_subset=`` and compute only those
  outputs (2.36-2.38 warn that it is deprecated); PyTensor 3 removed the
  argument (compute all, keep some).
- The default linker: 2.x compiles with the C VM (``cvm``, needs g++), 3.x
  with Numba.  Both run the same graphs; only reports name the difference.
- Module paths of compiled functions moved (``pytensor.compile.function.types``
  in 2.x, ``pytensor.compile.executor`` in 3.x); code here and in the core uses
  the public names only (``pytensor.compile.Function``).
- PyTensor 2.38's Numba backend rewrites an ``OpFromGraph``'s shared inner
  graph in place; graphs compiled here get ops of their own first
  (``private_inner_graphs``).

Every other module asks this one instead of testing ``pytensor.__version__``.
"""

import functools
import inspect
import re
import warnings

import pytensor

MIN_PYTENSOR = (2, 36)
"""Lowest supported PyTensor (major, minor); pyproject.toml pins the same."""

MAX_PYTENSOR_MAJOR = 3
"""Highest supported PyTensor major version."""


def parse_version(text):
    """Return ``(major, minor, patch)`` from a version string (``"2.38.3"``, ``"3.0.7.dev1"``).

    Missing or non-numeric parts count as 0.
    """
    parts = []
    for piece in str(text).split(".")[:3]:
        m = re.match(r"\d+", piece)
        parts.append(int(m.group()) if m else 0)
    while len(parts) < 3:
        parts.append(0)
    return tuple(parts)


PYTENSOR_VERSION = parse_version(pytensor.__version__)
"""The installed PyTensor as ``(major, minor, patch)``."""


def is_supported(version=PYTENSOR_VERSION):
    """Return True if ``version`` (a tuple) lies in the supported range."""
    return MIN_PYTENSOR <= tuple(version[:2]) and version[0] <= MAX_PYTENSOR_MAJOR


@functools.lru_cache(maxsize=None)
def _takes_output_subset(fn_type):
    try:
        return "output_subset" in inspect.signature(fn_type.__call__).parameters
    except (TypeError, ValueError):
        return False


def takes_output_subset(fn):
    """Return True if the compiled function ``fn`` accepts ``output_subset=`` (PyTensor 2.x)."""
    return _takes_output_subset(type(fn))


def call_subset(fn, args, subset):
    """Call the compiled function ``fn`` on ``args``; return the outputs listed in ``subset``.

    Args:
        fn: a compiled ``pytensor.compile.Function`` with a list of outputs.
        args: its positional inputs.
        subset: output indices to return, in this order, or None for all.

    Returns:
        The list of outputs.  Where PyTensor still takes ``output_subset``
        (2.x) only those outputs are computed; PyTensor 3 computes every
        output and the others are dropped.
    """
    if subset is None:
        return fn(*args)
    if takes_output_subset(fn):
        # 2.36-2.38 warn on every such call that the argument is going away;
        # that is this module's business, not the user's.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "output_subset is deprecated", FutureWarning)
            return fn(*args, output_subset=list(subset))
    results = fn(*args)
    return [results[i] for i in subset]


def default_linker():
    """Return the name of the linker PyTensor's default mode compiles with.

    For example ``"numba"`` (PyTensor 3), ``"cvm"`` (2.x with g++), ``"vm"``
    (2.x without a C compiler), ``"jax"`` or ``"c|py"``.
    """
    from pytensor.compile.mode import get_default_mode

    return linker_name(get_default_mode())


def linker_name(mode):
    """Return the name of the linker ``mode`` (a PyTensor ``Mode``) compiles with, as
    ``default_linker`` names them."""
    name = type(mode.linker).__name__
    known = {"NumbaLinker": "numba", "JAXLinker": "jax", "PytorchLinker": "pytorch",
             "MLXLinker": "mlx", "OpWiseCLinker": "c|py", "CLinker": "c",
             "PerformLinker": "py"}
    if name in known:
        return known[name]
    if name == "VMLinker":
        c_thunks = getattr(mode.linker, "c_thunks", None)
        if c_thunks is None:
            c_thunks = bool(pytensor.config.cxx)
        return "cvm" if c_thunks else "vm"
    return name


def default_mode_name():
    """Return ``pytensor.config.mode`` as a string (``"Mode"``, ``"FAST_RUN"``, ``"NUMBA"``...)."""
    mode = pytensor.config.mode
    return mode if isinstance(mode, str) else type(mode).__name__


def blas_ldflags():
    """Return the BLAS link flags PyTensor's C code uses ("" where it links none).

    Reading the flag makes PyTensor 2.x probe for a BLAS once and warn if it
    finds none; the warning is silenced here, since the empty string says it.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return str(pytensor.config.blas__ldflags)
        except Exception as exc:  # noqa: BLE001 - a report, not a failure
            return f"unknown ({type(exc).__name__}: {exc})"


def ancestors(variables):
    """Return an iterator over ``variables`` and every variable they depend on.

    PyTensor 2.38 moved ``ancestors`` from ``pytensor.graph.basic`` to
    ``pytensor.graph.traversal`` (the old name warns, and goes later).
    """
    try:
        from pytensor.graph.traversal import ancestors as _ancestors
    except ImportError:  # PyTensor < 2.38
        from pytensor.graph.basic import ancestors as _ancestors
    return _ancestors(variables)


def clone_replace(output, replace, strict=True):
    """Return a copy of the graph ``output`` with the variables in ``replace`` substituted.

    ``pytensor.clone_replace`` is gone from PyTensor 3.1's top level; the
    function lives in ``pytensor.graph.replace`` in every supported release.
    ``strict=False`` rebuilds every node above a replacement whose type
    differs (a constant's static shape replaced by an input of any length),
    instead of asserting the old static shape on the new variable
    (``rebuilt``).
    """
    if not strict:
        return rebuilt(output, replace)
    from pytensor.graph.replace import clone_replace as _clone_replace
    return _clone_replace(output, replace=replace, rebuild_strict=strict)


def rebuilt(output, replace, override=None):
    """``output`` (a variable or a list) rebuilt above ``replace``'s variables for their types.

    Each node above a replacement is made again from its new inputs, so its
    outputs' static shapes follow them.  PyTensor's own ``rebuild_strict=False``
    keeps an ``OpFromGraph``'s input types, asserting them on the new inputs
    (``SpecifyShape``): PyTensor 3.3's ``LogSumExp`` is one, so a NormalMixture
    observed on 1000 rows asserted 1000 rows on a rank's share.  Here such an
    op built from its inputs' types (``SymbolicOp``) is called again instead,
    and a shape assertion above a replacement is dropped: it asserted the old
    shape.  ``override(node, new_inputs)``, where given, may make a node's new outputs
    itself (else it returns None).
    """
    from pytensor.tensor.shape import SpecifyShape

    def remake(node, new_inputs):
        if override is not None and (outs := override(node, new_inputs)) is not None:
            return outs
        if all(a is b for a, b in zip(new_inputs, node.inputs)):
            return node.outputs
        if isinstance(node.op, SpecifyShape):
            return [new_inputs[0]]
        if hasattr(node.op, "build_inner_graph"):   # a SymbolicOp: built for the input types
            outs = node.op(*new_inputs)
            return list(outs) if isinstance(outs, (list, tuple)) else [outs]
        return node.op.make_node(*new_inputs).outputs
    return _remade(output, dict(replace), remake)


def private_inner_graphs(output):
    """``output`` (a variable or a list) with a copy of every ``OpFromGraph`` in it (its inner
    graph cloned), so that compiling it changes no graph but this one.

    PyTensor 2.38's Numba backend rewrites an ``OpFromGraph``'s own inner graph
    in place (inplace operations added), and the op is shared: by every graph
    of the model, and by every gradient of it (``OpFromGraph`` caches its
    gradient's op).  A later compile of the same graph in C then fails, "Graph
    must not contain inplace operations" (an LKJ prior's ``AllocDiag``, compiled
    in Numba then in C: ``tests/extensions/test_pymc_gallery.py``'s ``lkj``).
    PyTensor 3.x clones the inner graph first.
    """
    import copy

    from pytensor.compile.builders import OpFromGraph

    def remake(node, new_inputs):
        op = node.op
        if isinstance(op, OpFromGraph):
            op = op.clone()   # PyTensor 3's inner graphs are frozen: the op itself
        elif isinstance(getattr(op, "core_op", None), OpFromGraph):   # vectorised (Blockwise)
            core = op.core_op.clone()
            if core is not op.core_op:
                op = copy.copy(op)
                op.core_op = core
        if op is node.op and all(a is b for a, b in zip(new_inputs, node.inputs)):
            return node.outputs
        return op.make_node(*new_inputs).outputs
    return _remade(output, {}, remake)


def _remade(output, memo, remake):
    """``output`` (a variable or a list) with each node, from the inputs up, made again by
    ``remake(node, new_inputs)`` (its new outputs); ``memo`` maps variables already replaced."""
    outputs = output if isinstance(output, (list, tuple)) else [output]
    stack = list(outputs)
    while stack:
        v = stack[-1]
        if v in memo:
            stack.pop()
            continue
        node = v.owner
        if node is None:
            memo[v] = v
            stack.pop()
            continue
        pending = [i for i in node.inputs if i not in memo]
        if pending:
            stack.extend(pending)
            continue
        stack.pop()
        for old, new in zip(node.outputs, remake(node, [memo[i] for i in node.inputs])):
            memo[old] = new
    got = [memo[o] for o in outputs]
    return got if isinstance(output, (list, tuple)) else got[0]


def scan(fn, sequences, mode=None):
    """``pytensor.scan(fn, sequences)``'s outputs (no updates), the loop's body compiled in ``mode``.

    PyTensor 2.38+ warn unless told the new return form
    (``return_updates=False``), which 2.36-2.37 lack.  3.3 compiles the body
    as the function around it and warns that ``mode=`` is deprecated (it
    still honours it): the warning is this module's business, not the
    user's; where the argument is gone, the body inherits the mode anyway.
    """
    params = inspect.signature(pytensor.scan).parameters
    kwargs = {"return_updates": False} if "return_updates" in params else {}
    if mode is not None and "mode" in params:
        kwargs["mode"] = mode
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The `mode` argument of `scan` is deprecated",
                                FutureWarning)
        out = pytensor.scan(fn, sequences=sequences, **kwargs)
    return out if "return_updates" in kwargs else out[0]


def infer_shape(method):
    """Decorate an Op's ``infer_shape(self, node, shapes)`` so that every supported PyTensor can call it.

    PyTensor before 3.3 calls ``infer_shape(fgraph, node, shapes)``; 3.3 calls
    ``infer_shape(node, shapes)`` and warns (DeprecationWarning, at class
    creation) about a method whose signature still names ``fgraph``.  The
    signature seen is the method's own (``__wrapped__``), without it.
    """
    @functools.wraps(method)
    def either(self, *args):
        return method(self, *args[-2:])
    return either


def indexing_ops():
    """The Ops of ``x[index_array]``: ``AdvancedSubtensor``, and before PyTensor 3.3 also
    ``AdvancedSubtensor1`` (a vector index on the first axis), which 3.3 folded into it."""
    from pytensor.tensor import subtensor
    return tuple(op for op in (getattr(subtensor, name, None)
                               for name in ("AdvancedSubtensor", "AdvancedSubtensor1")) if op)


def axis_and_operands(op, inputs):
    """Split a ``Join`` or ``Split`` node's inputs into its axis and its operands.

    PyTensor 3.1 made the axis a property of the Op (``Join(axis)``,
    ``Split(n, axis)``, always a non-negative int); before, it was the first
    input of a Join and the second of a Split, a symbolic scalar.

    Returns:
        ``(axis, operands)``: ``axis`` an int, or None where it is not a
        constant; ``operands`` the parts of a Join, ``[x, sizes]`` of a Split.
    """
    inputs = list(inputs)
    if getattr(op, "axis", None) is not None:
        return int(op.axis), inputs
    from pytensor.tensor.basic import Split, get_underlying_scalar_constant_value
    from pytensor.tensor.exceptions import NotScalarConstantError

    axis = inputs.pop(1 if isinstance(op, Split) else 0)
    try:
        return int(get_underlying_scalar_constant_value(axis)), inputs
    except NotScalarConstantError:
        return None, inputs


def precompile(fn):
    """Have a Numba-linked ``fn`` compile (or load from Numba's cache) its code now.

    Numba compiles a function's code at its first call, for the types of the
    arguments; a process forked after that shares the code instead of building
    its own (``process.respawn``: 5-15 MiB per rank and function).  The types
    are those a synkhronos call passes: shared variables' values as they are,
    explicit inputs as C-contiguous arrays of their type (a rank's rows are
    views of Data in shared memory, or copies of the rows a batch selects).
    Both 2.x (linker ``"numba"``) and 3.x build the function the same way:
    the VM is one thunk with the Numba dispatcher as ``jit_fn`` and its
    inputs' storage cells as ``inputs``; the dispatcher takes ``*args``,
    which Numba types as one tuple.  Returns whether code was compiled;
    False for other linkers, other input types or any failure (the call then
    compiles, as without this).
    """
    vm = getattr(fn, "vm", None)
    dispatcher = getattr(vm, "jit_fn", None)
    cells = getattr(vm, "inputs", None)
    if (cells is None or not type(dispatcher).__module__.startswith("numba.")
            or not hasattr(dispatcher, "compile")):
        return False  # another linker: C, Python, JAX (which must not start here before a fork)
    try:
        import numba
        import numpy as np

        types = []
        for var, cell in zip(fn.maker.fgraph.inputs, cells, strict=True):
            if cell[0] is not None:
                types.append(numba.typeof(cell[0]))
            elif hasattr(var.type, "ndim") and hasattr(var.type, "dtype"):
                types.append(numba.types.Array(numba.from_dtype(np.dtype(var.type.dtype)),
                                               var.type.ndim, "C"))
            else:
                return False
        params = list(inspect.signature(dispatcher.py_func).parameters.values())
        if len(params) == 1 and params[0].kind is inspect.Parameter.VAR_POSITIONAL:
            types = [numba.types.BaseTuple.from_types(types)]  # ``(*args)``: one tuple
        dispatcher.compile(tuple(types))
    except Exception:  # noqa: BLE001 - only memory is at stake: the first call compiles
        return False
    return True

