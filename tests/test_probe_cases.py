"""The cases a new user's hostile-input probe found silent or vague (issue 31), each now clear."""

import copy
import logging
import os
import pickle
import shutil
import subprocess
import sys

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from pytensor.graph.basic import Apply
from pytensor.graph.op import Op

import synkhronos as synk
from synkhronos import checkpoint
from synkhronos.cluster.layout import Layout
from synkhronos.fork_plan import Machine, _check_capacity
from synkhronos.runtime.state import get_runtime

pytestmark = pytest.mark.timeout(90)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_pickling_a_data_says_what_to_do(forked):
    forked(2)
    rows = np.arange(12, dtype="float32").reshape(4, 3)
    d = synk.data(rows)
    for copier in (pickle.dumps, copy.copy, copy.deepcopy):
        with pytest.raises(TypeError, match=r"pickle its contents instead .*synk\.data\(array\)"):
            copier(d)
    # What the message says works: the contents pickle, synk.data(d) copies within the run.
    np.testing.assert_array_equal(pickle.loads(pickle.dumps(np.asarray(d.data))), rows)
    again = synk.data(d)
    again[0] = -1
    np.testing.assert_array_equal(d.data, rows)  # a copy, not the same memory
    x = pt.matrix("x")
    f = synk.function([x], (x.sum(), "sum"))
    synk.distribute()
    assert float(f(d)) == rows.sum()


def test_bool_outputs_under_sum_and_prod_are_numpys(forked):
    forked(2)
    x = pt.matrix("x")
    pos = pt.gt(x, 0)
    f = synk.function([x], [(pos.any(axis=0), "sum"), (pos.any(axis=0), "prod"),
                            (pos.any(), "sum"), (pos.any(axis=0), "max")])
    synk.distribute()
    rows = np.array([[1, -1, -1], [1, 1, -1], [-1, -1, -1], [1, -1, -1]], "float32")
    per_rank = [rows[:2] > 0, rows[2:] > 0]          # 2 ranks, 2 rows each
    anys = [p.any(axis=0) for p in per_rank]
    got = f(rows)
    np.testing.assert_array_equal(got[0], np.sum(anys, axis=0))    # [2, 1, 0], not [True, ...]
    np.testing.assert_array_equal(got[1], np.prod(anys, axis=0))
    assert got[0].dtype == np.sum(anys, axis=0).dtype
    assert int(got[2]) == np.sum([p.any() for p in per_rank]) == 2
    np.testing.assert_array_equal(got[3], np.max(anys, axis=0))   # max stays bool, as in NumPy
    assert got[3].dtype == np.bool_
    # Slices inside a rank add up the same way: 4 one-row slices in all.
    got = f(rows, num_slices=2)
    np.testing.assert_array_equal(got[0], np.sum(rows > 0, axis=0))


def test_close_inside_a_profile_keeps_what_ran(forked):
    forked(2)
    x = pt.matrix("x")
    f = synk.function([x], (x.sum(), "sum"), name="probe")
    synk.distribute()
    d = synk.data(np.ones((4, 3), "float32"))
    with synk.profile() as outer:
        with synk.profile() as inner:
            f(d)
            f(d)
            synk.close()
    for prof in (outer, inner):
        assert sorted(prof.records) == [0, 1]
        for recs in prof.records.values():
            # (the outer one also holds the inner one's own PROFILE commands)
            assert [what for what, _, _ in recs].count("call of probe") == 2
        assert "call of probe" in prof.table()
    assert get_runtime() is None or get_runtime().closed


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="mounting a read-only /dev/shm needs root and unshare")
def test_a_read_only_dev_shm_is_named():
    # A fresh read-only tmpfs over /dev/shm in a private mount namespace: the host's
    # /dev/shm is untouched (remounting it read-only instead would change it for all).
    code = ("import synkhronos as synk\n"
            "from synkhronos.runtime.shmem import SharedArray\n"
            "for make in (lambda: synk.fork(2), lambda: SharedArray('/synk_probe', 4096)):\n"
            "    try:\n"
            "        make()\n"
            "    except synk.SharedMemoryError as exc:\n"
            "        print(exc)\n")
    script = (f"mount -t tmpfs -o ro,size=1m tmpfs /dev/shm && "
              f"{sys.executable} -c \"$SYNK_PROBE\"")
    p = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                       capture_output=True, text=True, timeout=60, cwd=ROOT,
                       env=dict(os.environ, SYNK_PROBE=code))
    if "mount" in p.stderr and p.returncode:
        pytest.skip(f"cannot mount here: {p.stderr.strip()}")
    lines = p.stdout.splitlines()
    assert len(lines) == 2, p.stdout + p.stderr
    assert lines[0].startswith("[Errno 30] fork: /dev/shm is mounted read-only")
    assert "segment /synk_probe: /dev/shm is mounted read-only" in lines[1]
    assert "free" not in p.stdout


def test_fork_plan_refuses_a_read_only_dev_shm():
    with pytest.raises(synk.SharedMemoryError, match="mounted read-only"):
        _check_capacity(Machine(cores=(0, 1), shm_free=1 << 20, shm_read_only=True), 2)


def _five():
    x = pt.vector("x")
    shareds = [pytensor.shared(np.full(3, k, "float32"), name=n) for k, n in enumerate("abcde")]
    f = synk.function([x], (x.sum(), "sum"), updates=[(s, s + x.sum()) for s in shareds])
    return f, shareds


