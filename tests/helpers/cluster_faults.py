"""Run under mpiexec: one failure of a cluster job, named by argv[1]; the controller prints what it saw.

remote-error: a rank on another machine raises inside a call; the run goes on.
kill-node: the controller SIGKILLs machine 1's node master, then calls a function.
stop-node: the controller SIGSTOPs machine 1's node master, then calls a function.
kill-controller: the controller SIGKILLs itself after printing the job's pids.
stop-controller: the controller SIGSTOPs itself (as if cut off); the test ends it.
timeout: a rank on machine 1 sleeps past fork(timeout=12) inside a call.
idle: the controller sends nothing for longer than fork(timeout=8); the run goes on.
run: the controller prints READY and calls a function until an error (the test crashes or
    cuts off a machine meanwhile); it prints the error with the monotonic clock's time.
"""

import logging
import os
import signal
import sys
import time

import numpy as np
import pytensor
import pytensor.tensor as T

import synkhronos as synk
from procs import FailInRank, SleepIn
from synkhronos import ingraph
from synkhronos.runtime.state import get_runtime


# LOG=INFO shows every process's side (pids and times) when a run needs explaining.
logging.basicConfig(level=os.environ.get("LOG", "WARNING"),
                    format="%(process)d %(asctime)s %(name)s %(message)s")


mode, L = sys.argv[1], int(sys.argv[2])
# The timeout bounds each command, distribute's compiling included: 6.2 s once, for two
# ranks sharing a core while a benchmark ran, so the timeouts here are well above that.
n = synk.fork(L, timeout={"timeout": 12, "idle": 8}.get(mode))
rt = get_runtime()
print("PIDS", " ".join(str(p) for p in rt.peers.pids), rt.config.prefix, flush=True)
x = T.matrix("x")
f = synk.function([x], T.sum(x))
bad = synk.function([x], T.sum(FailInRank(n - 1)(x)))
# A rank fails before an in-graph collective of 2.4 MB: the other machines leave it
# mid-exchange, with large sends nobody will receive.
big = T.alloc(T.sum(x), 600000)
bad_collective = synk.function([x], T.sum(ingraph.psum(FailInRank(n - 1)(big))))
who = T.lvector("who")
slow = synk.function([x], T.sum(SleepIn(30)(x, who)), bcast_inputs=[who])
synk.distribute()
X = np.ones((10, 3), dtype=pytensor.config.floatX)
d = synk.data(X)
f(d)

if mode == "remote-error":
    try:
        bad(d)
    except ValueError as exc:
        print("CAUGHT", type(exc).__name__, "rank", exc.rank, flush=True)
        assert "planted failure" in str(exc)
    print("AFTER", float(f(d)), flush=True)
    for _ in range(2):
        try:
            bad_collective(d)
        except ValueError as exc:
            print("CAUGHT IN COLLECTIVE", type(exc).__name__, "rank", exc.rank, flush=True)
        print("AFTER COLLECTIVE", float(f(d)), flush=True)
    synk.close()
    print("CLOSED", flush=True)
elif mode in ("kill-node", "stop-node"):
    os.kill(rt.peers.pids[1], signal.SIGKILL if mode == "kill-node" else signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        for _ in range(100000):
            f(d)
    except synk.WorkerDiedError as exc:
        print("CAUGHT", type(exc).__name__, f"{time.monotonic() - t0:.2f}", str(exc).splitlines()[0],
              flush=True)
    print("CLOSED", flush=True)
elif mode == "timeout":
    slow(d, np.array([-1]))  # compiled everywhere first: the timeout then counts the sleep only
    t0 = time.monotonic()
    try:
        slow(d, np.array([L]))
    except synk.WorkerStalledError as exc:
        print("CAUGHT", type(exc).__name__, f"{time.monotonic() - t0:.2f}", str(exc).splitlines()[0],
              flush=True)
    print("CLOSED", flush=True)
elif mode == "idle":
    time.sleep(9.5)  # longer than the timeout (8 s)
    print("AFTER", float(f(d)), flush=True)
    synk.close()
    print("CLOSED", flush=True)
elif mode == "run":
    print("READY", flush=True)
    t_end = time.monotonic() + 120
    try:
        while time.monotonic() < t_end:
            f(d)
        print("NO ERROR", flush=True)
    except synk.SynkError as exc:
        print("CAUGHT", type(exc).__name__, f"at {time.monotonic():.3f}", str(exc).splitlines()[0],
              flush=True)
    synk.close()
    print("CLOSED", flush=True)
elif mode == "kill-controller":
    os.kill(os.getpid(), signal.SIGKILL)
elif mode == "stop-controller":
    print("STOPPING", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)
