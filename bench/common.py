"""What the bench scripts share, in one module: each script imports it as ``common``.

A script run as ``python bench/x.py`` has bench/ on its path, so ``import common``
needs no path set-up; no script imports another.  Importing this module costs
the standard library only (NumPy, PyTensor and PyMC load inside the functions),
so scripts that never build a graph (faults.py, slurm_routes.py) stay light.

- the MLP of the training figures: ``LAYERS``, ``BATCH``, ``N_DATA``, ``LR``,
  ``build_mlp``; MPICH's own 4-byte ``Allreduce`` (``mpich_4b``); the speedup
  picture (``plot``);
- PyMC: the logistic regression on rows made by a formula (``logistic``), the
  children's set-up (``quiet``), PyMC's serial (logp, dlogp) (``serial_pair``), a
  sampler's position (``flat_point``), calls per time (``calls_for``) and the
  overhead table of bench/pymc_calls.py (``overhead_table``);
- simulated machines' links and the host's quiet: ``shape``, ``link_gbit``,
  ``burst_for``, ``wait_quiet``, ``Foreign``; the CPU's model (``cpu_model``);
- a demo's module loaded from its file (``demo``), and the tests' simulated-machine
  harness (``harness``), the one place bench/ reaches into tests/.
"""

import importlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# -- the MLP of the training figures (call_overhead, scaling, memory, multinode, cluster_train) --
LAYERS = (784, 1024, 1024, 10)
BATCH = 512
N_DATA = 8192
LR = 0.01


def build_mlp(rng):
    """The MLP (LAYERS, ReLU, softmax cross-entropy): (x, y, params, loss), weights drawn from ``rng``."""
    import numpy as np
    import pytensor
    import pytensor.tensor as pt

    params = []
    for i, (n_in, n_out) in enumerate(zip(LAYERS[:-1], LAYERS[1:])):
        w = rng.normal(0, np.sqrt(2.0 / n_in), (n_in, n_out)).astype("float32")
        params.append(pytensor.shared(w, name=f"W{i}"))
        params.append(pytensor.shared(np.zeros(n_out, "float32"), name=f"b{i}"))
    x = pt.matrix("x")
    y = pt.ivector("y")
    h = x
    for i in range(0, len(params) - 2, 2):
        h = pt.maximum(h @ params[i] + params[i + 1], 0)
    logits = h @ params[-2] + params[-1]
    loss = -pt.mean(pt.log(pt.special.softmax(logits, axis=-1))[pt.arange(y.shape[0]), y])
    return x, y, params, loss


