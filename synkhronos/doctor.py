"""The environment report behind ``python -m synkhronos`` (the self-check: ``selfcheck``).

Nothing here prints: ``report_sections()`` yields the report a section at a
time, and ``synkhronos/__main__.py`` (the program) writes each out as it comes.
"""

import importlib.metadata
import importlib.util
import os
import platform
import sys

from .fork_plan import SETTINGS, environment, setting_problems
from .functions.measures import version as dist_version

# Packages whose versions the report lists when they are installed.
PACKAGES = ("pytensor", "numpy", "scipy", "numba", "jax", "jaxlib", "cupy", "mpi4py", "pymc",
            "pyzmq", "posix_ipc", "threadpoolctl", "nvidia-ml-py")


def report_sections():
    """Yield the environment report a section at a time: ``(section, [(key, value), ...])``.

    Some sections take seconds on a cold cache (PyTensor's and Numba's), so a
    program prints each as it comes.
    """
    for title, make in (("versions", _versions), ("pytensor", _pytensor), ("cpu", _cpu),
                        ("gpu", _gpus), ("shared memory", shm_report), ("backends", _backends),
                        ("settings", settings_report)):
        yield title, make()


def report():
    """Return the environment report as a list of ``(section, [(key, value), ...])``."""
    return list(report_sections())


def format_report(sections, width=None):
    """Return ``sections`` (as ``report()`` gives them) as aligned text (keys ``width`` wide)."""
    if width is None:
        width = max((len(k) for _, items in sections for k, _ in items), default=0)
    lines = []
    for title, items in sections:
        lines.append(f"{title}:")
        lines += [f"  {k.ljust(width)}  {v}" for k, v in items]
    return "\n".join(lines)


def _versions():
    import synkhronos

    items = [("synkhronos", synkhronos.__version__),
             ("python", f"{platform.python_version()} ({sys.executable})"),
             ("platform", platform.platform())]
    for name in PACKAGES:
        version = dist_version(name)
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
        # Only worth installing where there are NVIDIA GPUs to see.
        items.append(("NVML", "not installed (the gpu extra has it: nvidia-ml-py)" if n
                      else "not installed; not needed without NVIDIA GPUs"))
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

    from .runtime import devices

    # What each backend needs beyond its own module, which always imports.
    needs = {"nccl": ("cupy", "GPU mode only; needs CuPy with NCCL and a GPU (the gpu extra)"),
             "mpi": ("mpi4py", "clusters only; needs mpi4py and an MPI (the mpi extra)")}
    items = []
    for name in comm.backend_names():
        try:
            comm.get_backend(name)
        except (BackendUnavailableError, ImportError) as exc:
            items.append((name, f"unavailable: {exc}"))
            continue
        mod, need = needs.get(name, (None, None))
        if mod is not None and importlib.util.find_spec(mod) is None:
            items.append((name, f"unavailable: {need}"))
        elif name == "nccl" and not devices.count_gpus():
            items.append((name, "unavailable: no GPU here (CuPy is installed)"))
        else:
            items.append((name, "available"))
    items.append(("JAX mode", "available" if importlib.util.find_spec("jax") is not None
                  else "unavailable: needs jax (the jax extra)"))
    return items


def settings_report(env=None):
    """Return the report items on the ``SYNK_*`` settings set, INVALID ones flagged."""
    env = environment() if env is None else env
    bad = setting_problems(env)
    return [(k, f"INVALID: {bad[k]}" if k in bad else v if k in SETTINGS else
             f"{v!r} (not a synkhronos setting: a typo?)")
            for k, v in sorted(env.items())] or [("SYNK_*", "none set (defaults)")]
