"""The Leaders suite: every method of ``comm.leaders.Leaders`` against NumPy, written once, run per carrier.

Run as a script, one process per leader: ``mpiexec -n N python leaders_suite.py mpi``
(``MpiLeaders`` on the job's communicator), or N processes of ``python
leaders_suite.py gloo RANK N STORE`` (``GlooLeaders`` on a ``FileStore``).  Every
leader runs the checks below in the same order; each computes what it expects
from the leaders' ranks alone and asserts.  A failed assertion is reported and
the next check runs (the collectives stay in step); any other error ends the
job.  Each leader prints ``PID <pid>`` first, ``R<rank> OK <check>`` or
``R<rank> FAIL <check>: <why>`` per check, and ``R<rank> DONE`` at the end.

``CARRIERS`` names every implementation of the contract (the test holds it
against the classes the package defines).
"""

import os
import sys
import time
import traceback

import numpy as np

# name -> (module, class): every carrier of the leaders' collectives.
CARRIERS = {"mpi": ("synkhronos.comm.mpi_leaders", "MpiLeaders"),
            "gloo": ("synkhronos.comm.gloo_leaders", "GlooLeaders")}
N_LEADERS = 3   # odd, so that a root in the middle and machine order both show
OPS = ["avg", "sum", "prod", "max", "min"]
DTYPES = ["bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
          "float16", "float32", "float64"]
SHAPES = [(0,), (), (1,), (3, 4)]
BIG = 300_001   # elements: a message of its own, several rounds of the carrier's algorithm
UFUNCS = {"avg": np.add, "sum": np.add, "prod": np.multiply, "max": np.maximum,
          "min": np.minimum}


def _value(rank, shape, dtype, salt=0):
    """A deterministic, rank-dependent array of 1..4: sums and products over the leaders stay
    exact and in range for every dtype."""
    n = int(np.prod(shape, dtype=np.int64))
    base = (np.arange(n) * 7 + salt) % 3 + rank % 2 + 1
    return base.astype(dtype).reshape(shape)


def _reduced(op, parts):
    """NumPy's reduction of the leaders' parts, in their dtype (``avg`` travels as a sum: the
    caller divides by the mass, comm/mpi_reduce.py)."""
    out = parts[0].copy()
    for p in parts[1:]:
        UFUNCS[op](out, p, out=out)
    return out


def _as(buf, like):
    """The result buffer ``buf`` read as an array of ``like``'s dtype and shape."""
    return np.asarray(buf).reshape(-1).view(np.uint8).view(like.dtype).reshape(like.shape)


def _same(got, want):
    got = np.asarray(got)
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape,
                                                                 want.dtype, want.shape)
    assert got.tobytes() == want.tobytes(), (got, want)


# ---- the checks: run on every leader, in this order -------------------------------------
def ranks(ld, env):
    """``rank`` and ``size``: each leader its own place, in machine order."""
    assert ld.size == env.n and 0 <= ld.rank < env.n
    assert ld.all_gather(ld.rank, env.check) == list(range(env.n))
    assert isinstance(ld.gen, int)


def barrier(ld, env):
    """A barrier returns once every leader came, and the leaders that wait call the check."""
    for _ in range(3):
        ld.barrier(env.check)
    calls = env.calls
    if ld.rank == 0:
        time.sleep(0.3)
    t0 = time.monotonic()
    ld.barrier(env.check)
    if ld.rank != 0:
        assert time.monotonic() - t0 > 0.1
        assert env.calls > calls, "a waiting leader never called the check"


def _all_reduce(ld, env, op):
    for dtype in DTYPES:
        if not ld.reduces(op, dtype):
            continue
        shapes = SHAPES + ([(BIG,)] if dtype in ("uint8", "int32", "float32", "float64") else [])
        mine = [_value(ld.rank, s, dtype, salt=i) for i, s in enumerate(shapes)]
        # Half the results into the caller's buffers, half into the carrier's.
        into = [np.empty(a.shape, a.dtype) if i % 2 else None for i, a in enumerate(mine)]
        got = ld.all_reduce([(a, op, o) for a, o in zip(mine, into)], env.check)
        assert len(got) == len(mine)
        for i, (g, a, o) in enumerate(zip(got, mine, into)):
            want = _reduced(op, [_value(q, a.shape, dtype, salt=i) for q in range(env.n)])
            _same(_as(g, a), want)
            if o is not None:
                _same(o, want)


def all_reduce_avg(ld, env):
    """``avg``: the leaders' sum, in every dtype the carrier reduces, sizes 0 to large."""
    _all_reduce(ld, env, "avg")


def all_reduce_sum(ld, env):
    """``sum`` as NumPy's, in every dtype the carrier reduces, sizes 0 to large."""
    _all_reduce(ld, env, "sum")


def all_reduce_prod(ld, env):
    """``prod`` as NumPy's, in every dtype the carrier reduces, sizes 0 to large."""
    _all_reduce(ld, env, "prod")


