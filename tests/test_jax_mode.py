"""CPU mode on PyTensor's JAX backend, the code path of GPU mode without a GPU.

- The function and collective suites run again with SYNK_TEST_MODE=JAX (every
  function on the JAX backend, so shared variables hold JAX arrays).
- JAX-specific cases: values stay JAX arrays in every rank through
  collectives, batch_s and slices; the NCCL path end to end on a CPU
  stand-in for CuPy (tests/helpers/fake_cupy.py); the guard against forking after
  JAX ran.

JAX cannot fork (tests/helpers/child.py): the suites rerun in subprocesses, one fork
per process (the function suite once per rank count, the collectives suite
with the fork_each plugin), and each case here runs in a forked child of the
pytest process, which itself never starts JAX.
"""

import importlib.util
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest

import synkhronos as synk
from helpers import child, fake_cupy
from synkhronos.runtime.state import get_runtime

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("jax") is None,
                       reason="needs jax (pip install synkhronos[jax])"),
    pytest.mark.timeout(300),
]

ROOT = Path(__file__).resolve().parent.parent


# ---- the suites, again, on the JAX backend ------------------------------------

def _suite(*args):
    paths = [str(ROOT / "tests")] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                     if p]
    env = dict(os.environ, SYNK_TEST_MODE="JAX", PYTHONPATH=os.pathsep.join(paths))
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    tail = (out.stdout + out.stderr)[-8000:]
    assert out.returncode == 0, tail
    assert " passed" in tail and " failed" not in tail, tail


@pytest.mark.parametrize("n", [1, 2, 3])
def test_function_suite_on_jax(n):
    # One rank count per process: the module's runtime forks once.
    _suite("tests/functions/test_function.py", "-k", f"{n}ranks")


def test_collectives_suite_on_jax():
    # That suite forks in every test: each test runs in its own process.
    _suite("-p", "helpers.fork_each", "tests/variables/test_collectives.py")


# ---- helpers run on every rank --------------------------------------------------

def _is_jax(value):
    import jax

    return isinstance(value, jax.Array)


def _kinds(rt, names, jax_arrays):
    """Every rank: the named variables hold JAX arrays (or NumPy arrays)."""
    for s in rt.registry.shareds:
        if s.name in names:
            value = s.get_value(borrow=True, return_internal_type=True)
            assert _is_jax(value) == jax_arrays, (rt.place.rank, s.name, type(value))


def _jax_on_cpu(rt):
    """Every rank: CPU mode keeps JAX on the CPU (even on a machine with GPUs)."""
    import jax

    assert os.environ.get("JAX_PLATFORMS") == "cpu"
    assert {d.platform for d in jax.devices()} == {"cpu"}


def _check_all(n, var, per_rank, rtol=1e-12):
    for r in range(n):
        np.testing.assert_allclose(synk.get_value(r, var), per_rank[r], rtol=rtol,
                                   err_msg=f"{var} in rank {r}")


# ---- collectives and calls keep JAX arrays ------------------------------------------