def mpich_4b(calls, rounds):
    """MPICH's Allreduce of 4 bytes between 2 processes: per-round means in us, or None."""
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if not os.path.exists(mpiexec):
        mpiexec = shutil.which("mpiexec")
    if mpiexec is None:
        return None
    code = (
        "from mpi4py import MPI\nimport numpy as np, time, json\n"
        "c = MPI.COMM_WORLD\na = np.ones(1, 'float32'); b = np.empty_like(a)\n"
        "for _ in range(1000): c.Allreduce(a, b)\nr = []\n"
        f"for _ in range({rounds}):\n    c.Barrier(); t0 = time.perf_counter()\n"
        f"    for _ in range({calls}): c.Allreduce(a, b)\n"
        f"    r.append((time.perf_counter() - t0) / {calls} * 1e6)\n"
        "if c.rank == 0: print('JSON', json.dumps(r))\n")
    try:
        out = subprocess.run([mpiexec, "-n", "2", sys.executable, "-c", code],
                             capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in out.stdout.splitlines():
        if line.startswith("JSON "):
            return json.loads(line[5:])
    return None


def plot(ranks, speedups, path, title):
    """Draw each of ``speedups`` ({label: per rank count}) against ``ranks`` beside the ideal, as a PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.6, 4.2))
    for label, values in speedups.items():
        ax.plot(ranks, values, "o-", label=label)
    ax.plot(ranks, ranks, "k--", alpha=0.5, label="ideal (vs 1 thread)")
    ax.set_xlabel("ranks (one per core)")
    ax.set_ylabel("speedup in samples/s")
    ax.set_xticks(ranks)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"# wrote {path}")


# -- PyMC (pymc_calls, pymc_sampling, scaling, memory) ----------------------------------------
FEATURES = 5


def covariates(n):
    """Rows 0:n of the logistic regression's 5 covariates (a formula of the row number)."""
    import numpy as np
    i = np.arange(n, dtype=np.float64)[:, None]
    return np.sin(i * np.array([0.731, 1.917, 2.377, 0.0913, 3.141]) + 0.5)


def uniform(n, seed):
    """Uniform-looking numbers in [0, 1) for rows 0:n (a hash of the row number)."""
    import numpy as np
    i = np.arange(n, dtype=np.float64)
    return np.abs(np.sin(i * 12.9898 + seed) * 43758.5453) % 1.0


def logistic(n):
    """Logistic regression: 5 covariates and an intercept, rows in pm.Data."""
    import numpy as np
    x = covariates(n)
    y = (uniform(n, 0.0) < 1 / (1 + np.exp(-(0.3 + x @ np.array([0.8, -0.5, 0.3, 0.0, 0.2]))))
         ).astype("int64")
    return logistic_model(x, y)


def logistic_model(x, y):
    """The logistic regression on covariates ``x`` and outcomes ``y``, both in pm.Data."""
    import pymc as pm
    with pm.Model() as model:
        X_d, y_d = pm.Data("X", x), pm.Data("y", y)
        a = pm.Normal("a", 0, 2)
        b = pm.Normal("b", 0, 1, shape=x.shape[1])
        pm.Bernoulli("y_obs", logit_p=a + X_d @ b, observed=y_d)
    return model


def calls_for(f, seconds=0.05):
    """How many calls of ``f`` take about ``seconds``."""
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        f()
        n += 1
    return max(n, 3)


def quiet():
    """PyMC's children: no warnings, float64 graphs (as PyMC builds them)."""
    import warnings
    warnings.filterwarnings("ignore")
    import pytensor
    pytensor.config.floatX = "float64"


def pymc_mode(model, base):
    """PyMC's compile mode (failed parameter checks give -inf) on PyTensor's mode ``base``.

    Made here, not by the extension, so that an older tree runs these children too.
    """
    from pytensor.compile.mode import Mode, get_mode
    check = ("local_check_parameter_to_ninf_switch" if model.check_bounds
             else "local_remove_check_parameter")
    m = get_mode(base)
    return Mode(linker=m.linker, optimizer=m.provided_optimizer.including(check))


def serial_pair(model, mode=None, trust=False):
    """PyMC's (logp, dlogp) of the raveled position, as its NUTS calls it (untrusted input)."""
    kw = {} if mode is None else {"mode": pymc_mode(model, mode)}
    joint = model.logp_dlogp_function(ravel_inputs=True, **kw)
    joint.set_extra_values({})
    fn = joint._pytensor_function
    fn.trust_input = trust
    return fn


def flat_point(model):
    """A position as a sampler visits them: the initial point moved off its zeros.

    At the initial point every row of the logistic model has the same linear
    predictor (0), so its softplus takes one branch in every row and runs
    faster than at any point a sampler visits.
    """
    import numpy as np
    point = model.initial_point()
    q = np.concatenate([np.asarray(point[v.name], dtype=np.float64).ravel()
                        for v in model.value_vars])
    return q + 0.3 * np.sin(1.0 + np.arange(q.size))


def overhead_table(runs):
    """Print bench/pymc_calls.py's overhead part: ``runs`` is [(tag, its OVERHEAD record)]."""
    print("\n| call (2 ranks, 64 rows) | " + " | ".join(f"{tag} best / median us"
                                                      for tag, _ in runs) + " |")
    print("| --- |" + " --- |" * len(runs))
    print("| the ranks' mode | " + " | ".join(o.pop("mode", "-") for _, o in runs) + " |")
    for k in runs[0][1]:
        print(f"| {k} | " + " | ".join(
            f"{o[k]['best']:.1f} / {o[k]['median']:.1f}" if k in o else "-" for _, o in runs)
            + " |")
    for tag, o in runs:
        t, b = o["tiny synk.function"], o["bare PyTensor (same tiny graph)"]
        g = o["the rank's graph, serial on 32 rows"]
        fixed_tiny = t["best"] - b["best"]
        parts = []
        for k in ("dp.logp_dlogp", "PyMC's NUTS hook (batcher, 1 chain)",
                  "nutpie's callback (1 chain)"):
            fixed = o[k]["best"] - g["best"]
            parts.append(f"{k} {fixed:.1f} us ({fixed / fixed_tiny:.2f}x)")
        pos = o["tiny call + a broadcast vector input"]["best"] - o["bare PyTensor (same graph)"]["best"]
        vec = (o["tiny call + the vector input, vector output"]["best"]
               - o["bare PyTensor (same graph, vector out)"]["best"])
        print(f"{tag}: fixed cost (best, less the serial graph) of the tiny call {fixed_tiny:.1f} "
              f"us; with a broadcast input {pos:.1f} us; and a vector output {vec:.1f} us; "
              + ", ".join(parts), flush=True)


# -- simulated machines' links and the host's quiet (cluster_train, cluster_data) --------------
def _unlimit(m, i):
    """Take machine i's rate limit off (the inverse of Machines.limit)."""
    for ns, dev in ((m.switch, f"port{i}"), (m.netns[i], "eth0")):
        subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"],
                       capture_output=True)


