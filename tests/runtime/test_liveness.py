"""liveness: process state from /proc, stopping a process, the bounded waits and their checks, Monitor.

Processes are small subprocesses of the test (``sleep``, or a
Python child that reports when it is ready), never synkhronos ranks.
"""

import enum
import math
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import types

import pytest

from helpers.procs import wait_for
from synkhronos.runtime import liveness
from synkhronos.errors import CommAborted, SynkError, WorkerDiedError, WorkerStalledError

pytestmark = pytest.mark.timeout(60)

TICKS = os.sysconf("SC_CLK_TCK")

# A child that prints "ready" once its SIGTERM handler is set, then waits;
# argv[1] picks what SIGTERM does: "exit" (exit 7) or "ignore".  argv[2], if
# given, becomes its command name (what /proc/<pid>/stat shows in parentheses).
CHILD = textwrap.dedent("""
    import ctypes, signal, sys, time
    if len(sys.argv) > 2:
        ctypes.CDLL(None).prctl(15, sys.argv[2].encode(), 0, 0, 0)   # PR_SET_NAME
    if sys.argv[1] == "exit":
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))
    else:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("ready", flush=True)
    time.sleep(60)
""")


@pytest.fixture
def children():
    """Start Python children (see CHILD); every one still running is killed after the test."""
    started = []

    def start(on_term="exit", name=None):
        args = [sys.executable, "-c", CHILD, on_term] + ([name] if name else [])
        p = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
        started.append(p)
        assert p.stdout.readline().strip() == "ready"
        return p
    yield start
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait()
        p.stdout.close()


def _uptime_ticks():
    with open("/proc/uptime") as f:
        return float(f.read().split()[0]) * TICKS


def _reaped_pid():
    """The pid of a process that has exited and been reaped."""
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


# ---- /proc: alive, state, start time -------------------------------------------------------

def test_pid_alive_for_this_process_and_a_reaped_one():
    assert liveness.pid_alive(os.getpid())
    assert liveness.pid_alive(1)                 # alive, whether or not we may signal it
    assert not liveness.pid_alive(_reaped_pid())


def test_proc_state_follows_stop_continue_and_exit(children):
    assert liveness.proc_state(os.getpid()) == "R"          # reading its own stat: running
    p = children()
    assert wait_for(lambda: liveness.proc_state(p.pid) == "S")   # asleep in time.sleep
    os.kill(p.pid, signal.SIGSTOP)
    assert wait_for(lambda: liveness.proc_state(p.pid) == "T")
    os.kill(p.pid, signal.SIGCONT)
    assert wait_for(lambda: liveness.proc_state(p.pid) == "S")
    os.kill(p.pid, signal.SIGKILL)
    assert wait_for(lambda: liveness.proc_state(p.pid) == "Z")   # dead, not yet reaped
    p.wait()
    assert liveness.proc_state(p.pid) is None
    assert liveness.proc_start_time(p.pid) is None


def test_start_time_is_when_the_process_started(children):
    before = _uptime_ticks()
    p = children()
    after = _uptime_ticks()
    started = liveness.proc_start_time(p.pid)
    assert isinstance(started, int)
    # Clock ticks since boot, as /proc/uptime counts them (one tick of rounding either side).
    assert before - 1 <= started <= after + 1, (before, started, after)
    assert liveness.proc_start_time(p.pid) == started         # it names that one process
    assert liveness.proc_start_time(os.getpid()) <= started


def test_a_command_name_with_spaces_and_parentheses_is_skipped(children):
    # The name is free text in parentheses: the fields start after the last ")".
    before = _uptime_ticks()
    p = children(name="a) b (c) d")
    after = _uptime_ticks()
    with open(f"/proc/{p.pid}/stat") as f:
        assert "(a) b (c) d)" in f.read()
    assert wait_for(lambda: liveness.proc_state(p.pid) == "S")
    assert before - 1 <= liveness.proc_start_time(p.pid) <= after + 1


# ---- stop_process ----------------------------------------------------------------------------

def test_stop_process_kills_at_once_without_grace(children):
    p = children("exit")
    liveness.stop_process(p.pid)
    assert p.wait(10) == -signal.SIGKILL            # not SIGTERM: the child would exit 7


def test_stop_process_with_grace_lets_it_exit_on_sigterm(children):
    p = children("exit")
    liveness.stop_process(p.pid, grace_s=10.0)
    assert p.wait(10) == 7


def test_stop_process_continues_a_stopped_process_so_it_can_act_on_sigterm(children):
    p = children("exit")
    os.kill(p.pid, signal.SIGSTOP)
    assert wait_for(lambda: liveness.proc_state(p.pid) == "T")
    liveness.stop_process(p.pid, grace_s=10.0)
    assert p.wait(10) == 7


