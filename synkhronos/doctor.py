"""The environment report and the self-check behind ``python -m synkhronos``.

Nothing here prints: ``report()`` and ``check()`` return text and results,
and ``synkhronos/__main__.py`` (the program) writes them out.
"""

import importlib.metadata
import importlib.util
import math
import os
import platform
import signal
import sys
import traceback
from dataclasses import dataclass

import numpy as np

from .fork_plan import SETTINGS, environment, setting_problems

# Packages whose versions the report lists when they are installed.
PACKAGES = ("pytensor", "numpy", "scipy", "numba", "jax", "jaxlib", "cupy", "mpi4py", "pymc",
            "pyzmq", "posix_ipc", "threadpoolctl", "nvidia-ml-py")


def report():
    """Return the environment report as a list of ``(section, [(key, value), ...])``."""
    return [
        ("versions", _versions()),
        ("pytensor", _pytensor()),
        ("cpu", _cpu()),
        ("gpu", _gpus()),
        ("shared memory", shm_report()),
        ("backends", _backends()),
        ("settings", settings_report()),
    ]


def format_report(sections):
    """Return ``sections`` (as ``report()`` gives them) as aligned text."""
    width = max((len(k) for _, items in sections for k, _ in items), default=0)
    lines = []
    for title, items in sections:
        lines.append(f"{title}:")
        lines += [f"  {k.ljust(width)}  {v}" for k, v in items]
    return "\n".join(lines)


def _dist_version(name):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _versions():
    import synkhronos

    items = [("synkhronos", synkhronos.__version__),
             ("python", f"{platform.python_version()} ({sys.executable})"),
             ("platform", platform.platform())]
    for name in PACKAGES:
        version = _dist_version(name)
        if version is None and name == "cupy":
            # CuPy's wheels are named for their CUDA: cupy-cuda12x, cupy-cuda11x...
            found = [d for d in importlib.metadata.distributions()
                     if (d.metadata["Name"] or "").lower().startswith("cupy")]
            version = found and f"{found[0].version} ({found[0].metadata['Name']})"
        if version:
            items.append((name, version))
    return items


def _pytensor():
    import pytensor

    from . import compat

    supported = "supported" if compat.is_supported() else (
        f"NOT supported (synkhronos needs >= {'.'.join(map(str, compat.MIN_PYTENSOR))}, "
        f"< {compat.MAX_PYTENSOR_MAJOR + 1})")
    items = [("version", f"{pytensor.__version__} ({supported})"),
             ("default mode", f"{compat.default_mode_name()} (linker {compat.default_linker()})"),
             ("floatX", pytensor.config.floatX),
             ("C compiler", pytensor.config.cxx or "none (C code disabled)")]
    if compat.default_linker() in ("cvm", "c", "c|py"):
        ldflags = compat.blas_ldflags()
        items.append(("blas__ldflags", ldflags or "none: PyTensor's C code calls BLAS through "
                                                  "NumPy/SciPy (slower)"))
    try:
        from threadpoolctl import threadpool_info

        for pool in threadpool_info():
            items.append((f"{pool.get('user_api')} pool",
                          f"{pool.get('internal_api')} {pool.get('version') or ''}, "
                          f"{pool.get('num_threads')} threads ({pool.get('filepath')})"))
    except ImportError:
        items.append(("BLAS pools", "threadpoolctl not installed"))
    return items


def _ranges(ids):
    """Return sorted ints as ``0-3,6``."""
    ids, out, i = sorted(ids), [], 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        out.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(out)


def _cpu():
    usable = sorted(os.sched_getaffinity(0))
    items = [("cores (machine)", str(os.cpu_count())),
             ("cores (usable)", f"{len(usable)}: affinity {_ranges(usable)}"),
             ("CPU-mode ranks", f"{len(usable)} by default (one per usable core)")]
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            items.append(("cgroup CPU quota", f"{int(quota) / int(period):.2f} cores"))
    except (OSError, ValueError):
        pass
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                 "NUMBA_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "PYTENSOR_FLAGS"):
        if name in os.environ:
            items.append((name, os.environ[name]))
    return items


def _gpus():
    from .runtime import devices

    n = devices.count_gpus()
    items = [("count", f"{n} (NVML or nvidia-smi; no CUDA context made)")]
    try:
        import pynvml
    except ImportError:
        items.append(("NVML", "not installed (pip install nvidia-ml-py)"))
        return items
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001 - no driver is a finding, not a failure
        items.append(("NVML", f"no driver ({type(exc).__name__})"))
        return items
    try:
        driver = pynvml.nvmlSystemGetDriverVersion()
        items.append(("driver", driver.decode() if isinstance(driver, bytes) else str(driver)))
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(h)
            name = name.decode() if isinstance(name, bytes) else str(name)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            items.append((f"GPU {i}", f"{name}, {mem.total / 2**30:.1f} GiB "
                                      f"({mem.free / 2**30:.1f} GiB free)"))
    finally:
        pynvml.nvmlShutdown()
    return items


