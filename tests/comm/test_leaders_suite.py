"""The Leaders suite (tests/helpers/leaders_suite.py): every carrier of the leaders' collectives
against NumPy, one job per carrier, one test per check.

MPI's carrier runs under ``mpiexec`` on simulated machines (on this host where
they cannot be made), gloo's as processes on this host meeting through a file
store; each job runs every check once, and the tests read its report.
"""

import ast
import importlib.util
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import synkhronos
from helpers import leaders_suite
from helpers.cluster_jobs import machines, mpirun, why_no_mpi
from helpers.procs import DEADLINE_S, gone, wait_for

SCRIPT = leaders_suite.__file__
N = leaders_suite.N_LEADERS
JOB_TIMEOUT_S = 150


def _why_no_gloo():
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed (gloo's carrier needs pip install 'synkhronos[elastic]')"
    return None


WHY_NOT = {"mpi": why_no_mpi, "gloo": _why_no_gloo}


def _report(out):
    """{check: {rank: "OK" or the failure}} from a job's output; assert its processes ended."""
    got = {}
    for m in re.finditer(r"^R(\d+) (OK|FAIL) (\w+)(?:: (.*))?$", out, re.M):
        got.setdefault(m.group(3), {})[int(m.group(1))] = (
            "OK" if m.group(2) == "OK" else m.group(4) or "failed")
    pids = [int(p) for p in re.findall(r"^PID (\d+)$", out, re.M)]
    wait_for(lambda: all(gone(p) for p in pids), DEADLINE_S)
    assert all(gone(p) for p in pids), ("a leader outlived the job", out)
    return got


def _run_mpi():
    with machines(N) as m:
        rc, out, _ = mpirun(m, N, [SCRIPT, "mpi"], timeout=JOB_TIMEOUT_S)
    return rc, out


def _run_gloo(tmp):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(synkhronos.__file__).parents[1]),
                                         env.get("PYTHONPATH", "")])
    store = str(tmp / "store")
    procs = [subprocess.Popen([sys.executable, SCRIPT, "gloo", str(r), str(N), store], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(N)]
    outs, rcs = [], []
    try:
        for p in procs:
            try:
                outs.append(p.communicate(timeout=JOB_TIMEOUT_S)[0])
            except subprocess.TimeoutExpired:
                outs.append(f"leader pid {p.pid} ran past {JOB_TIMEOUT_S} s")
            rcs.append(p.returncode)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return max(rc or 0 for rc in rcs) if None not in rcs else 1, "\n".join(outs)


@pytest.fixture(scope="module", params=list(leaders_suite.CARRIERS))
def carrier_run(request, tmp_path_factory):
    """The carrier's name and its job's report: run once per carrier, read by every check."""
    name = request.param
    why = WHY_NOT[name]()
    if why:
        pytest.skip(why)
    if name == "mpi":
        rc, out = _run_mpi()
    else:
        rc, out = _run_gloo(tmp_path_factory.mktemp("gloo"))
    return name, rc, out, _report(out)


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
@pytest.mark.parametrize("check", [fn.__name__ for fn in leaders_suite.CHECKS])
def test_carrier_gives_numpys_result(carrier_run, check):
    name, _, out, report = carrier_run
    got = report.get(check, {})
    assert sorted(got) == list(range(N)), (f"{name}: not every leader ran {check}", out)
    failed = {r: why for r, why in got.items() if why != "OK"}
    assert not failed, (name, check, failed)


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_carrier_job_ends_cleanly(carrier_run):
    name, rc, out, _ = carrier_run
    assert rc == 0 and out.count(" DONE") == N, (name, out)


def _leaders_classes():
    """Every class in the package whose bases name ``Leaders`` (read from the source)."""
    found = []
    for path in sorted(Path(synkhronos.__file__).parent.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                    getattr(b, "id", getattr(b, "attr", None)) == "Leaders" for b in node.bases):
                mod = ".".join(path.relative_to(Path(synkhronos.__file__).parents[1])
                               .with_suffix("").parts)
                found.append((mod, node.name))
    return found


def test_the_suite_runs_every_carrier_of_the_contract():
    """A new carrier of ``Leaders`` must join ``CARRIERS``, and each keeps every method."""
    from synkhronos.comm.leaders import Leaders

    assert sorted(_leaders_classes()) == sorted(leaders_suite.CARRIERS.values())
    assert inspect.isabstract(Leaders)
    for mod, cls in leaders_suite.CARRIERS.values():
        impl = getattr(importlib.import_module(mod), cls)
        assert issubclass(impl, Leaders) and not inspect.isabstract(impl), impl