def _bits_per_s(rate):
    m = re.fullmatch(r"([\d.]+)(gbit|mbit|kbit)", rate)
    if not m:
        sys.exit(f"--rates: {rate!r} is not none or a tc rate like 10gbit, 500mbit")
    return float(m.group(1)) * {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3}[m.group(2)]


def burst_for(rate, burst):
    """tc tbf's bucket: ``burst`` as given, or ("auto") 1 ms at the rate, at least 64 KiB.

    Machines.limit's default, 64 KiB, lets a 10gbit link carry only ~4 Gbit/s in this VM:
    the bucket refills every 52 us at that rate, faster than the qdisc's timer wakes.
    """
    if burst != "auto":
        return burst
    return str(max(65536, int(_bits_per_s(rate) / 8 / 1000)))


def shape(m, rate, burst):
    """Every machine's link at ``rate`` (a tc rate, or "none": unlimited), bucket ``burst_for``."""
    for i in range(m.n):
        if rate == "none":
            _unlimit(m, i)
        else:
            m.limit(i, rate, burst=burst_for(rate, burst))


_RECV = """
import socket, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 5001)); s.listen(1); print("ready", flush=True)
c, _ = s.accept(); n = 0; buf = bytearray(1 << 20); t0 = None
while True:
    k = c.recv_into(buf)
    t0 = t0 or time.perf_counter()
    if not k:
        break
    n += k
print(n * 8 / (time.perf_counter() - t0) / 1e9, flush=True)
"""
_SEND = """
import socket, sys
s = socket.create_connection((sys.argv[1], 5001)); b = bytes(1 << 20)
for _ in range(int(sys.argv[2])):
    s.sendall(b)
s.close()
"""


def link_gbit(m, rate):
    """One TCP stream from machine 1 to machine 0 (the controller's): Gbit/s it carried."""
    mb = 128 if rate == "none" else max(16, min(512, int(_bits_per_s(rate) / 8e6)))
    r = m.popen(0, [sys.executable, "-c", _RECV], stdout=subprocess.PIPE, text=True)
    try:
        r.stdout.readline()
        m.run(1, [sys.executable, "-c", _SEND, m.addresses[0], str(mb)], timeout=120,
              check=True)
        return float(r.stdout.readline())
    finally:
        r.wait(timeout=30)


