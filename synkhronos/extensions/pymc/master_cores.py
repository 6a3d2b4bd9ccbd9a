"""The cores the master runs PyMC's own sampling on, where dp.sample does not split.

``fork()`` pinned the master to one core; pm.sample's chain processes (which
inherit its cores) and nutpie's threads need the cores it had before.  The
ranks wait for the next command meanwhile, asleep after a short spin.
"""

import contextlib
import os

from ...runtime.state import get_runtime


def unpinned_cores():
    """The cores this process may run on once released: those it had before ``fork()`` pinned it."""
    rt = get_runtime()
    before = getattr(getattr(rt, "processes", None), "unpinned", None) if rt is not None else None
    return set(before) if before else os.sched_getaffinity(0)


@contextlib.contextmanager
def released():
    """Within: this process runs on every core it had before ``fork()`` pinned it to one."""
    pinned = os.sched_getaffinity(0)
    os.sched_setaffinity(0, unpinned_cores())
    try:
        yield
    finally:
        os.sched_setaffinity(0, pinned)
