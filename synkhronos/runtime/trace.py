"""Phase stamps: when each process of one machine reached each step of a command (SYNK_TRACE=1).

``bench/breakdown.py`` sets ``SYNK_TRACE=1`` before importing synkhronos and
reads, after every command, when the leader and each rank passed each phase
of it (one row of ``perf_counter_ns`` stamps per local rank, in a shared
anonymous mapping made at import, so forked ranks write into the same one).
Off (the default), the hot path pays one test of a module constant per stamp.
"""

import mmap
import os
import time

import numpy as np

ON = os.environ.get("SYNK_TRACE") == "1"

# In the order a command passes them.
PHASES = ("checked", "posted", "woke", "share_start", "share_done", "finished", "waited",
          "combined")
CHECKED, POSTED, WOKE, SHARE_START, SHARE_DONE, FINISHED, WAITED, COMBINED = range(len(PHASES))
MAX_RANKS = 256
_WIDTH = 8  # slots per rank (one cache line)

_map = mmap.mmap(-1, MAX_RANKS * _WIDTH * 8) if ON else None
_slots = memoryview(_map).cast("q") if ON else None
_row = [0]
_clock = time.perf_counter_ns


def stamp(phase):
    """Note that this process reached ``phase`` now (only while ``ON``)."""
    _slots[_row[0] + phase] = _clock()


def set_rank(local_index):
    """Write this process's stamps into row ``local_index`` (a worker, after fork)."""
    if local_index >= MAX_RANKS:
        raise ValueError(f"SYNK_TRACE: at most {MAX_RANKS} ranks per machine")
    _row[0] = _WIDTH * local_index


def snapshot(n_local):
    """Return the stamps of local ranks ``0..n_local-1``: an (n_local, len(PHASES)) int64 array."""
    rows = np.frombuffer(_map, np.int64, n_local * _WIDTH).reshape(n_local, _WIDTH)
    return rows[:, :len(PHASES)].copy()


def clear(n_local):
    """Zero the stamps of local ranks ``0..n_local-1``."""
    np.frombuffer(_map, np.int64, n_local * _WIDTH)[:] = 0