def _case_collectives_keep_jax(n):
    child.enable_jax()
    run_all = child.on_every_rank()
    synk.fork(n, use_gpu=False)
    v = pytensor.shared(np.zeros(5, "float32"), name="v")
    m = pytensor.shared(np.zeros((2, 3)), name="m")
    w = pytensor.shared(np.ones(4), name="w")  # used by no JAX function: stays NumPy
    x = pt.dvector("x")
    f = synk.function([x], (x.sum() + v.sum() + m.sum(), "sum"), updates=[(v, v + 1)],
                      mode="JAX")
    synk.function([], w.sum(), mode="FAST_COMPILE")
    synk.distribute()
    run_all(_jax_on_cpu)
    jax_vars = {"v", "m"}
    run_all(_kinds, jax_vars, True)            # placed on the device by distribute()
    run_all(_kinds, {"w"}, False)

    vals = [np.arange(5, dtype="float32") + 3 * r for r in range(n)]
    for r in range(n):
        synk.set_value(r, v, vals[r])
    run_all(_kinds, jax_vars, True)
    _check_all(n, v, vals)
    got = synk.reduce(v, "max", in_place=False)
    np.testing.assert_allclose(got, np.max(vals, axis=0))
    synk.all_reduce(v, "sum")
    _check_all(n, v, [np.sum(vals, axis=0)] * n)
    run_all(_kinds, jax_vars, True)
    synk.broadcast(v, np.full(5, 7, "float32"))
    _check_all(n, v, [np.full(5, 7.0)] * n)
    for r in range(n):
        synk.set_value(r, v, vals[r])
    synk.broadcast(v)
    _check_all(n, v, [vals[get_runtime().place.master_rank]] * n)
    synk.reduce(v, "sum")
    assert _is_jax(v.get_value(borrow=True, return_internal_type=True))

    data = np.arange(6.0 * n).reshape(3 * n, 2)[:, :1].repeat(3, axis=1)
    synk.scatter(m, data)
    parts = np.array_split(data, n)
    _check_all(n, m, parts)
    np.testing.assert_allclose(synk.gather(m, nd_up=0), data)
    assert synk.get_shapes(m) == [p.shape for p in parts]
    synk.all_gather(m)
    _check_all(n, m, [data] * n)
    run_all(_kinds, jax_vars, True)

    synk.all_reduce(w, "sum")
    _check_all(n, w, [np.full(4, float(n))] * n)
    run_all(_kinds, {"w"}, False)

    # A call reads JAX values and its update writes JAX values.
    for r in range(n):
        synk.set_value(r, v, vals[r])
    xs = np.arange(4.0 * n)
    total = f(xs)
    want = xs.sum() + np.sum(vals) + n * data.sum()
    np.testing.assert_allclose(total, want, rtol=1e-6)
    _check_all(n, v, [a + 1 for a in vals])
    run_all(_kinds, jax_vars, True)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_collectives_keep_jax_arrays_in_every_rank(n):
    child.run(_case_collectives_keep_jax, n)


def _case_slices_on_jax_values(n):
    child.enable_jax()
    run_all = child.on_every_rank()
    synk.fork(n, use_gpu=False)
    S = pytensor.shared(np.zeros((1, 3)), name="S")
    acc = pytensor.shared(np.zeros(3), name="acc")
    f = synk.function([], [(S.sum(axis=0), "sum"), (2 * S, "gather")],
                      updates=[(acc, acc + S.sum(axis=0), "sum")],
                      sliceable_shareds=[S], mode="JAX")
    synk.distribute()
    data = np.random.default_rng(3).standard_normal((11, 3))
    synk.scatter(S, data)
    parts = np.array_split(data, n)
    run_all(_kinds, {"S", "acc"}, True)

    total, rows = f(batch_s=[2, 0])
    sel = np.concatenate([p[[2, 0]] for p in parts])
    np.testing.assert_allclose(total, sel.sum(axis=0), rtol=1e-12)
    np.testing.assert_allclose(rows, 2 * sel, rtol=1e-12)
    _check_all(n, acc, [p[[2, 0]].sum(axis=0) for p in parts])

    # Slices: every slice starts from the same acc; "sum" adds the slices' updates.
    for r in range(n):
        synk.set_value(r, acc, np.zeros(3))
    total, rows = f(batch_s=slice(0, 3), num_slices=2)
    sel = np.concatenate([p[0:3] for p in parts])
    np.testing.assert_allclose(total, sel.sum(axis=0), rtol=1e-12)
    np.testing.assert_allclose(rows, 2 * sel, rtol=1e-12)
    _check_all(n, acc, [p[0:3].sum(axis=0) for p in parts])
    run_all(_kinds, {"S", "acc"}, True)


@pytest.mark.parametrize("n", [2, 3])
def test_batch_s_and_slices_on_jax_values(n):
    child.run(_case_slices_on_jax_values, n)


