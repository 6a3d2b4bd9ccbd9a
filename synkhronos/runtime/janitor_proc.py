"""The janitor's own program: wait for the leader to go, stop its workers, unlink its segments.

It runs by path in a fresh interpreter (``python -I -S janitor_proc.py``, started by
``janitor.Janitor``), so it imports only the standard library: a janitor forked from
the leader would hold a copy of the leader's whole heap, and every page the leader
writes afterwards would become the janitor's own (measured: 94 MiB of a PyMC master's
236 MiB).  ``shmem.sweep`` is this module's ``sweep``, imported.
"""

import json
import os
import shutil
import signal
import sys

SHM_DIR = "/dev/shm"
LOCK = "lock"   # the run's lock segment goes last (shmem.hold_run_lock)


def start_time(pid):
    """When process ``pid`` started (clock ticks since boot), or None if it is gone.

    With the pid it names one process: pids are reused, start times are not.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name may hold spaces and parentheses: the fields follow the last ")".
    return int(stat[stat.rindex(b")") + 2:].split()[19])


def sweep(prefix, shm_dir=SHM_DIR):
    """Unlink every segment whose name starts with ``prefix`` (a run's); return their names."""
    head = prefix[1:]
    removed = []
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return removed
    # The lock goes last: while it exists, another sweep does not take the run for dead.
    for fname in sorted(n for n in names if n.startswith(head) and n != head + LOCK) + [head + LOCK]:
        try:
            os.unlink(os.path.join(shm_dir, fname))
            removed.append(fname)
        except OSError:
            pass
    return removed


def clean_up(prefix, dirs, pids, told):
    """What the janitor does once the leader has gone."""
    for pid, started in pids:
        if started is not None and start_time(pid) == started:  # else gone (a reused pid)
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    sweep(prefix)
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)
    for line in told.decode(errors="replace").splitlines():
        if line.startswith(SHM_DIR + "/"):
            try:
                os.unlink(line)
            except OSError:
                pass


def later_pids(told):
    """Workers the leader started after the janitor (``Janitor.watch``): (pid, start time)."""
    out = []
    for line in told.decode(errors="replace").splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] == "pid":
            out.append((int(parts[1]), int(parts[2])))
    return out


def main(argv):
    """``argv``: the pipe's read end, then JSON: prefix, directories, [(pid, start time)]."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # A scheduler ending the job (Slurm at a time limit or scancel: SIGTERM to every
    # process of the step, SIGKILL after KillWait) must leave it to clean up after the leader.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    read_fd = int(argv[0])
    prefix, dirs, pids = json.loads(argv[1])
    told = b""
    try:
        while True:
            got = os.read(read_fd, 4096)
            if not got:
                break
            told += got
    except OSError:
        pass
    clean_up(prefix, dirs, [tuple(p) for p in pids] + later_pids(told), told)


if __name__ == "__main__":
    main(sys.argv[1:])
