"""synkhronos.compat: the one place that knows PyTensor 2.36 from 3.x.

Runs in every test environment (newest 3.x, lowest 2.x, PyMC's 2.38), so each
helper is checked against the PyTensor it will meet.  No processes.
"""

import os
import re

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest

from synkhronos import compat

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("text, want", [
    ("2.36.3", (2, 36, 3)), ("3.0.7", (3, 0, 7)), ("2.38", (2, 38, 0)),
    ("3.1.0.dev12+g1234", (3, 1, 0)), ("3.0.0rc1", (3, 0, 0)),
])
def test_parse_version(text, want):
    assert compat.parse_version(text) == want


def test_supported_range():
    assert compat.is_supported(compat.PYTENSOR_VERSION), pytensor.__version__
    assert compat.is_supported((2, 36, 0)) and compat.is_supported((3, 9, 1))
    assert not compat.is_supported((2, 35, 9)) and not compat.is_supported((4, 0, 0))


def test_pins_agree_with_min_version():
    """pyproject.toml, the Makefile's old environment and compat name one lowest version."""
    low = ".".join(map(str, compat.MIN_PYTENSOR))
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        assert f'"pytensor>={low},<{compat.MAX_PYTENSOR_MAJOR + 1}"' in f.read()
    with open(os.path.join(ROOT, "Makefile")) as f:
        assert re.search(rf"^LOWEST_PYTENSOR := {re.escape(low)}\.\*$", f.read(), re.M)


def _two_outputs():
    x = pt.dvector("x")
    return pytensor.function([x], [x + 1, 2 * x, x.sum()])


@pytest.mark.filterwarnings("error::FutureWarning")
def test_call_subset_real_function():
    fn = _two_outputs()
    x = np.arange(3.0)
    np.testing.assert_array_equal(compat.call_subset(fn, [x], None)[1], 2 * x)
    got = compat.call_subset(fn, [x], [2, 0])
    assert len(got) == 2
    np.testing.assert_array_equal(got[0], 3.0)
    np.testing.assert_array_equal(got[1], x + 1)
    # 2.x takes output_subset; 3.x removed it.
    assert compat.takes_output_subset(fn) == (compat.PYTENSOR_VERSION[0] < 3)


def test_call_subset_without_output_subset():
    class NoSubset:  # stands for a PyTensor 3 function
        def __call__(self, *args):
            return ["a", "b", "c"]

    class WithSubset:  # stands for a PyTensor 2 function
        def __call__(self, *args, output_subset=None):
            out = ["a", "b", "c"]
            return out if output_subset is None else [out[i] for i in output_subset]

    assert compat.call_subset(NoSubset(), [], [2, 0]) == ["c", "a"]
    assert compat.call_subset(WithSubset(), [], [1]) == ["b"]
    assert not compat.takes_output_subset(NoSubset())
    assert compat.takes_output_subset(WithSubset())


def test_default_linker_and_mode():
    linker = compat.default_linker()
    # Independent of get_default_mode(): the linker a function compiled with the default
    # mode actually got.
    x = pt.dvector("x")
    used = pytensor.function([x], x + 1).maker.linker
    names = {"NumbaLinker": "numba", "JAXLinker": "jax", "PytorchLinker": "pytorch",
             "MLXLinker": "mlx", "OpWiseCLinker": "c|py", "CLinker": "c", "PerformLinker": "py"}
    kind = type(used).__name__
    if kind == "VMLinker":
        assert linker == ("cvm" if used.c_thunks or (used.c_thunks is None and
                                                     bool(pytensor.config.cxx)) else "vm")
    else:
        assert linker == names[kind]
    if compat.PYTENSOR_VERSION[0] >= 3 and pytensor.config.mode == "Mode":
        assert linker == "numba"
    assert isinstance(compat.default_mode_name(), str)
    assert isinstance(compat.blas_ldflags(), str)


def test_ancestors():
    x = pt.dvector("x")
    y = (x + 1).sum()
    assert x in set(compat.ancestors([y]))