def stale_segments(shm_dir="/dev/shm"):
    """Return ``{run prefix: [names]}`` of segments of dead runs (whose lock nobody holds)."""
    from .runtime.shmem import dead_runs

    try:
        names = sorted(os.listdir(shm_dir))
    except OSError:
        return {}
    return {prefix: [n for n in names if n.startswith(prefix[1:])]
            for prefix in dead_runs(shm_dir)}


def shm_report(shm_dir="/dev/shm"):
    """Return the report items on the shared-memory directory: size, free space, stale segments."""
    try:
        st = os.statvfs(shm_dir)
    except OSError as exc:
        return [(shm_dir, f"unusable: {exc}")]
    size, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    items = [(shm_dir, f"{size / 2**30:.2f} GiB, {free / 2**30:.2f} GiB free")]
    if size < 1 << 30:
        items.append(("note", "small (Docker's default is 64 MB): run the container with "
                              "--shm-size=8g, or --ipc=host"))
    live = [n for n in os.listdir(shm_dir) if n.startswith("synk_")]
    stale = stale_segments(shm_dir)
    n_stale = sum(len(v) for v in stale.values())
    nbytes = 0
    for names in stale.values():
        for n in names:
            try:
                nbytes += os.stat(os.path.join(shm_dir, n)).st_size
            except OSError:
                pass
    items.append(("synk segments", f"{len(live)} ({len(live) - n_stale} of running programs)"))
    if n_stale:
        runs = ", ".join(p.strip("/").rstrip("_") for p in sorted(stale))
        items.append(("STALE segments", f"{n_stale}, {nbytes / 2**20:.1f} MiB, of exited "
                                        f"runs {runs}: the next fork() removes them "
                                        f"(or rm {shm_dir}/<run>_*)"))
    else:
        items.append(("stale segments", "none"))
    return items


def _backends():
    from . import comm
    from .errors import BackendUnavailableError

    items = []
    for name in comm.backend_names():
        try:
            comm.get_backend(name)
            items.append((name, "loads"))
        except (BackendUnavailableError, ImportError) as exc:
            items.append((name, f"unavailable: {exc}"))
    for what, mod, missing in (("nccl (GPU mode)", "cupy", "needs cupy-cuda12x and a GPU"),
                               ("mpi (clusters)", "mpi4py", "pip install mpi4py"),
                               ("JAX mode", "jax", "pip install jax")):
        items.append((what, f"{mod} present" if importlib.util.find_spec(mod) is not None
                      else f"unavailable: {missing}"))
    return items


def settings_report(env=None):
    """Return the report items on the ``SYNK_*`` settings set, INVALID ones flagged."""
    env = environment() if env is None else env
    bad = setting_problems(env)
    return [(k, f"INVALID: {bad[k]}" if k in bad else v if k in SETTINGS else
             f"{v!r} (not a synkhronos setting: a typo?)")
            for k, v in sorted(env.items())] or [("SYNK_*", "none set (defaults)")]


@dataclass
class Step:
    """One step of ``check()``: its name, whether it passed, and what went wrong."""

    name: str
    ok: bool
    detail: str = ""


class _Timeout(Exception):
    pass


def check(n_parallel=None, use_gpu=False, timeout=120):
    """Fork, run a function call and every collective, compare with NumPy; return the steps.

    Runs in the calling process (it becomes the master) and closes the
    runtime before returning, whatever happened.

    Args:
        n_parallel: number of ranks; default every usable core (or GPU).
        use_gpu: passed on to ``synk.fork``.
        timeout: seconds before the check gives up (a step that hangs fails), or math.inf.

    Returns:
        A list of ``Step``; the check passed if every step is ``ok``.

    Raises:
        ValueError: ``timeout`` is not a number > 0.
    """
    import synkhronos as synk
    from .runtime.state import get_runtime

    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"check: timeout must be a number of seconds > 0 or math.inf; got {timeout!r}")
    steps = []

    def on_alarm(signum, frame):
        raise _Timeout(f"no answer within {timeout:g} s")

    timed = math.isfinite(timeout)
    old = signal.signal(signal.SIGALRM, on_alarm) if timed else None
    if timed:
        signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        try:
            n = synk.fork(n_parallel, use_gpu=use_gpu)
            steps.append(Step(f"fork ({n} ranks, {get_runtime().config.device} mode)", True))
        except Exception as exc:  # noqa: BLE001 - reported as the step's failure
            steps.append(Step("fork", False, _why(exc)))
            return steps
        _collective_steps(synk, n, steps)
    except _Timeout as exc:
        steps.append(Step("timeout", False, str(exc)))
    finally:
        if timed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
        rt = get_runtime()
        pid = os.getpid()
        try:
            if rt is not None and not rt.closed:
                synk.close()
            left = [f for f in os.listdir("/dev/shm") if f.startswith(f"synk_{pid}_")]
            steps.append(Step("close (no segment left)", not left,
                              f"left in /dev/shm: {left}" if left else ""))
        except Exception as exc:  # noqa: BLE001
            steps.append(Step("close", False, _why(exc)))
    return steps