def all_reduce_max(ld, env):
    """``max`` as NumPy's, in every dtype the carrier reduces, sizes 0 to large."""
    _all_reduce(ld, env, "max")


def all_reduce_min(ld, env):
    """``min`` as NumPy's, in every dtype the carrier reduces, sizes 0 to large."""
    _all_reduce(ld, env, "min")


def all_reduce_mixed(ld, env):
    """One call of several ops and dtypes: each array reduced with its own op."""
    sends = [(op, dtype) for op in OPS for dtype in ("int32", "float64") if ld.reduces(op, dtype)]
    mine = [_value(ld.rank, (5,), d, salt=i) for i, (_, d) in enumerate(sends)]
    got = ld.all_reduce([(a, op, None) for a, (op, _) in zip(mine, sends)], env.check)
    for i, (g, a, (op, d)) in enumerate(zip(got, mine, sends)):
        _same(_as(g, a), _reduced(op, [_value(q, (5,), d, salt=i) for q in range(env.n)]))


def all_reduce_in_a_kept_buffer(ld, env):
    """An array that is a view of the carrier's own buffer for its slot is reduced in place
    (comm/mpi_reduce.py packs small arrays there)."""
    for n in (7, BIG):
        buf = ld.buffer(("r", 0), n * 4)
        a = buf.view(np.float32)
        a[:] = _value(ld.rank, (n,), np.float32)
        got = ld.all_reduce([(a, "sum", None)], env.check)
        assert np.shares_memory(got[0], buf)
        _same(a, _reduced("sum", [_value(q, (n,), np.float32) for q in range(env.n)]))


def all_reduce_floats_agree(ld, env):
    """Floats whose sum depends on the order: every leader gets the same bytes, near NumPy's."""
    for dtype in ("float32", "float64"):
        a = np.random.default_rng(ld.rank).normal(size=1000).astype(dtype)
        got = _as(ld.all_reduce([(a, "sum", None)], env.check)[0], a).copy()
        every = ld.all_gather_fixed(got.view(np.uint8), env.check)
        assert all(np.array_equal(every[0], every[m]) for m in range(env.n)), "leaders differ"
        want = sum(np.random.default_rng(q).normal(size=1000).astype(dtype).astype(np.float64)
                   for q in range(env.n))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def all_reduce_kept(ld, env):
    """Buffers the caller keeps, reduced in place; again on new values in the same buffers."""
    for dtype in ("int8", "int64", "float32", "float64"):
        for op in OPS:
            if not ld.reduces(op, dtype):
                continue
            bufs = [np.empty(s, dtype) for s in ((3,), (0,), (BIG,))]
            for step in range(2):
                for i, b in enumerate(bufs):
                    b[...] = _value(ld.rank, b.shape, dtype, salt=i + step)
                ld.all_reduce_kept([(b, op) for b in bufs], env.check)
                for i, b in enumerate(bufs):
                    _same(b, _reduced(op, [_value(q, b.shape, dtype, salt=i + step)
                                           for q in range(env.n)]))


def all_gather_fixed(ld, env):
    """Every leader's bytes, stacked in machine order."""
    for n in (0, 1, 17, 1 << 20):
        mine = ((np.arange(n) + 31 * ld.rank) % 251).astype(np.uint8)
        got = ld.all_gather_fixed(mine, env.check)
        assert got.shape == (env.n, n) and got.dtype == np.uint8
        for m in range(env.n):
            _same(got[m], ((np.arange(n) + 31 * m) % 251).astype(np.uint8))