def _case_inputs_reused_at_once(n):
    child.enable_jax()
    synk.fork(n, use_gpu=False)
    rng = np.random.default_rng(5)
    W0 = rng.standard_normal((300, 300)).astype("float32") / 30
    W = pytensor.shared(W0, name="W")
    acc = pytensor.shared(np.zeros(300, "float32"), name="acc")
    x = pt.matrix("x", dtype="float32")
    g = pt.tanh(pt.tanh(x @ W) @ W) @ W
    f = synk.function([x], updates=[(acc, acc + g.sum(axis=0))], mode="JAX")
    synk.distribute()
    xs = [rng.standard_normal((400 * n, 300)).astype("float32") for _ in range(6)]
    for a in xs:
        f(a)        # NumPy input: copied into the same shared memory every call
    want = [sum(np.tanh(np.tanh(p @ W0) @ W0) @ W0 for p in parts).sum(axis=0)
            for parts in zip(*[np.array_split(a, n) for a in xs])]
    for r in range(n):
        np.testing.assert_allclose(synk.get_value(r, acc), want[r], rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("n", [1, 2])
def test_async_jax_calls_finish_before_inputs_are_reused(n):
    # JAX reads NumPy inputs in place and asynchronously; a call with updates
    # only must still be done with its inputs when it returns.
    child.run(_case_inputs_reused_at_once, n)


def _case_hand_overs():
    child.enable_jax()
    import jax

    from synkhronos.runtime import devices

    # NumPy to JAX: small arrays go without a wait, large ones with one; neither may see
    # the source change afterwards (it may be a communication buffer the next call reuses).
    for n in (4, 1 << 19):
        src = np.arange(n, dtype="float32")
        got = devices.to_jax(src)
        src[:] = -1
        assert isinstance(got, jax.Array)
        np.testing.assert_array_equal(np.asarray(got), np.arange(n, dtype="float32"))
    # wait(): the values computed, the fetched ones already on their way to the host.
    x = jax.numpy.arange(6.0)
    updated, result = x * 2, x.sum()
    devices.wait([updated], fetch=[result, np.ones(2)])      # other arrays pass
    assert updated.is_ready() and result.is_ready()
    assert float(result) == 15.0 and np.asarray(updated)[5] == 10.0


def test_hand_overs_between_numpy_and_jax():
    child.run(_case_hand_overs)


# ---- the NCCL path, on a CPU stand-in for CuPy ----------------------------------------

def _nccl_log(rt, marks, names):
    """Every rank: the NCCL calls logged since ``marks[rank]`` are ``names``."""
    got = [e[0] for e in fake_cupy.LOG[marks[rt.place.rank]:]]
    assert got == names, (rt.place.rank, got)


def _case_nccl_path(n):
    child.enable_jax()
    fake_cupy.install()
    run_all = child.on_every_rank()
    # As in GPU mode with one GPU per rank: the NCCL backend, wrapping shared memory.
    os.environ["SYNK_BACKEND"] = "nccl"
    synk.fork(n, use_gpu=False)
    v = pytensor.shared(np.zeros(5, "float32"), name="v")
    d = pytensor.shared(np.zeros((3, 4)), name="d")
    i = pytensor.shared(np.zeros(4, "int32"), name="i")
    h = pytensor.shared(np.zeros(3, "int16"), name="h")    # NCCL has no int16: host path
    L = pytensor.shared(np.zeros(2, "float32"), name="L")
    synk.function([], v.sum() + d.sum() + i.sum() + h.sum() + L.sum(), mode="JAX")
    synk.distribute()
    rng = np.random.default_rng(7)
    vals = {s.name: [(rng.integers(1, 5, s.get_value().shape)).astype(s.dtype) for _ in range(n)]
            for s in (v, d, i, h, L)}
    for r in range(n):
        synk.set_value(r, [v, d, i, h, L], [vals[k][r] for k in "vdihL"])

    def expect(names, call, *args, **kwargs):
        """Run ``call``; check the NCCL calls every rank made (one group per collective)."""
        marks = _log_marks(run_all)
        result = call(*args, **kwargs)
        run_all(_nccl_log, marks, names)
        return result

    if n == 1:
        # One rank: reductions and broadcasts give back their inputs, no NCCL call.
        assert expect([], synk.all_reduce, [v, d, i], "sum") is None
        got = expect([], synk.reduce, v, "prod", in_place=False)
        assert _is_jax(got)
        np.testing.assert_array_equal(got, vals["v"][0])
        # avg of integers is a float: not an identity; the headers' exchange connects,
        # then the host path.
        np.testing.assert_array_equal(expect(["comm"], synk.reduce, i, "avg", in_place=False),
                                      vals["i"][0].astype("float64"))
        expect([], synk.broadcast, v)
        for k in "vdi":
            _check_all(n, {"v": v, "d": d, "i": i}[k], vals[k])
        run_all(_kinds, {"v", "d", "i"}, True)
        # The rest of this case: the NCCL path itself, on a one-rank communicator.
        get_runtime().backend.nccl_alone = True
    # The first collective connects every rank, then one group of three calls.
    out = expect(["comm"] * (n > 1) + ["groupStart", "allReduce", "allReduce", "allReduce", "groupEnd"],
                 synk.all_reduce, [v, d, i], "sum")
    assert out is None
    for k in "vdi":
        _check_all(n, {"v": v, "d": d, "i": i}[k], [np.sum(vals[k], axis=0)] * n)
    run_all(_kinds, {"v", "d", "i"}, True)
    for r in range(n):
        synk.set_value(r, [v, d], [vals["v"][r], vals["d"][r]])
    # avg: sum, then scale.
    expect(["groupStart", "allReduce", "groupEnd"], synk.all_reduce, d, "avg")
    _check_all(n, d, [np.mean(vals["d"], axis=0)] * n)
    # int16: the host path, no NCCL call.
    expect([], synk.all_reduce, h, "max")
    _check_all(n, h, [np.max(vals["h"], axis=0)] * n)
    # nccl=False: the host path.
    expect([], synk.all_reduce, v, "min", nccl=False)
    _check_all(n, v, [np.min(vals["v"], axis=0)] * n)

    for r in range(n):
        synk.set_value(r, [v, d], [vals["v"][r], vals["d"][r]])
    got = expect(["groupStart", "reduce", "groupEnd"], synk.reduce, v, "prod", in_place=False)
    assert _is_jax(got)
    np.testing.assert_allclose(got, np.prod(vals["v"], axis=0))
    _check_all(n, v, vals["v"])                 # nothing changed
    expect(["groupStart", "reduce", "reduce", "groupEnd"], synk.reduce, [v, d], "sum")
    want = [np.sum(vals["v"], axis=0)] + vals["v"][1:]
    _check_all(n, v, want)                      # the master only

    for r in range(n):
        synk.set_value(r, v, vals["v"][r])
    expect(["groupStart", "broadcast", "groupEnd"], synk.broadcast, v)
    _check_all(n, v, [vals["v"][0]] * n)
    run_all(_kinds, {"v"}, True)

    for r in range(n):
        synk.set_value(r, [v, d], [vals["v"][r], vals["d"][r]])
    got = expect(["groupStart", "allGather", "allGather", "groupEnd"], synk.gather, [v, d])
    assert all(_is_jax(g) for g in got)
    np.testing.assert_allclose(got[0], np.stack(vals["v"]))
    np.testing.assert_allclose(got[1], np.stack(vals["d"]))
    got = expect(["groupStart", "allGather", "groupEnd"], synk.gather, d, nd_up=0)
    np.testing.assert_allclose(got, np.concatenate(vals["d"]))
    expect(["groupStart", "allGather", "groupEnd"], synk.all_gather, v)
    _check_all(n, v, [np.concatenate(vals["v"])] * n)

    if n > 1:
        # Lengths that differ between ranks: never NCCL (it would crop or pad).
        lens = [np.arange(r + 2, dtype="float32") + r for r in range(n)]
        for r in range(n):
            synk.set_value(r, L, lens[r])
        got = expect([], synk.gather, L, nd_up=0)
        np.testing.assert_allclose(got, np.concatenate(lens))
        with pytest.raises(ValueError, match="nd_up=0"):
            synk.gather(L)
        with pytest.raises(ValueError):
            synk.all_reduce(L, "sum")
        expect([], synk.all_gather, L)
        _check_all(n, L, [np.concatenate(lens)] * n)
        # ... and the NCCL path works again afterwards.
        for r in range(n):
            synk.set_value(r, v, vals["v"][r])
        expect(["groupStart", "allReduce", "groupEnd"], synk.all_reduce, v, "max")
        _check_all(n, v, [np.max(vals["v"], axis=0)] * n)
    assert fake_cupy.calls("comm") == 1           # one communicator for the whole run


def _log_marks(run_all):
    """Every rank's current NCCL log length, gathered in the master."""
    rt = get_runtime()

    def after(_):
        parts = rt.backend.collect()
        return [len(fake_cupy.LOG) if q == rt.place.rank else int(parts[q][0][0][0])
                for q in range(rt.place.n_parallel)]
    return run_all(_contribute_log_size, after=after)


def _contribute_log_size(rt):
    if not rt.is_master:
        rt.backend.contribute([np.array([len(fake_cupy.LOG)], dtype=np.int64)])


@pytest.mark.parametrize("n", [1, 2, 3])
def test_nccl_path_on_a_cpu_stand_in(n):
    child.run(_case_nccl_path, n)


def _case_nccl_reconnects():
    child.enable_jax()
    fake_cupy.install()
    fake_cupy.FAIL.update(rank=1, call=2)       # rank 1's second NCCL call raises
    child.on_every_rank()
    os.environ["SYNK_BACKEND"] = "nccl"
    synk.fork(2, use_gpu=False)
    v = pytensor.shared(np.zeros(3), name="v")
    synk.function([], v.sum(), mode="JAX")
    synk.distribute()
    for r in range(2):
        synk.set_value(r, v, np.full(3, r + 1.0))
    synk.all_reduce(v, "sum")
    _check_all(2, v, [np.full(3, 3.0)] * 2)
    with pytest.raises(synk.WorkerError, match="fake NCCL failure"):
        synk.all_reduce(v, "sum")
    assert fake_cupy.calls("abort") == 1          # the master gave up its communicator too
    for r in range(2):
        synk.set_value(r, v, np.full(3, r + 1.0))
    synk.all_reduce(v, "sum")                     # every rank connects again
    _check_all(2, v, [np.full(3, 3.0)] * 2)
    assert fake_cupy.calls("comm") == 2


def test_nccl_reconnects_after_a_failure():
    child.run(_case_nccl_reconnects)


# ---- GPU mode, simulated on the CPU ------------------------------------------------------

def _case_gpu_mode_simulated(module, case, n_gpus, *args):
    """Run a tests/gpu case as if ``n_gpus`` GPUs were present (CuPy: the stand-in)."""
    sys.path.insert(0, str(ROOT / "tests" / "gpu"))
    import importlib

    from helpers import gpu_env

    from synkhronos.runtime import devices

    import jax

    fake_cupy.install()
    devices.count_gpus = lambda: n_gpus
    gpu_env.PLATFORM = "cpu"
    jax.config.update("jax_platforms", "cpu")      # a simulation, even where GPUs exist
    getattr(importlib.import_module(module), case)(*args)
    assert get_runtime().config.device == "gpu"


@pytest.mark.parametrize("module, case, n_gpus, args", [
    ("test_nccl_gpu", "_case_collectives", 2, (2,)),
    ("test_nccl_gpu", "_case_collectives", 1, (1,)),
    ("test_nccl_gpu", "_case_shared_gpu", 1, (1,)),
    ("test_placement", "_case_mlp_step", 2, (2,)),
], ids=["nccl-2gpus", "nccl-1gpu", "shared-gpu", "placement"])
def test_gpu_cases_in_simulated_gpu_mode(module, case, n_gpus, args):
    """tests/gpu's cases, in GPU mode with a faked GPU count: fork, default JAX, NCCL routing."""
    child.run(_case_gpu_mode_simulated, module, case, n_gpus, *args)


# ---- the fork guard ---------------------------------------------------------------------

def _case_jax_before_fork():
    import jax.numpy as jnp

    assert float(jnp.ones(2).sum()) == 2.0          # JAX starts its backend here
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("synkhronos").addHandler(handler)
    synk.fork(2, use_gpu=False)
    assert any("JAX already ran" in r.getMessage() for r in records)
    x = pt.dvector("x")
    with pytest.raises(synk.SynkStateError, match="before fork"):
        synk.function([x], x.sum(), mode="JAX")
    f = synk.function([x], (x.sum(), "sum"), mode="FAST_COMPILE")  # other modes still work
    synk.distribute()
    assert f(np.arange(5.0)) == 10.0


def test_function_refuses_jax_mode_when_jax_ran_before_fork():
    child.run(_case_jax_before_fork)
