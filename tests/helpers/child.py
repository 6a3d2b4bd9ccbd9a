"""Run a test body in a forked child of the pytest process, for code that starts JAX.

A process forked after JAX started its backend hangs on its first JAX call,
so JAX-mode runtimes must fork from a master in which JAX never ran.  The
pytest process never starts JAX; each body that does runs in a fresh child
of it, which forks its own ranks, and is discarded afterwards.
"""

import os
import select
import signal
import time
import traceback

import synkhronos as synk
from synkhronos.runtime.commands import COMMANDS, Command
from synkhronos.runtime.run import run_command
from synkhronos.runtime.state import get_runtime

# Test functions travel as GET_VALUE commands tagged with this marker; the
# handler below passes every other GET_VALUE on to the real one.
TEST_CMD = Command.GET_VALUE
_MARK = "synk-test-fn"


def run(fn, *args, timeout=150):
    """Run ``fn(*args)`` in a forked child; raise AssertionError with its traceback if it fails.

    The child must leave no runtime and no segment of its own behind; a
    child still running after ``timeout`` seconds is killed and reported.
    """
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        _child(write_fd, fn, args)
    os.close(write_fd)
    deadline = time.monotonic() + timeout
    chunks = []
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                raise AssertionError(f"the test's child process hung for {timeout} s")
            ready, _, _ = select.select([read_fd], [], [], min(left, 1.0))
            if ready:
                chunk = os.read(read_fd, 1 << 16)
                if not chunk:
                    break
                chunks.append(chunk)
    finally:
        os.close(read_fd)
    _, status = os.waitpid(pid, 0)
    text = b"".join(chunks).decode(errors="replace")
    if text != "ok":
        raise AssertionError(f"in the test's child process (status {status}):\n{text}")


def _child(write_fd, fn, args):
    msg = "ok"
    try:
        try:
            fn(*args)
        finally:
            rt = get_runtime()
            if rt is not None and not rt.closed:
                synk.close()
        mine = [n for n in os.listdir("/dev/shm") if n.startswith(f"synk_{os.getpid()}_")]
        assert not mine, f"segments left in /dev/shm: {mine}"
    except BaseException:  # noqa: BLE001 - everything goes back to the test
        msg = traceback.format_exc()
    data = msg.encode()
    while data:
        data = data[os.write(write_fd, data):]
    os.close(write_fd)
    os._exit(0)


def enable_jax():
    """Load PyTensor's JAX backend and compute float64 graphs in float64 (no backend start)."""
    import jax
    import pytensor.link.jax.dispatch  # noqa: F401 - sets jax_enable_x64 from floatX

    jax.config.update("jax_enable_x64", True)


def on_every_rank():
    """Install the test handler (before fork); return ``run(fn, *args)`` for after fork.

    ``fn(rt, *args)`` then runs on every rank, the master included; a failed
    assertion in a worker comes back as WorkerError.  Only the child calls
    this, so the pytest process keeps its handlers.
    """
    real = COMMANDS[TEST_CMD].run

    def dispatch(rt, payload):
        if isinstance(payload, tuple) and len(payload) == 3 and payload[0] == _MARK:
            payload[1](rt, *payload[2])
        else:
            real(rt, payload)
    COMMANDS[TEST_CMD] = COMMANDS[TEST_CMD]._replace(run=dispatch)

    def run_all(fn, *args, after=None):
        rt = get_runtime()
        return run_command(rt, TEST_CMD, (_MARK, fn, args), local=lambda seq: fn(rt, *args),
                           after=after)
    return run_all