def test_stop_process_kills_what_ignores_sigterm_after_the_grace(children):
    p = children("ignore")
    liveness.stop_process(p.pid, grace_s=0.2)
    assert p.wait(10) == -signal.SIGKILL


def test_stop_process_reaps_its_own_child(children):
    p = children()
    liveness.stop_process(p.pid, reap=True)
    assert liveness.proc_state(p.pid) is None        # no zombie left: reaped


def test_stop_process_leaves_a_process_that_started_at_another_time(children):
    p = children("exit")
    liveness.stop_process(p.pid, started=liveness.proc_start_time(p.pid) + 1)   # a reused pid
    os.kill(p.pid, signal.SIGTERM)
    assert p.wait(10) == 7                           # not killed: its own handler ran
    q = children("exit")
    liveness.stop_process(q.pid, started=liveness.proc_start_time(q.pid))
    assert q.wait(10) == -signal.SIGKILL


def test_stop_process_of_a_gone_pid_does_nothing():
    pid = _reaped_pid()
    assert liveness.stop_process(pid) is None
    assert liveness.stop_process(pid, grace_s=0.1, reap=True) is None


# ---- checks ----------------------------------------------------------------------------------

def test_deadline_check_raises_only_past_its_deadline():
    liveness.deadline_check(3600.0, "not yet")()
    check = liveness.deadline_check(0.0, "took too long")
    with pytest.raises(SynkError, match="took too long"):
        liveness.wait_until(lambda: False, check, spin_s=0.0)
    assert liveness.no_check() is None


def test_command_check_asks_alive_first_then_aborted():
    calls = []

    def alive():
        calls.append("alive")

    def dead():
        raise WorkerDiedError("rank 1 died", 1, -9)

    liveness.command_check(alive, lambda: False)()
    assert calls == ["alive"]
    with pytest.raises(CommAborted):
        liveness.command_check(alive, lambda: True)()
    with pytest.raises(WorkerDiedError):               # a death outranks an abort
        liveness.command_check(dead, lambda: True)()


def test_an_abort_seen_after_the_awaited_rank_arrived_does_not_count():
    box = {"arrived": False}

    def arrive_then_abort():
        box["arrived"] = True          # the rank got there just as the abort was seen
        raise CommAborted("aborted")

    liveness.wait_until(lambda: box["arrived"], arrive_then_abort, spin_s=0.0)
    box["arrived"] = False
    assert liveness.spin_until(lambda: box["arrived"], arrive_then_abort, 60.0)

    def abort():
        raise CommAborted("aborted")

    with pytest.raises(CommAborted):
        liveness.wait_until(lambda: False, abort, spin_s=0.0)
    with pytest.raises(CommAborted):
        liveness.spin_until(lambda: False, abort, 5.0)