def cpu_model():
    """The CPU's model name as ``lscpu`` gives it (figures differ between VM kinds)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines()
                    if line.startswith("Model name"))
    except (OSError, StopIteration):
        import platform
        return platform.processor() or "unknown CPU"


def _cpu():
    """(busy, total) jiffies of the host's cores since boot: busy is user, nice and system
    time (interrupts left out: a job's own network traffic is mostly softirq time)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    return v[0] + v[1] + v[2], sum(v)


def wait_quiet(max_s, busy_max=0.15):
    """Wait until the host's cores are idle (busy < ``busy_max`` over 2 s), at most ``max_s``.

    Another user's tests on this 2-core VM slow a job by 2-3x; this keeps jobs out of
    their way where it can.  Returns the last busy fraction seen.
    """
    t_end = time.monotonic() + max_s
    while True:
        b0, t0 = _cpu()
        time.sleep(2)
        b1, t1 = _cpu()
        busy = (b1 - b0) / max(t1 - t0, 1)
        if busy < busy_max or time.monotonic() > t_end:
            return busy


class Foreign:
    """Around a job: the share of the host's cores busy with something else than the job.

    Busy CPU time (/proc/stat) less the job's own (this process's waited-for children,
    RUSAGE_CHILDREN), over the job's wall time and the host's cores.
    """

    def __enter__(self):
        self.b0, self.c0, self.w0 = _cpu()[0], self._children(), time.monotonic()
        return self

    @staticmethod
    def _children():
        import resource
        ru = resource.getrusage(resource.RUSAGE_CHILDREN)
        return ru.ru_utime + ru.ru_stime

    def __exit__(self, *exc):
        busy = (_cpu()[0] - self.b0) / os.sysconf("SC_CLK_TCK")
        own = self._children() - self.c0
        wall = time.monotonic() - self.w0
        self.share = max(busy - own, 0.0) / (wall * os.cpu_count())


# -- code that lives elsewhere ----------------------------------------------------------------
def demo(path, name):
    """The demo module demos/``path`` (a script, not a package), loaded from its file as ``name``."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "demos", path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


HARNESS = os.path.join(ROOT, "tests", "helpers")


def harness(name):
    """The tests' module tests/helpers/``name``.py: simulated machines and the jobs run on them.

    The scripts that time faults, Slurm routes and jobs on simulated machines run the
    harness the cluster tests run (machines, cluster_jobs, elastic_jobs, slurm,
    slurm_jobs: network namespaces, launchers, teardown, and the job scripts they
    start by path), not a copy of it.  The package is loaded from its folder as
    ``helpers``, the name the tests give it, so its own relative imports hold.
    """
    if "helpers" not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            "helpers", os.path.join(HARNESS, "__init__.py"), submodule_search_locations=[HARNESS])
        package = importlib.util.module_from_spec(spec)
        sys.modules["helpers"] = package
        spec.loader.exec_module(package)
    return importlib.import_module(f"helpers.{name}")


def child_env(env=None):
    """The environment a bench's child runs in: ``env`` (this process's where None) without
    ``PYTHONDONTWRITEBYTECODE``, and synkhronos's bytecode written first.

    pip writes every installed package's bytecode at install time, so a user's process
    imports PyMC and PyTensor from it, and synkhronos too once installed or first
    imported.  A shell that sets the variable (this project's VM does) made each child
    compile synkhronos's 93 modules from source, 0.1-0.2 s of every start that pm.sample,
    importing no synkhronos, never paid (2026-12-06, bench/HISTORY.md).
    """
    import compileall

    compileall.compile_dir(os.path.join(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), "synkhronos"), quiet=1)
    env = dict(os.environ if env is None else env)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env
