"""``python -m synkhronos``: the report, and ``--check`` passing and failing.

Every run is a subprocess with a deadline, as a user would start it; the
check forks its own ranks there and must leave no segment behind.
"""

import fcntl
import os
import re
import subprocess
import sys

import pytest

from synkhronos import doctor, selfcheck

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.timeout(120)


def _run(*args, env=None, timeout=100):
    full_env = dict(os.environ, **(env or {}))
    # The package of this checkout, not some other installed copy.
    full_env["PYTHONPATH"] = ROOT + os.pathsep + full_env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "synkhronos", *args], cwd=ROOT, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


def _dead_pid():
    """Return the pid of a process that has exited (and been reaped)."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


def test_report_lists_every_section():
    import numpy
    import pytensor

    proc = _run()
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for section in ("versions:", "pytensor:", "cpu:", "gpu:", "shared memory:", "backends:"):
        assert section in out
    assert re.search(rf"pytensor +{re.escape(pytensor.__version__)}", out)
    assert numpy.__version__ in out
    assert "default mode" in out and "linker" in out
    assert "affinity" in out and "/dev/shm" in out
    backends = out[out.index("backends:"):out.index("settings:")]
    assert re.search(r"shm +available", backends)
    # No "available" beside "unavailable" for the same thing: NCCL needs CuPy and a GPU.
    from synkhronos.runtime import devices
    if devices.count_gpus() == 0:
        assert re.search(r"nccl +unavailable: ", backends), backends
        assert "nvidia-ml-py" not in out     # nothing to install for GPUs that are not there
    assert "loads" not in backends


def test_report_names_stale_segments(tmp_path):
    # A directory of our own: every fork() on the machine sweeps /dev/shm.
    dead = f"synk_{_dead_pid()}_00112233aabb_"
    live = f"synk_{os.getpid()}_445566778899_"
    (tmp_path / f"{dead}0_99doctor").write_bytes(b"\0" * 4096)
    (tmp_path / f"{dead}lock").write_bytes(b"")            # nobody holds it: a dead run
    (tmp_path / f"{live}0_1live").write_bytes(b"\0")
    fd = os.open(tmp_path / f"{live}lock", os.O_CREAT | os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)                           # held: a live run
    (tmp_path / "other_file").write_bytes(b"\0")
    try:
        assert doctor.stale_segments(str(tmp_path)) == {
            f"/{dead}": [f"{dead}0_99doctor", f"{dead}lock"]}
        text = doctor.format_report([("shared memory", doctor.shm_report(str(tmp_path)))])
    finally:
        os.close(fd)
    assert re.search(r"synk segments +4 \(2 of running programs\)", text)
    assert "STALE segments" in text and dead.rstrip("_") in text and "0.0 MiB" in text


@pytest.mark.parametrize("n", [2, 3])
def test_check_passes(n):
    proc = _run("--check", "-n", str(n))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[-1].startswith("PASS")
    assert f"fork ({n} ranks, cpu mode)" in proc.stdout
    for step in ("function call", "gather", "broadcast", "scatter", "all_gather",
                 "set_value / get_value", "reduce", "all_reduce", "close (no segment left)"):
        assert any(line.startswith("ok") and step in line for line in lines), step
    assert "FAIL" not in proc.stdout


def test_check_streams_its_steps():
    # python -m synkhronos --check prints each step as it is taken (on_step), not at the end.
    seen = []
    steps = selfcheck.check(2, on_step=lambda step: seen.append((step, list(seen))))
    assert [s for s, _ in seen] == steps and len(steps) >= 10
    assert all(len(before) == k for k, (_, before) in enumerate(seen))  # one at a time
    proc = _run("--check", "-n", "2")
    assert proc.stdout.startswith("checking: fork every rank"), proc.stdout


def test_check_says_what_failed():
    proc = _run("--check", "-n", "2", env={"SYNK_BACKEND": "nonesuch"})
    assert proc.returncode == 1
    assert "FAIL  fork" in proc.stdout
    assert "nonesuch" in proc.stdout                  # the reason, not just "failed"
    assert proc.stdout.splitlines()[-1].startswith("FAIL: ")


def test_format_report():
    text = doctor.format_report([("a", [("k", "v"), ("longer", "w")]), ("b", [])])
    assert text.splitlines() == ["a:", "  k       v", "  longer  w", "b:"]
    assert doctor._ranges([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"


@pytest.mark.parametrize("value", ["-1", "nan", "0", "soon"])
def test_check_refuses_a_bad_timeout(value):
    proc = _run("--check", "--timeout", value)
    assert proc.returncode == 2
    assert f"argument --timeout: must be a number of seconds > 0 (or inf); got '{value}'" \
        in proc.stderr
    assert "PASS" not in proc.stdout and "Traceback" not in proc.stderr
    with pytest.raises(ValueError, match="timeout"):
        selfcheck.check(2, timeout=float(value) if value != "soon" else value)


def test_report_flags_invalid_settings():
    env = {"SYNK_SPIN_S": "abc", "SYNK_TIMEOUT_S": "-1", "SYNK_HEARTBEAT_S": "0",
           "SYNK_BACKEND": "nonesuch", "SYNK_CLUSTER": "off", "SYNK_TIMOUT_S": "9"}
    proc = _run(env=env)
    assert proc.returncode == 0, proc.stderr
    section = proc.stdout[proc.stdout.index("settings:"):]
    for name in ("SYNK_SPIN_S", "SYNK_TIMEOUT_S", "SYNK_HEARTBEAT_S", "SYNK_BACKEND",
                 "SYNK_CLUSTER"):
        assert re.search(rf"{name} +INVALID: {name} must be .*; got '{env[name]}'", section), name
    assert re.search(r"SYNK_TIMOUT_S +'9' \(not a synkhronos setting", section)
    assert doctor.settings_report({"SYNK_SPIN_S": "0.5"}) == [("SYNK_SPIN_S", "0.5")]
    assert doctor.settings_report({}) == [("SYNK_*", "none set (defaults)")]
