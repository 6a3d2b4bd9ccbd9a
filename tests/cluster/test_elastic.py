"""Machines that come and go (SYNK_LISTEN / SYNK_JOIN): no launcher, gloo between machines.

Each node master is started on its own on a simulated machine (helpers/machines.py)
and joins the controller with the job's secret from a file (helpers/elastic_jobs.py).
The contract script of the MPI clusters (helpers/cluster_checks.py) passes unchanged;
a training run (helpers/cluster_elastic.py) loses a whole machine (every process on it
killed), or has its link cut, or gains a machine and then loses another, and finishes
with the losses of its serial twin, a produced Data made again where rows were lost;
a lost controller's machine ends every other machine.  No MPI is involved, so these
run once (the main environment), not under each MPI.
"""

import os
import re
import time

import pytest

from helpers.cluster_jobs import NO_MACHINES, TESTS, assert_nothing_left, machines
from helpers.elastic_jobs import Job, run_training, serial_losses, losses, why_no_elastic

WHY = why_no_elastic()
pytestmark = [pytest.mark.skipif(WHY is not None, reason=WHY or ""), pytest.mark.timeout(300)]
on_machines = pytest.mark.skipif(NO_MACHINES is not None, reason=NO_MACHINES or "")
CHECKS = os.path.join(TESTS, "helpers", "cluster_checks.py")
STEPS = 8


def test_contract_on_machines_that_joined():
    """Every call option, collective and Data mirror of the MPI contract, unchanged."""
    with machines(2) as m:
        job = Job(m, ["1"], 2, script=CHECKS)
        job.join(1)
        rc = job.wait(200)
        out = job.out
        assert rc == 0 and "ALL OK" in out and "AFTER CLOSE OK" in out, out + job.node_output()
        assert out.count("OK all_reduce and reduce") == 5, out
        assert_nothing_left(m, out, "cluster_checks.py")


def _compare(out, want, at_least=STEPS - 1):
    got = losses(out)
    compared = 0
    for k, (loss, total) in got.items():
        if loss == "lost":
            continue
        assert float(loss) == pytest.approx(float(want[k][0]), rel=1e-5), (k, out)
        # The produced Data covers every row on whichever machines are left.
        assert float(total) == float(want[k][1]), (k, out)
        compared += 1
    assert compared >= at_least, out


def _check_run(plan, n_start, lost, heartbeat_s=3.0):
    rc, out, events, m = run_training(n_start, STEPS, plan, heartbeat_s)
    try:
        print("\n".join(f"{e.what}: error/admitted after {e.t_error}, first step after "
                        f"{e.t_first}" for e in events))
        assert rc == 0 and "CLOSED" in out, out
        # Nothing a lost machine left behind (gloo's threads waiting on it) holds the exit.
        assert events[-1].what == "exit after close" and events[-1].t_error < 10.0, events
        _compare(out, serial_losses(STEPS))
        assert_nothing_left(m, out, "cluster_elastic.py", lost=lost)
    finally:
        m.__exit__(None, None, None)
    return out, events, m.names


@on_machines
def test_whole_machine_lost_mid_training_matches_the_serial_twin():
    out, events, names = _check_run({3: ("crash", 2)}, 3, lost=(2,))
    # Machines are numbered in the order they joined: the lost one is named by its host.
    assert re.search(rf"CAUGHT MachineLostError at step 4 completed (True|False) .*machine (\d) "
                     rf"\({names[2]}, ranks \2\.\.\2\)", out), out
    assert re.search(rf"EVENT lost machine \d \({names[2]},", out), out
    assert re.search(r"step 7 \S+ sum \S+ on 2 machines 2 ranks", out), out
    assert events[0].t_error < 5.0, events


@on_machines
def test_join_mid_training_then_another_machine_lost():
    out, events, names = _check_run({2: ("join", 2), 4: ("crash", 1)}, 2, lost=(1,))
    assert re.search(rf"EVENT joined machine 2 \({names[2]}, ranks 2\.\.2\) -> 3 machines",
                     out), out
    assert re.search(r"^step 3 \S+ sum \S+ on 3 machines 3 ranks", out, re.M), out
    assert re.search(rf"CAUGHT MachineLostError at step 5 .*machine 1 \({names[1]},", out), out
    assert re.search(r"step 7 \S+ sum \S+ on 2 machines 2 ranks", out), out


