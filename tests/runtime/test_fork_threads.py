"""Forking with threads and start methods (runtime/process_setup.forking), each case in a fresh process.

CPython 3.12+ warns (DeprecationWarning) at every ``os.fork()`` of a process
with more than one thread.  synkhronos forks on purpose: threads that take
no lock a rank needs (native pools, synkhronos's own) fork silently; the
program's own Python threads are named once, saying what to do; a program
that chose another start method keeps it, and its own pools still work.
"""

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(120)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROLOGUE = """
import warnings
warnings.simplefilter("error", DeprecationWarning)   # any fork warning fails the run
warnings.simplefilter("always", RuntimeWarning)
import numpy as np
import pytensor.tensor as pt
import synkhronos as synk

def call_twice():
    x = pt.matrix("x")
    f = synk.function([x], outputs=(x.sum(axis=0), "sum"), mode="FAST_COMPILE")
    synk.distribute()     # forks the ranks again, from here
    data = np.arange(14.0, dtype="float32").reshape(7, 2)
    np.testing.assert_allclose(f(synk.data(data)), data.sum(axis=0))
"""


def _run(tmp_path, body):
    # The program under a main guard: a spawned child imports it again.
    main = textwrap.dedent(body) + "\nsynk.close()\nprint('DONE')\n"
    code = textwrap.dedent(PROLOGUE) + "\nif __name__ == '__main__':\n" + textwrap.indent(main, "    ")
    script = tmp_path / "program.py"    # a file: a warning shows the program's line
    script.write_text(code)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=100)
    assert out.returncode == 0 and out.stdout.strip().endswith("DONE"), out.stderr
    return out.stderr


def test_native_and_own_threads_fork_silently(tmp_path):
    # faulthandler's watchdog is a native thread (as BLAS and Numba pools are): on Python
    # 3.12+ a bare os.fork() warns here; synkhronos's fork does not.
    err = _run(tmp_path, """
        import faulthandler
        faulthandler.dump_traceback_later(300)
        synk.fork(2)
        call_twice()
        faulthandler.cancel_dump_traceback_later()
        """)
    assert "Warning" not in err, err


def test_a_program_thread_is_named_once_with_what_to_do(tmp_path):
    err = _run(tmp_path, """
        import threading
        stop = threading.Event()
        threading.Thread(target=stop.wait, name="my-poller", daemon=True).start()
        synk.fork(2)
        call_twice()
        stop.set()
        """)
    assert err.count("RuntimeWarning") == 1, err
    assert "1 other thread(s) run in this process (my-poller)" in err, err
    assert "Start such threads after synk.distribute()" in err, err
    # At the program's own line, not inside synkhronos.
    assert "program.py" in err and "synk.fork(2)" in err, err
    assert "DeprecationWarning" not in err, err


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_another_start_method_keeps_working(tmp_path, method):
    err = _run(tmp_path, f"""
        import multiprocessing as mp
        mp.set_start_method({method!r})
        synk.fork(2)
        call_twice()
        assert mp.get_start_method() == {method!r}
        with mp.get_context().Pool(1) as pool:       # the program's own pool, its method
            assert pool.map(abs, [-1, -2]) == [1, 2]
        """)
    assert "Warning" not in err, err
