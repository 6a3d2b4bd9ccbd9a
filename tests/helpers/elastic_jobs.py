"""Jobs whose machines come and go (SYNK_LISTEN / SYNK_JOIN) on simulated machines, and what faults do.

Shared by tests/cluster/test_elastic.py and bench/faults.py.  ``Job`` starts
the controller on machine 0 and node masters on the machines named, each on
its own (no launcher between them), with the job's secret handed over in a
file; it reads the controller's output on a thread, and ``until`` waits for a
line.  ``run_training`` drives helpers/cluster_elastic.py's training run
through a plan of faults and joins and returns what it measured.
"""

import importlib.util
import os
import re
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from typing import NamedTuple

from .cluster_jobs import ROOT, TESTS, machines
from .machines import Machines

ELASTIC = os.path.join(TESTS, "helpers", "cluster_elastic.py")
PORT = 29517


def why_no_elastic():
    """Why jobs whose machines come and go cannot run here (no torch), or None.

    Not imported here: torch in pytest's own process (every test forks ranks from it)
    would only cost time; the jobs import it, and fail loudly where it has no gloo.
    """
    if importlib.util.find_spec("torch") is None:
        return ("torch is not installed (`make elastic-torch`, or pip install torch "
                "--index-url https://download.pytorch.org/whl/cpu)")
    return None


class Job:
    """An elastic job: the controller on machine 0, node masters started one by one."""

    def __init__(self, m, args, n_machines, script=ELASTIC, **env):
        self.m = m
        self.args = [script, *args]
        self.dir = tempfile.mkdtemp(prefix="synk-elastic-")
        secret = os.path.join(self.dir, "secret")
        with open(secret, "w") as f:
            f.write(secrets.token_hex(16))
        on_machines = isinstance(m, Machines)
        host = m.addresses[0] if on_machines else "127.0.0.1"
        port = PORT if on_machines else _free_port()
        self.env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                        SYNK_SECRET_FILE=secret, SYNK_SPIN_S="0", PAUSE_DIR=self.dir)
        # A benchmark may spin as fork() chooses (SYNK_SPIN_S=None), the tests do not.
        self.env.update(env)
        self.env = {k: v for k, v in self.env.items() if v is not None}
        self.env.pop("SYNK_CLUSTER", None)
        self.address = f"{host}:{port}"
        self.lines = []
        self.nodes = {}
        self.controller = self._start(0, SYNK_LISTEN=self.address, SYNK_MACHINES=str(n_machines))
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _start(self, i, **env):
        return self.m.popen(i, [sys.executable, *self.args], cwd=TESTS,
                            env=dict(self.env, **env), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)

    def _read(self):
        for line in self.controller.stdout:
            self.lines.append((time.monotonic(), line))

    def join(self, i):
        """Start a node master on machine ``i``; return when it was started (monotonic)."""
        t = time.monotonic()
        self.nodes[i] = self._start(i, SYNK_JOIN=self.address)
        return t

    def resume(self, k):
        open(os.path.join(self.dir, str(k)), "w").close()

    @property
    def out(self):
        return "".join(line for _, line in self.lines)

    def until(self, pattern, timeout=120):
        """The first match of ``pattern`` in the controller's output (waits up to ``timeout``)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = re.search(pattern, self.out, re.M)
            if found:
                return found
            if self.controller.poll() is not None and not self.reader.is_alive():
                break
            time.sleep(0.02)
        raise AssertionError(f"no {pattern!r} in the controller's output:\n{self.out}"
                             + self.node_output())

    def node_output(self):
        out = ""
        for i, p in self.nodes.items():
            if p.poll() is not None:
                out += f"\n--- machine {i} (exit {p.returncode}):\n{p.stdout.read()[-3000:]}"
        return out

    def wait(self, timeout=120):
        try:
            self.controller.wait(timeout)
            self.t_exit = time.monotonic()
        finally:
            self.close()
        self.reader.join(10)
        return self.controller.returncode

    def close(self):
        for p in [self.controller, *self.nodes.values()]:
            if p.poll() is None:
                p.kill()
            p.wait()
            if p.stdout and p is not self.controller:
                p.stdout.close()
        subprocess.run(["rm", "-rf", self.dir])


def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def losses(out):
    """{step: (loss, produced sum)} of a training run's output ("lost" for a step without one)."""
    got = {}
    for k, loss, s in re.findall(r"^step (\d+) (\S+)(?: sum (\S+))?", out, re.M):
        got[int(k)] = (loss, s)
    return got


def serial_losses(n_steps):
    """The serial twin: the same training run on one rank, one machine."""
    env = dict(os.environ, SYNK_CLUSTER="0",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("SYNK_LISTEN", None)
    p = subprocess.run([sys.executable, ELASTIC, "train", str(n_steps), ""], cwd=TESTS, env=env,
                       capture_output=True, text=True, timeout=200)
    assert p.returncode == 0, p.stdout + p.stderr
    return losses(p.stdout)


class Event(NamedTuple):
    """What one fault or join did: seconds from it to the error (or to the machine's
    admission), to the first step made after it, and the step lines' layouts."""

    what: str
    t_error: float
    t_first: float


def run_training(n_start, n_steps, plan, heartbeat_s=3.0, timeout=200):
    """Run the training job on simulated machines through ``plan``; return (job output, events, m).

    ``plan``: {step: (action, machine)} with action "crash", "cut" or "join"; after
    that step the controller pauses, the action is done, and the run goes on.
    Every machine's leftovers are checked by the caller (``m`` is still open).
    """
    want = {}
    n = n_start
    for k in sorted(plan):
        n += 1 if plan[k][0] == "join" else -1
        want[k] = n if plan[k][0] == "join" else 0
    n_all = n_start + sum(a == "join" for a, _ in plan.values())
    m = machines(n_all)
    m.__enter__()
    job = Job(m, ["train", str(n_steps), ",".join(f"{k}:{v}" for k, v in want.items())],
              n_start, SYNK_HEARTBEAT_S=str(heartbeat_s))
    events = []
    try:
        for i in range(1, n_start):
            job.join(i)
        for k in sorted(plan):
            action, i = plan[k]
            job.until(rf"^PAUSE {k}$", timeout)
            n_lines = len(job.lines)
            if action == "join":
                t0 = job.join(i)
            else:
                t0 = time.monotonic()
                (m.crash if action == "crash" else m.cut)(i)
            job.resume(k)
            job.until(rf"^RESUME {k} ", timeout)
            events.append((action, i, t0, n_lines))
        rc = job.wait(timeout)
    except BaseException:
        job.close()
        m.__exit__(None, None, None)
        raise
    out = job.out
    measured = []
    for action, i, t0, n_lines in events:
        after = job.lines[n_lines:]
        first = next((float(re.search(r" at ([\d.]+)", line).group(1)) for _, line in after
                      if line.startswith("step ")), None)
        mark = "EVENT joined" if action == "join" else "CAUGHT"
        err = next((float(re.search(r" at ([\d.]+)", line).group(1))
                    for _, line in after if line.startswith(mark)), None)
        measured.append(Event(f"{action} machine {i}", None if err is None else err - t0,
                              None if first is None else first - t0))
    closed = next((t for t, line in job.lines if line.startswith("CLOSED")), None)
    if closed is not None:
        # How long the controller's process took to end after synk.close() returned.
        measured.append(Event("exit after close", job.t_exit - closed, None))
    return rc, out, measured, m