def _why(exc):
    tb = traceback.format_exception_only(type(exc), exc)
    return "".join(tb).strip()


def _collective_steps(synk, n, steps):
    """Build, distribute, call, then each collective; a failed step does not stop the rest."""
    import pytensor
    import pytensor.tensor as pt

    rows = 2 * n + 1                                    # uneven: some ranks get one more
    x_np = np.arange(rows * 3, dtype="float64").reshape(rows, 3) / 7.0
    parts = np.array_split(x_np, n)
    x = pt.dmatrix("x")
    s = pytensor.shared(np.zeros(3), name="doctor_s")
    v = pytensor.shared(np.zeros(0), name="doctor_v")
    try:
        f = synk.function([x], [(x.sum(axis=0), "sum"), (x.mean(axis=0), "avg"),
                                (x.max(axis=0), "max"), (2 * x, "gather")],
                          updates=[(s, x.sum(axis=0))], name="doctor_f")
        g = synk.function([], (v.sum(), "sum"), name="doctor_g")
        synk.distribute()
        steps.append(Step("build and distribute", True))
    except Exception as exc:  # noqa: BLE001
        steps.append(Step("build and distribute", False, _why(exc)))
        return

    def step(name, body):
        try:
            body()
            steps.append(Step(name, True))
        except _Timeout:
            raise
        except Exception as exc:  # noqa: BLE001 - reported as the step's failure
            steps.append(Step(name, False, _why(exc)))

    def call():
        got = f(synk.data(x_np))
        _same("sum", got[0], x_np.sum(axis=0))
        _same("avg", got[1], x_np.mean(axis=0))
        _same("max", got[2], x_np.max(axis=0))
        _same("gather", got[3], 2 * x_np)

    def gather():
        _same("gather(s)", synk.gather(s), np.stack([p.sum(axis=0) for p in parts]))

    def broadcast():
        a = np.array([1.5, -2.0, 3.25])
        synk.broadcast(s, a)
        _same("broadcast then gather", synk.gather(s), np.tile(a, (n, 1)))

    def scatter():
        whole = np.arange(rows, dtype="float64")
        synk.scatter(v, whole)
        _same("get_lengths", np.asarray(synk.get_lengths(v)), [len(p) for p in parts])
        _same("gather(nd_up=0)", synk.gather(v, nd_up=0), whole)
        _same("call on scattered", g(), whole.sum())

    def all_gather():
        synk.all_gather(v)
        whole = np.arange(rows, dtype="float64")
        _same("all_gather", synk.gather(v, nd_up=0), np.tile(whole, n))

    def set_get():
        for r in range(n):
            synk.set_value(r, s, np.full(3, float(r + 1)))
        for r in range(n):
            _same(f"get_value(rank {r})", synk.get_value(r, s), np.full(3, float(r + 1)))

    def reduce():
        _same("reduce sum", synk.reduce(s, op="sum", in_place=False),
              np.full(3, n * (n + 1) / 2))

    def all_reduce():
        # Each op from values that differ by rank (r + 1), so none can pass by accident.
        for op, want in (("avg", (n + 1) / 2), ("max", float(n))):
            for r in range(n):
                synk.set_value(r, s, np.full(3, float(r + 1)))
            synk.all_reduce(s, op=op)
            _same(f"all_reduce {op}", synk.gather(s), np.full((n, 3), want))

    step("function call (sum, avg, max, gather, updates)", call)
    step("gather", gather)
    step("broadcast", broadcast)
    step("scatter", scatter)
    step("all_gather", all_gather)
    step("set_value / get_value", set_get)
    step("reduce", reduce)
    step("all_reduce", all_reduce)


def _same(what, got, want):
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape or not np.allclose(got, want, rtol=1e-6, atol=1e-9):
        raise AssertionError(f"{what}: expected {want.tolist()}, got {got.tolist()}")