@on_machines
def test_cut_machine_is_dropped_and_ends_itself():
    heartbeat_s = 3.0
    out, events, names = _check_run({2: ("cut", 1)}, 2, lost=(), heartbeat_s=heartbeat_s)
    assert re.search(r"CAUGHT MachineLostError at step 3 .*machine 1 \(\S+, ranks 1\.\.1\): "
                     r"its node master stopped answering", out), out
    assert events[0].t_error < 2 * heartbeat_s, events
    assert re.search(r"step 7 \S+ sum \S+ on 1 machines 1 ranks", out), out


@on_machines
def test_lost_controller_machine_ends_every_machine():
    heartbeat_s = 3.0
    with machines(3) as m:
        job = Job(m, ["train", "200", ""], 3, SYNK_HEARTBEAT_S=str(heartbeat_s))
        try:
            job.join(1)
            job.join(2)
            job.until(r"^step 2 ")
            m.crash(0)
            deadline = 2 * heartbeat_s
            t0 = time.monotonic()
            while any(m.processes(i) for i in (1, 2)) and time.monotonic() - t0 < deadline:
                time.sleep(0.05)
            took = time.monotonic() - t0
            assert not any(m.processes(i) for i in (1, 2)), (took, m.leftovers())
        finally:
            job.close()
        assert_nothing_left(m, job.out, "cluster_elastic.py", lost=(0,))


@on_machines
def test_wrong_secret_is_refused_and_the_job_goes_on():
    """A machine without the job's secret is told so and ends; the right one is let in after."""
    with machines(2) as m:
        job = Job(m, ["train", "2", ""], 2)
        try:
            _refused_intruder(job, m)
            job.join(1)
            rc = job.wait(120)
        finally:
            job.close()
        _finished_on_two(job, m, rc)


def _refused_intruder(job, m, i=1):
    """Start a node master with a wrong secret on machine ``i``: it is refused and leaves nothing.

    Returns the seconds from its knock to its refusal, on its own clock.
    """
    intruder = job._start(i, SYNK_JOIN=job.address, SYNK_SECRET="not-the-job-secret-42")
    out, _ = intruder.communicate(timeout=60)
    assert intruder.returncode != 0 and "refused this machine" in out, out
    assert not m.processes(i), m.leftovers()
    knocked = re.search(r"^LOG (\S+) knocking on the controller", out, re.M)
    refused = re.search(r"^REFUSED at (\S+)$", out, re.M)
    assert knocked and refused, out
    return float(refused.group(1)) - float(knocked.group(1))


def _finished_on_two(job, m, rc):
    assert rc == 0 and "CLOSED" in job.out and "on 2 machines 2 ranks" in job.out, job.out
    assert_nothing_left(m, job.out, "cluster_elastic.py")


@on_machines
def test_wrong_secret_is_refused_while_the_program_sits_between_calls():
    """The door answers while the controller's program makes no call; a right joiner waits."""
    with machines(2) as m:
        job = Job(m, ["train", "3", "0:2"], 1)   # alone; after step 0 it sits until told
        try:
            job.until(r"^PAUSE 0$")
            t0 = time.monotonic()
            answered = _refused_intruder(job, m)
            # Refused while the program still sat between calls (no call answered it).
            assert "RESUME 0" not in job.out, job.out
            print(f"intruder refused {answered:.2f} s after it knocked, "
                  f"{time.monotonic() - t0:.2f} s after it started")
            assert answered < 2.0, answered
            job.join(1)
            time.sleep(1.0)              # it proves itself meanwhile; admitted at the next call
            job.resume(0)
            job.until(r"^RESUME 0 machines 2 ")
            rc = job.wait(120)
        finally:
            job.close()
        _finished_on_two(job, m, rc)


@on_machines
def test_cut_machine_whose_link_comes_back_is_refused_and_ends_itself():
    """Dropped while cut off, it hears the controller again: it is refused and ends."""
    with machines(2) as m:
        job = Job(m, ["train", "6", "2:0"], 2, SYNK_HEARTBEAT_S="3")
        try:
            # Its own patience is 60 s: what ends it below is the controller, not its silence.
            job.nodes[1] = job._start(1, SYNK_JOIN=job.address, SYNK_HEARTBEAT_S="60")
            job.until(r"^PAUSE 2$")
            m.cut(1)
            job.resume(2)
            job.until(r"^CAUGHT MachineLostError at step 3 ", timeout=30)
            assert m.processes(1), "the cut machine ended before its link came back"
            m.mend(1)
            t0 = time.monotonic()
            while m.processes(1) and time.monotonic() - t0 < 30:
                time.sleep(0.1)
            took = time.monotonic() - t0
            print(f"the returned machine ended {took:.2f} s after its link came back")
            assert not m.processes(1), (took, m.leftovers())
            rc = job.wait(120)
        finally:
            job.close()
        assert rc == 0 and "CLOSED" in job.out, job.out + job.node_output()
        assert re.search(r"step 5 \S+ sum \S+ on 1 machines 1 ranks", job.out), job.out
        assert_nothing_left(m, job.out, "cluster_elastic.py")


