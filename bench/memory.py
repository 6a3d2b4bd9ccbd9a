"""Memory per rank: USS and PSS of the master, every rank and the janitor, against serial baselines.

USS (unique set size) is the memory only that process holds: what it would give back if it
ended.  PSS (proportional set size) divides every shared page among the processes that map
it, so the PSS of a run's processes adds up to the memory the run takes, shared memory
counted once.  Both come from ``/proc/<pid>/smaps_rollup``, read in the process tree of one
child process per measurement (nothing shared with the runs before it).

Parts:

  mlp      the MLP of bench/call_overhead.py (784-1024-1024-10, 8192 rows, batch 512):
           ``fork(n)``, its gradient and update functions, ``distribute()``, the data in
           ``synk.data``, three training steps; against the same step in one serial process.
  pymc     the logistic regression of bench/pymc_calls.py (5 covariates, rows in pm.Data)
           at each ``--rows``: the model built, ``fork(n)``, ``data_parallel``,
           ``distribute()``, (logp, dlogp) at one position and at two; against PyMC's own
           compiled (logp, dlogp) (``model.logp_dlogp_function()``, what NUTS calls) in
           one serial process.
  sample   the same model at each ``--sample-rows``, 2 chains sampled (``--draws`` tuning
           and kept draws each): ``dp.sample`` on each ``--sample-ranks`` against
           ``pm.sample`` (its chain processes); the peak PSS of the whole process tree,
           sampled every 100 ms from this process and read once more when the call
           has returned, its result (the InferenceData) still held.  ``--sampler
           nutpie``: both with ``nuts_sampler="nutpie"`` (pm.sample then compiles
           nutpie's own model; its chains are Rust threads of the one process).

For the data-parallel runs each process is read three times: after ``fork()``, after
``distribute()`` and after the calls; the tables show the last (the others are in
``--json``).  Oversubscribing the cores is fine here: memory does not depend on speed.

    python bench/memory.py                                   # everything: about 6 minutes
    python bench/memory.py --parts mlp --ranks 2,4           # a part, some sizes
    python bench/memory.py --tree /tmp/before                # another checkout's synkhronos

The PyMC parts run under ``--pymc-python`` (default: this interpreter if it has PyMC, else
the repository's ``.venv-pymc``); the MLP part under this interpreter (PyTensor's default
linker differs between the two environments).
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import threading
import time

from common import BATCH, LR, N_DATA, build_mlp, logistic

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MIB = 1024.0


# -- reading a process tree ----------------------------------------------------------------------
def rollup(pid):
    """``/proc/pid/smaps_rollup`` in MiB by field, with ``USS`` added; None if the process is gone."""
    out = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3 and parts[-1] == "kB":
                    out[parts[0].rstrip(":")] = int(parts[1]) / MIB
    except OSError:
        return None
    out["USS"] = out.get("Private_Clean", 0.0) + out.get("Private_Dirty", 0.0)
    return out


def tree(pid):
    """``pid`` and all its descendants."""
    out = [pid]
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                for child in f.read().split():
                    out.extend(tree(int(child)))
    except OSError:
        pass
    return out


def snapshot(roles):
    """``roles``: pid -> role; every process of this tree read, named by role (or "other")."""
    procs = []
    for pid in tree(os.getpid()):
        r = rollup(pid)
        if r is None:
            continue
        procs.append({"pid": pid, "role": roles.get(pid, "other"), "uss": r["USS"],
                      "pss": r.get("Pss", 0.0), "rss": r.get("Rss", 0.0),
                      "pss_anon": r.get("Pss_Anon", 0.0), "pss_file": r.get("Pss_File", 0.0),
                      "pss_shmem": r.get("Pss_Shmem", 0.0)})
    return procs


def emit(**record):
    print("@@" + json.dumps(record), flush=True)


def synk_roles():
    """The run's processes by role: the master, each worker's rank, the janitor."""
    from synkhronos.runtime.state import get_runtime
    rt = get_runtime()
    roles = {os.getpid(): "master"}
    for rank, proc in rt.processes.procs.items():
        roles[proc.pid] = f"rank {rank}"
    if rt.processes.janitor is not None:
        roles[rt.processes.janitor.pid] = "janitor"
    return roles


def stage(name, roles=None):
    time.sleep(0.2)  # the workers finish their last command's bookkeeping
    emit(stage=name, procs=snapshot(roles if roles is not None else synk_roles()))


# -- children: one measurement each ----------------------------------------------------------------
def child_mlp(n):
    import numpy as np
    import pytensor
    rng = np.random.default_rng(0)
    data_x = rng.normal(size=(N_DATA, 784)).astype("float32")
    data_y = rng.integers(0, 10, N_DATA).astype("int32")
    if n == 0:
        x, y, params, loss = build_mlp(np.random.default_rng(1))
        grads = pytensor.grad(loss, params)
        f = pytensor.function([x, y], loss,
                              updates=[(p, p - LR * g) for p, g in zip(params, grads)])
        for _ in range(3):
            idx = rng.integers(0, N_DATA, BATCH)
            f(data_x[idx], data_y[idx])
        stage("called", {os.getpid(): "serial"})
        return
    import synkhronos as synk
    synk.fork(n, use_gpu=False)
    stage("forked")
    x, y, params, loss = build_mlp(np.random.default_rng(1))
    grads = pytensor.grad(loss, params)
    sizes = [int(np.prod(p.get_value().shape)) for p in params]
    flat = pytensor.shared(np.zeros(sum(sizes), "float32"), name="flat_grad")
    new, start = flat, 0
    for g, k in zip(grads, sizes):
        new = pytensor.tensor.set_subtensor(new[start:start + k], g.flatten())
        start += k
    f_grad = synk.function([x, y], loss, updates=[(flat, new)])
    upd, offset = [], 0
    for p, k in zip(params, sizes):
        upd.append((p, p - LR * flat[offset:offset + k].reshape(p.shape)))
        offset += k
    f_update = synk.function([], updates=upd)
    synk.distribute()
    stage("distributed")
    xd, yd = synk.data(data_x), synk.data(data_y)
    step = f_grad.then_all_reduce(flat, "avg", f_update)
    for _ in range(3):
        step(xd, yd, batch=rng.integers(0, N_DATA, BATCH))
    stage("called")
    synk.close()


def child_pymc(n, rows):
    import warnings
    warnings.filterwarnings("ignore")
    import numpy as np
    model = logistic(rows)
    if n == 0:
        f = model.logp_dlogp_function(ravel_inputs=True)
        f.set_extra_values({})
        point = model.initial_point()
        x = np.concatenate([np.ravel(point[v.name]) for v in model.value_vars])
        for _ in range(3):
            f(x)
        stage("called", {os.getpid(): "serial"})
        return
    import synkhronos as synk
    from synkhronos.extensions import pymc as synk_pymc
    synk.fork(n, use_gpu=False)
    stage("forked")
    dp = synk_pymc.data_parallel(model)
    synk.distribute()
    stage("distributed")
    x = dp.initial_x()
    for _ in range(3):
        dp.logp_dlogp(x)
        dp.logp_dlogp_many(np.stack([x, x]))
    stage("called")
    synk.close()


def child_sample(n, rows, draws, sampler="pymc"):
    import warnings
    warnings.filterwarnings("ignore")
    import pymc as pm
    model = logistic(rows)
    kw = dict(draws=draws, tune=draws, chains=2, random_seed=1, progressbar=False,
              compute_convergence_checks=False, nuts_sampler=sampler)
    if n == 0:
        emit(event="sampling")
        idata = pm.sample(model=model, cores=2, **kw)
        sampled(idata)
        return
    import synkhronos as synk
    from synkhronos.extensions import pymc as synk_pymc
    synk.fork(n, use_gpu=False)
    dp = synk_pymc.data_parallel(model, split=True)  # the data-parallel path
    synk.distribute()
    x = dp.initial_x()
    dp.logp_dlogp(x)  # compiled before the measured part, as pymc_sampling.py does
    emit(event="sampling")
    idata = dp.sample(**kw)
    sampled(idata)
    synk.close()


def sampled(idata):
    """Say the call returned, and hold its result until the parent has read the tree."""
    emit(event="sampled")
    sys.stdin.readline()
    return idata


# -- the parent: runs children, reads their records --------------------------------------------------
class Peak:
    """The peak total PSS of a process tree, sampled every ``every_s`` while ``on``."""

    def __init__(self, pid, every_s=0.1):
        self.pid, self.every_s = pid, every_s
        self.on = False
        self.peak = 0.0
        self.peak_procs = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self):
        while not self._stop.wait(self.every_s):
            if self.on:
                self.read()

    def read(self):
        """Read the tree now; return its total PSS."""
        procs = [(p, rollup(p)) for p in tree(self.pid)]
        procs = [(p, r) for p, r in procs if r is not None]
        total = sum(r.get("Pss", 0.0) for _, r in procs)
        if total > self.peak:
            self.peak = total
            self.peak_procs = [{"pid": p, "uss": r["USS"], "pss": r.get("Pss", 0.0)}
                               for p, r in procs]
        return total

    def stop(self):
        self._stop.set()
        self._thread.join()


def run_child(python, tree_dir, args, timeout):
    env = dict(os.environ)
    # This checkout's synkhronos (or --tree's), whatever the interpreter has installed.
    env["PYTHONPATH"] = (tree_dir or ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("PYTHONWARNINGS", "ignore")
    proc = subprocess.Popen([python, os.path.abspath(__file__), "--child"] + args, env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            cwd=tree_dir or ROOT)
    peak = Peak(proc.pid)
    records, other = [], []
    deadline = time.monotonic() + timeout
    err = []
    reader = threading.Thread(target=lambda: err.append(proc.stderr.read()), daemon=True)
    reader.start()
    for line in proc.stdout:
        if not line.startswith("@@"):
            other.append(line)
            continue
        rec = json.loads(line[2:])
        if rec.get("event") == "sampling":
            peak.on = True
            peak.read()
        elif rec.get("event") == "sampled":
            running = peak.peak         # read while the call ran
            at_return = peak.read()     # the result still held by the child
            peak.on = False
            proc.stdin.write("\n")
            proc.stdin.flush()
            records.append({"stage": "sampling", "peak_pss": peak.peak, "running_pss": running,
                            "at_return_pss": at_return, "procs": peak.peak_procs})
        else:
            records.append(rec)
        if time.monotonic() > deadline:
            proc.kill()
    proc.wait()
    peak.stop()
    reader.join(5)
    if proc.returncode != 0:
        raise RuntimeError(f"child {args} failed ({proc.returncode}):\n{''.join(other)}\n"
                           f"{''.join(err)[-4000:]}")
    return records


def summarise(procs):
    """Master, workers, janitor and total from one snapshot's processes."""
    workers = [p for p in procs if p["role"].startswith("rank ")]
    out = {"total_pss": sum(p["pss"] for p in procs), "n_procs": len(procs)}
    for role in ("master", "serial", "janitor"):
        got = [p for p in procs if p["role"] == role]
        if got:
            out[role] = {"uss": got[0]["uss"], "pss": got[0]["pss"]}
    if workers:
        out["workers"] = {"uss_mean": sum(p["uss"] for p in workers) / len(workers),
                          "uss_max": max(p["uss"] for p in workers),
                          "pss_mean": sum(p["pss"] for p in workers) / len(workers),
                          "n": len(workers)}
    return out


