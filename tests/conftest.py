"""Shared fixtures: forked runtimes that always close, and leak checks."""

import faulthandler
import contextlib
import os
import shutil
import sys
import tempfile

import numpy as np
import pytest

import synkhronos as synk
from synkhronos.runtime.state import get_runtime

HANG_S = 100

# tests/helpers holds modules the tests import and scripts they run: nothing to collect.
collect_ignore = ["helpers"]

# JAX-mode runs (started by tests/test_jax_mode.py): SYNK_TEST_MODE=JAX makes
# PyTensor's JAX backend every function's default mode, so the function and
# collective suites run again on JAX arrays.  Read by test_collectives.py too.
TEST_MODE = os.environ.get("SYNK_TEST_MODE") or None

# The pytest process never starts JAX (its later fork()s would hang in it: helpers/child.py),
# so a PyMC model's ranks are measured in Numba and C only; the tests of JAX among the
# modes measured run in a forked child (tests/extensions/test_pymc_jax.py).
os.environ.setdefault("SYNK_PYMC_MODES", "NUMBA,CVM")
if TEST_MODE:
    import pytensor

    pytensor.config.mode = TEST_MODE
    if TEST_MODE == "JAX":
        import jax
        import pytensor.link.jax.dispatch  # noqa: F401 - sets jax_enable_x64 from floatX

        # float64 graphs in float64, as on the default backend (float32 floatX
        # would make PyTensor's JAX backend compute them in float32).
        jax.config.update("jax_enable_x64", True)


# The session's temporary files in a directory of its own, removed at its end, with what
# the processes it starts leave there: PyTensor's Numba backend writes each graph's source to
# a file it never deletes (about 9,200 a make test), and a killed mpirun (Open MPI's fault
# tests) its session directory.  Set before anything asks tempfile where /tmp is.  Open to
# all as /tmp is (sticky): the Slurm tests' daemons run as other users (munged checks
# every folder above its own, and refused this one at mkdtemp's 0700).
SUITE_TMP = tempfile.mkdtemp(prefix="synk-suite-")
os.chmod(SUITE_TMP, 0o1777)
os.environ["TMPDIR"] = SUITE_TMP
tempfile.tempdir = None

# MPICH's mpiexec (Hydra) leaves its topology file in /tmp after each launch (about 31 a
# make test): the files that appeared during this session are removed at its end.
HYDRA_FILES = "/tmp/hydra_hwloc_xmlfile_"


def _hydra_files():
    import glob
    return set(glob.glob(HYDRA_FILES + "*"))


def pytest_sessionstart(session):
    session.config.stash[_HYDRA_BEFORE] = _hydra_files()


def pytest_sessionfinish(session):
    shutil.rmtree(SUITE_TMP, ignore_errors=True)
    before = session.config.stash.get(_HYDRA_BEFORE, None)
    if before is None:
        return
    for path in _hydra_files() - before:
        with contextlib.suppress(OSError):
            os.remove(path)


_HYDRA_BEFORE = pytest.StashKey()


def pytest_terminal_summary(terminalreporter):
    """Say which stack this run tested, at the end of its log, with -q too (docs/installation.md's table)."""
    import importlib.metadata
    import platform

    found = []
    for dist in ("pytensor", "numpy", "numba", "pymc", "nutpie", "arviz", "jax", "mpi4py"):
        try:
            found.append(f"{dist} {importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    terminalreporter.write_line(f"synkhronos stack: Python {platform.python_version()}, "
                                + ", ".join(found))


def _segments():
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith("synk_"))


@pytest.fixture(autouse=True)
def _deadline():
    """A hang is a failure: dump every thread's stack if a test stalls."""
    faulthandler.dump_traceback_later(HANG_S, exit=False, file=sys.stderr)
    yield
    faulthandler.cancel_dump_traceback_later()


@pytest.fixture
def forked(request):
    """Return a function that forks n ranks; the runtime is closed after the test."""
    def _fork(n_parallel=2, **kwargs):
        return synk.fork(n_parallel, use_gpu=False, **kwargs)
    yield _fork
    rt = get_runtime()
    if rt is not None and not rt.closed:
        synk.close()
    assert get_runtime() is None


@pytest.fixture(autouse=True)
def _no_leaks():
    """Every test leaves no segment of its own and no live runtime behind."""
    yield
    rt = get_runtime()
    if rt is not None and not rt.closed:
        if rt is _kept["runtime"]:
            return  # a wider fixture owns it and checks for leaks when it closes it
        synk.close()
        pytest.fail("test left synkhronos forked")
    _assert_no_segments()


def _assert_no_segments():
    mine = [n for n in _segments() if n.startswith(f"synk_{os.getpid()}_")]
    assert not mine, f"segments left in /dev/shm: {mine}"


_kept = {"runtime": None}


class RuntimeKeeper:
    """Forks a runtime that outlives single tests (for module-scoped fixtures).

    Forking, building and distributing once per module keeps the suite fast;
    ``close()`` runs the same leak checks as every test.
    """

    def fork(self, n_parallel=2, **kwargs):
        n = synk.fork(n_parallel, use_gpu=False, **kwargs)
        _kept["runtime"] = get_runtime()
        return n

    @contextlib.contextmanager
    def distributed(self, n_parallel, build):
        """Fork ``n_parallel`` ranks, ``build()`` the functions, distribute; yield what
        ``build`` returned, and close at the end (or when building fails)."""
        self.close()   # any runtime a module before left open
        self.fork(n_parallel)
        try:
            built = build()
            synk.distribute()
            yield built
        finally:
            self.close()

    def close(self):
        rt, _kept["runtime"] = _kept["runtime"], None
        if rt is not None and not rt.closed:
            synk.close()
        assert get_runtime() is None
        _assert_no_segments()


@pytest.fixture(scope="session")
def runtime_keeper():
    """Return the RuntimeKeeper; a module fixture forks with it and closes at teardown."""
    keeper = RuntimeKeeper()
    yield keeper
    keeper.close()


@pytest.fixture
def rng():
    return np.random.default_rng(1234)