def _broadcast_cases():
    odd = np.arange(24, dtype=np.float64).reshape(4, 6)[:, ::2]   # not C-ordered at the root
    return {
        "small": [np.arange(3, dtype=np.float32), np.array(2.5), np.array([True, False])],
        "large": [np.arange(BIG, dtype=np.float32), np.arange(BIG // 3, dtype=np.int64) - 7],
        "many": [np.full(2, i, np.int16) for i in range(120)],   # the layout outgrows the head
        "empty": [np.zeros((0, 5), np.float16), np.zeros(0, np.uint8), np.array(1, np.int8)],
        "odd": [odd, np.arange(6, dtype=">i4"), np.arange(4, dtype=np.complex64)],
        "none": [],
    }


def broadcast(ld, env):
    """The root's arrays (dtypes, 0-d and 0-size, large, many) on every leader, from every root."""
    for root in range(env.n):
        for name, arrays in _broadcast_cases().items():
            got = ld.broadcast(arrays if ld.rank == root else None, root, env.check)
            assert len(got) == len(arrays), name
            for g, a in zip(got, arrays):
                _same(g, np.ascontiguousarray(a) if a.ndim else a)


def _obj(m):
    """Machine m's object for the gathers: arrays of m-dependent shapes, lists, None."""
    big = [np.arange(BIG, dtype=np.float32) + m] if m == 1 else []
    return [np.arange((m + 1) * 2, dtype=np.int64).reshape(m + 1, 2), None,
            [np.array(m, np.float32), np.zeros((0, 3), np.float16)], big, f"machine {m}"]


def _same_obj(got, want):
    assert type(got) is type(want), (got, want)
    if isinstance(want, np.ndarray):
        _same(got, want)
    elif isinstance(want, list):
        assert len(got) == len(want), (got, want)
        for g, w in zip(got, want):
            _same_obj(g, w)
    else:
        assert got == want, (got, want)


def all_gather(ld, env):
    """Every leader's object (sizes differ: no cropping, no padding), in machine order."""
    got = ld.all_gather(_obj(ld.rank), env.check)
    _same_obj(got, [_obj(m) for m in range(env.n)])
    assert ld.all_gather(None, env.check) == [None] * env.n


def gather(ld, env):
    """At the root every leader's object in machine order; None elsewhere; from every root."""
    for root in range(env.n):
        got = ld.gather(_obj(ld.rank), root, env.check)
        if ld.rank == root:
            _same_obj(got, [_obj(m) for m in range(env.n)])
        else:
            assert got is None


def scatter(ld, env):
    """Machine m gets entry m of the root's objects, from every root."""
    for root in range(env.n):
        objs = [_obj(m) + [root] for m in range(env.n)] if ld.rank == root else None
        _same_obj(ld.scatter(objs, root, env.check), _obj(ld.rank) + [root])


def buffers_and_renew(ld, env):
    """Kept buffers are reused until a renewal; after one, a fresh communicator of the same
    leaders at the new generation, whose collectives are right."""
    assert ld.buffer("suite", 64) is ld.buffer("suite", 64)
    old = ld.buffer("suite", 64)
    gen = ld.gen
    ld.renew(env.comm, gen + 1)
    assert ld.gen == gen + 1 and ld.size == env.n
    assert ld.buffer("suite", 64) is not old, "a buffer of the old communicator was reused"
    _all_reduce(ld, env, "sum")
    broadcast(ld, env)


def revoke_and_renew(ld, env):
    """A revoke (every leader, as when a machine is lost) then a renewal: collectives are right."""
    ld.revoke()
    ld.renew(env.comm, ld.gen + 1)
    ranks(ld, env)
    all_reduce_mixed(ld, env)


CHECKS = [ranks, barrier, all_reduce_avg, all_reduce_sum, all_reduce_prod, all_reduce_max,
          all_reduce_min, all_reduce_mixed, all_reduce_in_a_kept_buffer, all_reduce_floats_agree,
          all_reduce_kept, all_gather_fixed, broadcast, all_gather, gather, scatter,
          buffers_and_renew, revoke_and_renew]


# ---- the job ------------------------------------------------------------------------------
class Env:
    """What the checks need beside the carrier: the leaders' count, a counting check, and
    the communicator ``renew`` takes."""

    def __init__(self, n, comm):
        self.n = n
        self.comm = comm
        self.calls = 0

    def check(self):
        self.calls += 1


def _lost(exc):
    from synkhronos.errors import SynkError

    return SynkError(f"the leaders' collective failed: {exc}")


def _spin_s():
    # Three leaders on two cores: a leader that spins without yielding takes a core from
    # the one it waits for.
    return float(os.environ.get("SYNK_SPIN_S", "0"))


def _mpi():
    from mpi4py import MPI

    from synkhronos.comm.mpi_leaders import MpiLeaders

    comm = MPI.COMM_WORLD
    return MpiLeaders(MPI, comm, _spin_s(), _lost), Env(comm.Get_size(), comm)


def _gloo(rank, n, store_path):
    from synkhronos.comm.gloo_leaders import GlooLeaders, import_torch

    _, dist = import_torch()
    store = dist.FileStore(store_path, n)
    ld = GlooLeaders(store, "127.0.0.1", _spin_s(), _lost)
    env = Env(n, None)
    ld.regroup(rank, n, 0, 0, env.check)
    return ld, env


def _say(line):
    # One write per line: mpiexec merges the leaders' outputs by the chunk.
    os.write(1, (line.replace("\n", " | ") + "\n").encode())


def main(argv):
    _say(f"PID {os.getpid()}")
    ld, env = _mpi() if argv[0] == "mpi" else _gloo(int(argv[1]), int(argv[2]), argv[3])
    for fn in CHECKS:
        try:
            fn(ld, env)
        except AssertionError as exc:
            _say(f"R{ld.rank} FAIL {fn.__name__}: {exc!r:.600}")
        except BaseException:  # noqa: BLE001 - reported, then the job ends
            _say(f"R{ld.rank} FAIL {fn.__name__}: {traceback.format_exc()}")
            os._exit(1)   # the other leaders wait in a collective this one left
        else:
            _say(f"R{ld.rank} OK {fn.__name__}")
    ld.barrier(env.check)
    _say(f"R{ld.rank} DONE")
    if hasattr(ld, "close"):
        ld.close()


if __name__ == "__main__":
    main(sys.argv[1:])