def test_worker_check_ends_a_worker_whose_master_is_gone():
    code = ("import os; from synkhronos.runtime import liveness\n"
            "liveness.worker_check(os.getppid())(); print('kept', flush=True)\n"
            "liveness.worker_check(os.getppid() + 1)(); print('not reached')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert out.returncode == 1, out.stderr
    assert out.stdout.split() == ["kept"]


# ---- Monitor ---------------------------------------------------------------------------------

class FakeProc:
    """What Monitor reads of a multiprocessing.Process."""

    def __init__(self, pid, alive=True, exitcode=None):
        self.pid, self.alive, self.exitcode = pid, alive, exitcode

    def is_alive(self):
        return self.alive


Cmd = enum.IntEnum("Cmd", ["ALL_REDUCE"])


def _monitor(procs, pending, timeout_s=math.inf, offset=0, remote=()):
    place = types.SimpleNamespace(rank_offset=offset)
    return liveness.Monitor(procs, timeout_s, lambda: list(pending), place, lambda: list(remote))


def test_monitor_is_quiet_while_every_worker_runs():
    me = os.getpid()
    m = _monitor({1: FakeProc(me), 2: FakeProc(me)}, [1, 2])
    m.begin("call of f")
    for _ in range(3):
        m()


def test_monitor_names_a_dead_worker_that_owes_the_command():
    procs = {1: FakeProc(os.getpid()), 2: FakeProc(4242, alive=False, exitcode=-9)}
    with pytest.raises(WorkerDiedError) as info:
        _monitor(procs, [1, 2])()
    err = info.value
    assert type(err) is WorkerDiedError and err.rank == 2 and err.exitcode == -9
    assert "rank 2 (pid 4242)" in str(err) and "exit code -9" in str(err)
    # Global ranks in a cluster: local index 2 of a machine whose ranks start at 4.
    with pytest.raises(WorkerDiedError) as info:
        _monitor(procs, [2], offset=4)()
    assert info.value.rank == 6 and "rank 6" in str(info.value)


def test_monitor_ignores_a_worker_that_finished_and_exited():
    # After QUIT a worker posts its status and exits: no longer pending, not dead to us.
    _monitor({1: FakeProc(4242, alive=False, exitcode=0)}, [])()


def test_monitor_names_a_stopped_worker(children):
    p = children()
    os.kill(p.pid, signal.SIGSTOP)
    assert wait_for(lambda: liveness.proc_state(p.pid) == "T")
    m = _monitor({1: FakeProc(os.getpid()), 2: FakeProc(p.pid)}, [1, 2], offset=3)
    m.begin(Cmd.ALL_REDUCE)
    with pytest.raises(WorkerStalledError) as info:
        m()
    err = info.value
    assert err.rank == 5 and err.exitcode is None
    assert f"rank 5 (pid {p.pid}) is stopped" in str(err) and "all_reduce" in str(err)
    assert isinstance(err, WorkerDiedError)              # handled as a dead rank


def test_monitor_names_every_late_rank_past_the_timeout():
    me = os.getpid()
    procs = {1: FakeProc(me), 2: FakeProc(me), 3: FakeProc(me)}
    m = _monitor(procs, [3, 1], timeout_s=0.0)
    m.begin("call of step")
    with pytest.raises(WorkerStalledError) as info:
        m()
    msg = str(info.value)
    assert info.value.rank == 3 and "ranks 3, 1 ran call of step for" in msg
    assert "past the timeout of 0 s" in msg
    # A cluster adds the ranks of machines still busy; nothing pending here names every rank.
    m = _monitor(procs, [], timeout_s=0.0, offset=10, remote=[20, 21])
    with pytest.raises(WorkerStalledError, match=r"ranks 20, 21 ran nothing"):
        m()
    m = _monitor(procs, [], timeout_s=0.0)
    with pytest.raises(WorkerStalledError, match=r"ranks 1, 2, 3 ran"):
        m()
    with pytest.raises(WorkerStalledError, match=r"rank 7 ran") as info:   # no workers at all
        _monitor({}, [], timeout_s=0.0, offset=7)()
    assert info.value.rank == 7


def test_monitor_without_a_timeout_never_times_out():
    m = _monitor({1: FakeProc(os.getpid())}, [1], timeout_s=math.inf)
    m.started -= 10 ** 9                                   # as if it had run for 30 years
    m()


# -- the bounded waits every barrier of the control channel is built on --------------

class Flag:
    """A predicate that comes true after ``n`` evaluations."""

    def __init__(self, n):
        self.n = n
        self.calls = 0

    def __call__(self):
        self.calls += 1
        return self.calls > self.n


class Checks:
    def __init__(self, fail_after=None):
        self.calls = 0
        self.fail_after = fail_after

    def __call__(self):
        self.calls += 1
        if self.fail_after is not None and self.calls > self.fail_after:
            raise RuntimeError("peer died")


def test_spin_until_returns_true_when_the_predicate_holds():
    check = Checks()
    assert liveness.spin_until(lambda: True, check, 0.0)
    assert check.calls == 0
    assert liveness.spin_until(Flag(1000), check, 5.0)


def test_spin_until_gives_up_after_spin_s():
    t0 = time.perf_counter()
    assert liveness.spin_until(lambda: False, Checks(), 0.05) is False
    assert time.perf_counter() - t0 < 5.0


def test_spin_until_calls_check_while_spinning():
    check = Checks()
    liveness.spin_until(lambda: False, check, 0.1)
    assert check.calls >= 1


def test_spin_until_propagates_the_check_exception():
    with pytest.raises(RuntimeError, match="peer died"):
        liveness.spin_until(lambda: False, Checks(fail_after=0), 5.0)


def test_wait_until_returns_when_another_thread_sets_the_flag():
    box = {"go": False}
    timer = threading.Timer(0.1, lambda: box.update(go=True))
    timer.start()
    check = Checks()
    liveness.wait_until(lambda: box["go"], check, spin_s=0.0)
    timer.join()
    assert box["go"]
    assert check.calls >= 1          # it kept checking while it slept


def test_wait_until_is_bounded_by_check():
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match="peer died"):
        liveness.wait_until(lambda: False, Checks(fail_after=2), spin_s=0.0)
    assert time.perf_counter() - t0 < 5.0


def test_wait_until_returns_at_once_when_true():
    check = Checks()
    liveness.wait_until(lambda: True, check, spin_s=0.01)
    assert check.calls == 0