def test_one_variable_loads_by_name_from_a_checkpoint_of_five(forked, tmp_path, caplog):
    forked(2)
    f, shareds = _five()
    synk.distribute()
    path = tmp_path / "five.npz"
    checkpoint.save(path, metadata={"step": 7})
    saved = [s.get_value() for s in shareds]
    for s in shareds:
        synk.broadcast(s, np.full(3, -1, "float32"))
    assert checkpoint.load(path, ["c"]) == {"step": 7}
    got = [synk.gather(s) for s in shareds]
    np.testing.assert_array_equal(got[2], [saved[2]] * 2)                 # c, on every rank
    for k in (0, 1, 3, 4):
        np.testing.assert_array_equal(got[k], np.full((2, 3), -1, "float32"))  # untouched
    a, e = shareds[0], shareds[4]
    checkpoint.load(path, [e, a])                                         # any order
    np.testing.assert_array_equal(synk.gather(a), [saved[0]] * 2)
    np.testing.assert_array_equal(synk.gather(e), [saved[4]] * 2)
    synk.close()

    # Without a run, the serial twin loads one variable by name too.
    lone = pytensor.shared(np.zeros(3, "float32"), name="d")
    checkpoint.load(path, [lone])
    np.testing.assert_array_equal(lone.get_value(), saved[3])
    with pytest.raises(ValueError, match="holds 0 variables named 'nope'"):
        checkpoint.load(path, [pytensor.shared(np.zeros(3, "float32"), name="nope")])

    # Saved once from 2 ranks, loaded into 3: allowed, and said in the log.
    forked(3)
    f, shareds = _five()
    synk.distribute()
    with caplog.at_level(logging.INFO, logger="synkhronos"):
        checkpoint.load(path)
    assert "saved from 2 ranks, restored into 3 ranks" in caplog.text
    np.testing.assert_array_equal(synk.gather(shareds[1]), [saved[1]] * 3)


class _InterruptedInMaster(Op):
    """Raises, in rank 0 only, what Ctrl-C inside compiled code looks like."""

    __props__ = ()

    def make_node(self, x):
        x = pt.as_tensor_variable(x)
        return Apply(self, [x], [x.type()])

    def perform(self, node, inputs, outputs):
        if get_runtime().place.rank == 0:
            try:
                raise KeyboardInterrupt
            except KeyboardInterrupt as exc:
                raise SystemError("<numba function> returned a result with an exception "
                                  "set") from exc
        outputs[0][0] = inputs[0].copy()


def test_ctrl_c_inside_compiled_code_is_a_keyboard_interrupt(forked):
    forked(2)
    x = pt.matrix("x")
    f = synk.function([x], (_InterruptedInMaster()(x).sum(), "sum"), mode="FAST_COMPILE")
    synk.distribute()
    with pytest.raises(KeyboardInterrupt):
        f(np.ones((4, 3), "float32"))
    rt = get_runtime()
    assert rt is None or rt.closed  # abandoned, as for any Ctrl-C during a command


def test_layout_ranks_names_the_valid_machines(forked):
    forked(2)
    lay = synk.layout()
    assert (lay.n_machines, lay.n_local, lay.ranks(0)) == (1, [2], range(0, 2))
    with pytest.raises(ValueError, match=r"machine must be 0 \(the run has 1 machine\); got 1"):
        lay.ranks(1)
    two = Layout([2, 2], ["a", "b"])
    assert two.ranks(1) == range(2, 4)
    with pytest.raises(ValueError, match="machine must be 0 to 1"):
        two.ranks(2)
    with pytest.raises(ValueError, match="machine must be"):
        two.ranks(-1)


def test_cast_hints_name_what_casts(forked):
    forked(2)
    x = pt.matrix("x")
    w = pytensor.shared(np.zeros((2, 3), "float32"), name="w")
    f = synk.function([x], (x.sum(), "sum"), updates=[(w, w + 1)])
    synk.distribute()
    a = np.ones((4, 3))                               # float64 for a float32 input
    with pytest.raises(TypeError) as info:
        f(a)
    assert "synk.data(value, var=x, force_cast=True)" in str(info.value)
    with pytest.raises(TypeError, match="no input named 'force_cast'"):
        f(a, force_cast=True)                         # what the old hint led to
    assert float(f(synk.data(a, var=x, force_cast=True))) == 12.0     # what the hint says
    assert float(f(a.astype("float32"))) == 12.0
    with pytest.raises(TypeError, match=r"cast it first: value.astype\('float32'\)"):
        synk.broadcast(w, np.ones((2, 3)))
    with pytest.raises(TypeError, match="pass force_cast=True to cast"):
        synk.data(a, var=x)                           # where force_cast exists, it is named


def test_dir_shows_the_public_api():
    names = dir(synk)
    assert set(synk.__all__) <= set(names)
    for gone in ("os", "logging", "process", "runtime", "inputs", "comm", "floatx"):
        assert gone not in names
    for name in names:
        assert getattr(synk, name) is not None
    assert synk.checkpoint.load is checkpoint.load


def test_floatx_set_in_python_c_before_the_import_stands():
    code = ("import pytensor; pytensor.config.floatX = 'float64'; import synkhronos; "
            "print(pytensor.config.floatX)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.stdout.split() == ["float64"], p.stderr
    p = subprocess.run([sys.executable, "-c", "import synkhronos, pytensor; "
                        "print(pytensor.config.floatX)"], capture_output=True, text=True,
                       timeout=60, env={k: v for k, v in os.environ.items()
                                        if k not in ("PYTENSOR_FLAGS", "THEANO_FLAGS")})
    assert p.stdout.split() == ["float32"], p.stderr