def test_pymc_extension_is_optional():
    """Importing synkhronos and its extensions loads no PyMC; without PyMC the error says why."""
    import subprocess
    import sys

    code = ("import sys, synkhronos, synkhronos.extensions\n"
            "assert 'pymc' not in sys.modules, 'pymc imported'\n"
            "try:\n"
            "    import pymc\n"
            "except ImportError:\n"
            "    try:\n"
            "        from synkhronos.extensions import pymc\n"
            "    except ImportError as exc:\n"
            "        assert \"pip install -e '.[pymc]'\" in str(exc), exc\n"
            "    else:\n"
            "        raise AssertionError('imported without PyMC')\n")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_precompile_compiles_numba_code_for_the_types_a_call_passes():
    pytest.importorskip("numba")
    x, i = pt.dmatrix("x"), pt.iscalar("i")
    s = pytensor.shared(np.ones(2, "float32"), name="s")
    f = pytensor.function([x, i], (x * s).sum() + i, mode="NUMBA")
    assert compat.precompile(f)
    jit = f.vm.jit_fn
    assert len(jit.signatures) == 1
    f.trust_input = True  # as synkhronos calls it: C-contiguous arrays, 0-d for scalars
    assert f(np.ones((3, 2)), np.array(4, "int32")) == 10.0
    assert len(jit.signatures) == 1  # the call found the code compiled for its types
    assert not compat.precompile(pytensor.function([x], x.sum(), mode="FAST_COMPILE"))


def _ofg_graph():
    """(x, an OpFromGraph setting a diagonal, [y, dy/dx]): the op and its gradient's, which
    OpFromGraph caches on the op, are shared by every graph built from them."""
    from pytensor.compile.builders import OpFromGraph

    a = pt.vector("a", shape=(2,))
    diag = OpFromGraph([a], [pt.set_subtensor(pt.zeros((2, 2))[[0, 1], [0, 1]], a)])
    x = pt.vector("x", shape=(2,))
    y = (diag(x) ** 2).sum() * 3.0
    return x, diag, [y, pytensor.grad(y, x)]


def test_private_inner_graphs_leave_the_shared_ops_alone():
    pytest.importorskip("numba")
    x, diag, outputs = _ofg_graph()
    inner = [str(n.op) for n in diag.fgraph.toposort()]
    private = compat.private_inner_graphs(outputs)
    from pytensor.compile.builders import OpFromGraph

    ops = [v.owner.op for v in compat.ancestors(private) if v.owner is not None]
    found = [op for op in ops if isinstance(op, OpFromGraph)]
    # PyTensor 3's inner graphs are frozen: nothing to copy (clone() is the op itself).
    assert len(found) >= 2
    assert all(op is not diag for op in found) or diag.clone() is diag
    numba_fn = pytensor.function([x], private, mode="NUMBA")
    # Python's linker runs the op's own inner graph: on PyTensor 2.38 it failed ("must not
    # contain inplace operations") where Numba had compiled the shared graph first.
    py_fn = pytensor.function([x], outputs, mode=pytensor.compile.mode.Mode(linker="py"))
    v = np.array([0.5, -2.0], dtype=x.dtype)
    for y, g in (numba_fn(v), py_fn(v)):
        np.testing.assert_allclose(y, 3.0 * np.sum(v ** 2), rtol=1e-6)
        np.testing.assert_allclose(g, 6.0 * v, rtol=1e-6)
    assert [str(n.op) for n in diag.fgraph.toposort()] == inner


def test_private_inner_graphs_keep_a_c_compile_after_numba_working():
    # An LKJ prior's AllocDiag, kept as an OpFromGraph: on PyTensor 2.38 its Numba compile
    # rewrote the graph the op shares, and the C function's first call then failed.
    if compat.PYTENSOR_VERSION >= (3,):
        pytest.skip("PyTensor 3 rewrites a copy of an OpFromGraph's inner graph")
    pytest.importorskip("numba")
    pm = pytest.importorskip("pymc")
    rng = np.random.default_rng(0)
    obs = rng.normal(size=(50, 2))
    with pm.Model() as model:
        chol, _, _ = pm.LKJCholeskyCov("chol", n=2, eta=2.0, compute_corr=True,
                                       sd_dist=pm.Exponential.dist(1.0, shape=2))
        pm.MvNormal("obs", np.zeros(2), chol=chol, observed=obs)
    logp = model.logp()
    outputs = [logp, *pytensor.grad(logp, model.value_vars)]
    point = model.initial_point()
    args = [point[v.name] for v in model.value_vars]
    numba_fn = pytensor.function(model.value_vars, compat.private_inner_graphs(outputs),
                                 mode="NUMBA")
    c_fn = pytensor.function(model.value_vars, outputs, mode="CVM")
    got, want = numba_fn(*args), c_fn(*args)
    np.testing.assert_allclose(got[0], model.compile_logp()(point), rtol=1e-10)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-10)