def _machine_2_crashes_between_calls(job, m):
    """Machines 1 and 2 join; after step 2 machine 2 crashes; return when the loss was seen.

    Returns the seconds from the crash to the controller's EVENT line, which no call
    made happen (the program still sits between calls).
    """
    job.join(1)
    job.join(2)
    job.until(r"^PAUSE 2$")
    t0 = time.monotonic()
    m.crash(2)
    # Machines are numbered in the order they joined: named by host.
    job.until(rf"^EVENT lost machine \d \({m.names[2]}, ranks (\d)\.\.\1\) -> 2 machines",
              timeout=10)
    took = time.monotonic() - t0
    assert "RESUME 2" not in job.out, job.out     # no call made it happen
    return took


@on_machines
def test_machine_lost_between_calls_is_seen_at_once_and_raised_by_the_next_call():
    """While the program makes no call: layout() and on_machines see the loss; the next step raises."""
    with machines(3) as m:
        job = Job(m, ["train", str(STEPS), "2:0"], 3, SYNK_HEARTBEAT_S="3")
        try:
            took = _machine_2_crashes_between_calls(job, m)
            print(f"a machine crashed between calls was dropped {took:.2f} s after")
            job.resume(2)
            job.until(r"^RESUME 2 machines 2 ")            # layout() shows it, raising nothing
            rc = job.wait(120)
        finally:
            job.close()
        out = job.out
        assert rc == 0 and "CLOSED" in out, out + job.node_output()
        assert re.search(rf"CAUGHT MachineLostError at step 3 completed False .*machine \d "
                         rf"\({m.names[2]}, ranks (\d)\.\.\1\).*found between two calls", out), out
        assert out.count("EVENT lost") == 1, out
        assert re.search(r"^step 3 \S+ sum \S+ on 2 machines 2 ranks", out, re.M), out
        _compare(out, serial_losses(STEPS))
        assert_nothing_left(m, out, "cluster_elastic.py", lost=(2,))


@on_machines
def test_four_machines_through_a_crash_an_intruder_a_join_and_a_cut():
    """Issue 40's proof in one run: every step equals the serial twin's, nothing is left.

    Machines 0 (the controller), 1 and 2 start; after step 2 machine 2 crashes and,
    while the program still sits between calls, a joiner with a wrong secret knocks on
    machine 3 and is refused; after step 4 machine 3 joins; after step 6 machine 1's
    link is cut.  The run ends on machines 0 and 3.
    """
    steps = 10
    with machines(4) as m:
        job = Job(m, ["train", str(steps), "2:0,4:3,6:0"], 3, SYNK_HEARTBEAT_S="3")
        try:
            _machine_2_crashes_between_calls(job, m)
            refused = _refused_intruder(job, m, 3)
            assert "RESUME 2" not in job.out, job.out        # answered between calls
            assert refused < 2.0, refused                     # from its knock
            job.resume(2)
            job.until(r"^PAUSE 4$")
            job.join(3)
            job.resume(4)
            job.until(r"^RESUME 4 machines 3 ")
            job.until(r"^PAUSE 6$")
            m.cut(1)
            job.resume(6)
            rc = job.wait(150)
        finally:
            job.close()
        out = job.out
        print(f"intruder refused {refused:.2f} s after it knocked")
        assert rc == 0 and "CLOSED" in out, out + job.node_output()
        assert re.search(rf"CAUGHT MachineLostError at step 3 completed False .*"
                         rf"\({m.names[2]}, ranks (\d)\.\.\1\).*found between two calls", out), out
        assert re.search(rf"EVENT joined machine \d \({m.names[3]},", out), out
        assert re.search(r"^step 5 \S+ sum \S+ on 3 machines 3 ranks", out, re.M), out
        assert re.search(rf"CAUGHT MachineLostError at step 7 .*\({m.names[1]}, ranks (\d)\.\.\1\)"
                         r": its node master stopped answering", out), out
        assert re.search(r"^step 9 \S+ sum \S+ on 2 machines 2 ranks", out, re.M), out
        _compare(out, serial_losses(steps), at_least=steps - 1)
        assert_nothing_left(m, out, "cluster_elastic.py", lost=(2,))