def pymc_python(given):
    if given:
        return given
    try:
        import pymc  # noqa: F401
        return sys.executable
    except ImportError:
        return os.path.join(ROOT, ".venv-pymc", "bin", "python")


def fmt(x):
    return f"{x:.0f}" if x >= 100 else f"{x:.1f}"


def run_table(title, rows):
    print(f"\n### {title}\n")
    print("| ranks | master USS / PSS | each worker USS (mean, max) / PSS | janitor USS / PSS "
          "| total PSS | vs serial |")
    print("| --- | --- | --- | --- | --- | --- |")
    serial = next((s for n, s in rows if n == 0), None)
    for n, s in rows:
        if n == 0:
            print(f"| serial | {fmt(s['serial']['uss'])} / {fmt(s['serial']['pss'])} | - | - | "
                  f"{fmt(s['total_pss'])} | 1.00x |")
            continue
        w, j, m = s.get("workers"), s.get("janitor"), s["master"]
        ws = (f"{fmt(w['uss_mean'])}, {fmt(w['uss_max'])} / {fmt(w['pss_mean'])}" if w else "-")
        js = f"{fmt(j['uss'])} / {fmt(j['pss'])}" if j else "-"
        ratio = f"{s['total_pss'] / serial['total_pss']:.2f}x" if serial else "-"
        print(f"| {n} | {fmt(m['uss'])} / {fmt(m['pss'])} | {ws} | {js} | "
              f"{fmt(s['total_pss'])} | {ratio} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="mlp,pymc,sample")
    parser.add_argument("--ranks", default="2,4,8,16")
    parser.add_argument("--rows", default="1e5,1e6", help="rows of the pymc part")
    parser.add_argument("--sample-rows", default="1e6")
    parser.add_argument("--sample-ranks", default="2,4")
    parser.add_argument("--draws", type=int, default=10, help="tuning and kept draws per chain")
    parser.add_argument("--sampler", default="pymc",
                        help="sample part: pm.sample's nuts_sampler, pymc or nutpie (both systems)")
    parser.add_argument("--tree", default=None, help="a checkout whose synkhronos to measure")
    parser.add_argument("--pymc-python", default=None)
    parser.add_argument("--json", default=None, help="write every record here")
    parser.add_argument("--child", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        what, n = args.child[0], int(args.child[1])
        if what == "mlp":
            child_mlp(n)
        elif what == "pymc":
            child_pymc(n, int(float(args.child[2])))
        else:
            child_sample(n, int(float(args.child[2])), int(args.child[3]), args.child[4])
        return

    parts = args.parts.split(",")
    ranks = [int(r) for r in args.ranks.split(",")]
    tree_dir = os.path.abspath(args.tree) if args.tree else None
    print(f"# bench/memory.py, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
          f"load {os.getloadavg()[0]:.2f}, {os.cpu_count()} cores, Python "
          f"{platform.python_version()}, tree {tree_dir or ROOT}")
    everything = {}
    if "mlp" in parts:
        rows = []
        for n in [0] + ranks:
            recs = run_child(sys.executable, tree_dir, ["mlp", str(n)], 900)
            everything[f"mlp {n}"] = recs
            rows.append((n, summarise(recs[-1]["procs"])))
        run_table("MLP 784-1024-1024-10 (MiB)", rows)
    py = pymc_python(args.pymc_python)
    if "pymc" in parts:
        for r in args.rows.split(","):
            rows = []
            for n in [0] + ranks:
                recs = run_child(py, tree_dir, ["pymc", str(n), r], 900)
                everything[f"pymc {r} {n}"] = recs
                rows.append((n, summarise(recs[-1]["procs"])))
            run_table(f"PyMC logistic regression, {float(r):.0e} rows (MiB)", rows)
    if "sample" in parts:
        for r in args.sample_rows.split(","):
            print(f"\n### Sampling ({args.sampler}), {float(r):.0e} rows, 2 chains, "
                  f"{args.draws}+{args.draws} draws: peak PSS of the process tree (MiB)\n")
            print("| system | peak total PSS | while it ran | at return (result held) | "
                  "processes at the peak (PSS each) | vs pm.sample |")
            print("| --- | --- | --- | --- | --- | --- |")
            base = None
            for n in [0] + [int(k) for k in args.sample_ranks.split(",")]:
                recs = run_child(py, tree_dir, ["sample", str(n), r, str(args.draws),
                                                args.sampler], 1800)
                everything[f"sample {r} {n}"] = recs
                got = recs[-1]
                base = got["peak_pss"] if n == 0 else base
                name = (f"pm.sample, cores=2 ({args.sampler})" if n == 0
                        else f"dp.sample, {n} ranks")
                each = ", ".join(fmt(p["pss"]) for p in got["procs"])
                print(f"| {name} | {fmt(got['peak_pss'])} | {fmt(got['running_pss'])} | "
                      f"{fmt(got['at_return_pss'])} | {each} | {got['peak_pss'] / base:.2f}x |")
    print(f"\nload at the end {os.getloadavg()[0]:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(everything, f, indent=1)


if __name__ == "__main__":
    main()
