"""Data produced where it is used (``synk.data(produce=...)``), and NumPy inputs sent by rows.

One job script (helpers/cluster_placed.py) checks every result against NumPy:
whole calls, ``batch=`` (index lists, slices, ints), placed, replicated and
NumPy inputs in one call, uneven parts, shuffled batches from ``synk.batches``,
training through the training helper with a checkpoint, misuse and a failing
``produce``.  It runs on one machine without MPI (where a produced Data is an
ordinary one) and under mpiexec on 2 and 3 simulated machines.
"""

import os
import subprocess
import sys

import pytest

from helpers.cluster_jobs import TESTS, assert_nothing_left, machines, mpirun
from helpers.cluster_jobs import why_no_mpi

SCRIPT = os.path.join(TESTS, "helpers", "cluster_placed.py")

pytestmark = pytest.mark.timeout(240)


def test_produced_data_on_one_machine():
    out = subprocess.run([sys.executable, SCRIPT, "2"], capture_output=True, text=True,
                         timeout=200, cwd=TESTS)
    assert out.returncode == 0 and "ALL OK" in out.stdout, out.stdout + out.stderr
    assert out.stdout.count("OK ") >= 21, out.stdout


@pytest.mark.skipif(why_no_mpi() is not None, reason=why_no_mpi() or "")
@pytest.mark.parametrize("n_machines,local", [(2, 1), (3, 2)])
def test_produced_data_on_machines(n_machines, local):
    with machines(n_machines) as m:
        rc, out, _ = mpirun(m, n_machines, [SCRIPT, str(local)])
        assert rc == 0 and "ALL OK" in out, out
        for name in ("produced in parts", "placed misuse refused", "different parts refused",
                     "training with batches", "checkpoint resume", "uneven parts batch"):
            assert f"OK {name}\n" in out, (name, out)
        assert_nothing_left(m, out, "cluster_placed.py")
