"""Creating a 512 MB Data on simulated machines: replicated from the controller vs produced where used.

    sudo .venv/bin/python bench/cluster_data.py [--machines 2,3] [--rates none,10gbit,1gbit]
                                                [--mb 512] [--rounds 2] [--plot PNG]

On M simulated machines x 1 rank (tests/helpers/machines.py: own network
namespace, host name, /dev/shm and cores; needs root; ``mpiexec -n M``, MPICH,
TCP over the machines' veth links and bridge), links unlimited ("none") or
shaped with ``tc tbf`` (burst 1 ms at the rate, at least 64 KiB), one job per
way of making a float32 Data of ``--mb`` MB (1024 columns), alternated over
``--rounds`` rounds:

- replicated: the controller builds the whole array from a formula, then
  ``synk.data(value=arr)`` (every machine gets every row from the controller);
- produced: ``synk.data(produce=fn, length=N, dtype="float32", ndim=2)``, where
  ``fn(part)`` builds rows ``part.lo:part.hi`` from the same formula on each
  machine.

Each job checks that a call summing the Data over all rows gives the
formula's sum, then prints one JSON line.  Printed per (machines, link, way):
seconds to build (the controller's NumPy array; replicated only), to create
(the ``synk.data`` call) and both; bytes the controller's machine sent and
received on its link meanwhile (``/proc/<pid>/net/dev`` of its network
namespace); each machine's /dev/shm growth (its private tmpfs: the Data's
segment); the growth of the peak RSS of each machine's leader process
(controller / node master, VmHWM: shared-memory pages it touched included,
and what ``fn`` returned before it was copied in); medians over the rounds.
Targets (issue 24): produced, the controller's link carries no row (control
traffic only) and each machine holds about 1/M of the whole.  ``--plot PNG``
draws bytes over the controller's link and per-machine memory, replicated vs
produced (unlimited link): docs/img/cluster_data.png.  Before each job the
parent waits (``--quiet-wait``) for the host's cores to be idle and prints
the share of them something else used during the job.  With 3 machines on
2 cores, machines 1 and 2 share a core.
"""

import argparse
import json
import os
import signal
import statistics
import sys
import time

from common import Foreign, harness, link_gbit, shape, wait_quiet

COLS = 1024
WAYS = ("replicated", "produced")


def rows_of(lo, hi, cols=COLS):
    """Rows lo:hi of the whole, from a formula: (7 row + column) mod 64, as float32.

    Built in float32 in place (small integers, exact), so making n rows takes
    about n rows of memory.
    """
    import numpy as np
    r = ((np.arange(lo, hi, dtype=np.int64) * 7) % 64).astype(np.float32)
    out = np.add.outer(r, np.arange(cols, dtype=np.float32))
    np.remainder(out, 64, out=out)
    return out


def expected_sum(n_rows, cols=COLS):
    """Sum of every value of rows 0:n_rows, in exact integers (by chunks)."""
    total, step = 0, 4096
    for lo in range(0, n_rows, step):
        total += int(rows_of(lo, min(lo + step, n_rows), cols).astype("int64").sum())
    return total


def produce(part):
    """What every machine runs for its rows of the Data (synk.data(produce=...))."""
    return rows_of(part.lo, part.hi)


# ---- measuring inside the job --------------------------------------------------------------
def _net(pid):
    """(tx, rx) bytes of eth0 in the network namespace of process ``pid``."""
    with open(f"/proc/{pid}/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == "eth0":
                v = rest.split()
                return int(v[8]), int(v[0])
    return 0, 0


def _shm_bytes(pid):
    """Bytes in use in the /dev/shm (tmpfs) of the machine of holder ``pid``."""
    st = os.statvfs(f"/proc/{pid}/root/dev/shm")
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def _status_kb(pid, key):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _leader(holder):
    """The pid of the Python process that leads the machine of ``holder`` (its MPI process)."""
    net = os.readlink(f"/proc/{holder}/ns/net")
    best = None
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            if os.readlink(f"/proc/{d}/ns/net") != net:
                continue
            with open(f"/proc/{d}/environ", "rb") as f:
                env = f.read()
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        # The MPI process: started by Hydra (PMI_RANK set), running this script.
        if b"cluster_data.py" in cmd and b"\0PMI_RANK=" in b"\0" + env:
            if best is None or int(d) < best:
                best = int(d)
    return best


def _emit(obj):
    print("JSON " + json.dumps(obj), flush=True)


def job(way, mb):
    import pytensor.tensor as pt

    import synkhronos as synk

    holders = [int(p) for p in os.environ["BENCH_HOLDERS"].split(",")]
    n_rows = mb * (1 << 20) // (4 * COLS)
    synk.fork(1, use_gpu=False)
    try:
        x = pt.matrix("x")
        f = synk.function([x], (pt.sum(x, dtype="float64"), "sum"))
        synk.distribute()
        layout = synk.layout()
        m = layout.n_machines
        holders = holders[:m]
        leaders = [os.getpid()] + [_leader(h) for h in holders[1:]]
        shm0 = [_shm_bytes(h) for h in holders]
        net0 = [_net(h) for h in holders]
        hwm0 = [_status_kb(p, "VmHWM") for p in leaders]
        t0 = time.perf_counter()
        if way == "replicated":
            arr = rows_of(0, n_rows)
            t1 = time.perf_counter()
            d = synk.data(value=arr, name="big")
        else:
            t1 = time.perf_counter()
            d = synk.data(produce=produce, length=n_rows, dtype="float32", ndim=2, name="big")
        t2 = time.perf_counter()
        net1 = [_net(h) for h in holders]
        shm1 = [_shm_bytes(h) for h in holders]
        hwm1 = [_status_kb(p, "VmHWM") for p in leaders]
        got = int(f(d))
        res = {"way": way, "machines": m, "rows": n_rows, "bytes": n_rows * COLS * 4,
               "build_s": t1 - t0, "create_s": t2 - t1,
               "tx": [b[0] - a[0] for a, b in zip(net0, net1)],
               "rx": [b[1] - a[1] for a, b in zip(net0, net1)],
               "shm": [b - a for a, b in zip(shm0, shm1)],
               "hwm": [(b - a) * 1024 for a, b in zip(hwm0, hwm1)],
               "parts": getattr(d, "parts", None) if way == "produced" else None,
               "sum_ok": got == expected_sum(n_rows)}
        if way == "replicated":
            del arr
        _emit(res)
    finally:
        synk.close()


# ---- the parent (on the host) -------------------------------------------------------------
def run(n_machines, rate, ways, mb, rounds, burst, quiet_wait):
    cluster_jobs = harness("cluster_jobs")
    got = {w: [] for w in ways}
    with cluster_jobs.machines(n_machines) as m:
        shape(m, rate, burst)
        gbit = link_gbit(m, rate)
        print(f"# {n_machines} machines, link {rate}: one TCP stream carries {gbit:.2f} Gbit/s",
              flush=True)
        holders = ",".join(str(h.pid) for h in m.holders)
        for r in range(rounds):
            for way in (ways if r % 2 == 0 else ways[::-1]):
                wait_quiet(quiet_wait)
                with Foreign() as fg:
                    rc, out, wall = cluster_jobs.mpirun(m, n_machines, [os.path.abspath(__file__),
                                                                "--job", way, "--mb", str(mb)],
                                                timeout=900, BENCH_HOLDERS=holders)
                lines = [ln for ln in out.splitlines() if ln.startswith("JSON ")]
                if rc != 0 or not lines:
                    sys.exit(f"{way} job on {n_machines} machines failed (exit {rc}):\n"
                             + out[-4000:])
                res = json.loads(lines[-1][5:])
                if not res["sum_ok"]:
                    sys.exit(f"{way} on {n_machines} machines: wrong sum\n{out[-2000:]}")
                print(f"# round {r}: {way}: create {res['create_s']:.2f} s, controller tx "
                      f"{_bytes(res['tx'][0])}, shm {[round(s / 2**20) for s in res['shm']]}"
                      f" MiB, job {wall:.0f} s, foreign CPU during {fg.share:.0%}", flush=True)
                got[way].append(res)
            left = m.leftovers() if hasattr(m, "leftovers") else {}
            if left:
                print(f"# left on the machines after round {r}: {left}", flush=True)
    return gbit, got


def _bytes(b):
    return f"{b / 1e6:.1f} MB" if b >= 1e6 else f"{b / 1e3:.1f} kB"


def _mib(b):
    return f"{b / 2**20:.0f}"


def _med(rs, key, i=None):
    return statistics.median(r[key] if i is None else r[key][i] for r in rs)


def _size(b):
    return f"{b / 2**20:.0f} MiB" if b >= 2**20 else f"{b / 1024:.0f} KiB"


def plot(path, results):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rate = "none" if any(r == "none" for _, r in results) else sorted(r for _, r in results)[0]
    ms = sorted(m for m, r in results if r == rate)
    n = ms[-1]
    colors = {"replicated": "tab:red", "produced": "tab:green"}
    ways = [w for w in WAYS if results[(n, rate)][1].get(w)]
    width = 0.8 / len(ways)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4.2))
    whole = results[(n, rate)][1][ways[0]][0]["bytes"]
    for k, w in enumerate(ways):
        vals = [_med(results[(m, rate)][1][w], "tx", 0) + _med(results[(m, rate)][1][w], "rx", 0)
                for m in ms]
        xs = [i + (k - (len(ways) - 1) / 2) * width for i in range(len(ms))]
        b = a1.bar(xs, [v / 2**20 for v in vals], width, label=w, color=colors[w])
        a1.bar_label(b, [_size(v) for v in vals], fontsize=8)
    a1.axhline(whole / 2**20, color="k", ls="--", lw=0.8, alpha=0.6,
               label=f"the whole Data ({_size(whole)})")
    a1.set_xticks(range(len(ms)))
    a1.set_xticklabels([f"{m} machines" for m in ms])
    a1.set_ylabel("MiB sent + received on the controller's link")
    a1.set_title("bytes over the controller's link")
    a1.set_ylim(0, a1.get_ylim()[1] * 1.15)
    a1.legend(fontsize=8)
    for k, w in enumerate(ways):
        vals = [_med(results[(n, rate)][1][w], "shm", i) for i in range(n)]
        xs = [i + (k - (len(ways) - 1) / 2) * width for i in range(n)]
        b = a2.bar(xs, [v / 2**20 for v in vals], width, label=w, color=colors[w])
        a2.bar_label(b, [_size(v) for v in vals], fontsize=8)
    a2.axhline(whole / n / 2**20, color="k", ls=":", lw=0.8, alpha=0.6,
               label=f"1/{n} of the whole")
    a2.set_xticks(range(n))
    a2.set_xticklabels([f"machine {i}" + (" (controller)" if i == 0 else "") for i in range(n)],
                       fontsize=8)
    a2.set_ylabel("MiB of shared memory for the Data")
    a2.set_title(f"memory on each machine ({n} machines)")
    a2.legend(fontsize=8, loc="upper right")
    a2.set_ylim(0, whole / 2**20 * 1.5)
    fig.suptitle(f"creating a {_size(whole)} float32 Data on simulated machines x 1 rank: "
                 f"replicated from the controller vs produced where it is used "
                 f"(link {rate}, MPICH over TCP)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"# wrote {path}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--machines", default="2,3")
    ap.add_argument("--rates", default="none,10gbit,1gbit")
    ap.add_argument("--burst", default="auto",
                    help="tc tbf bucket: 'auto' (1 ms at the rate, >= 64 KiB) or a tc size")
    ap.add_argument("--mb", type=int, default=512, help="size of the Data in MiB")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--ways", default=",".join(WAYS))
    ap.add_argument("--plot", default=None, help="write the picture to this PNG")
    ap.add_argument("--quiet-wait", type=float, default=120,
                    help="seconds to wait before a job for the host to be idle")
    ap.add_argument("--job", choices=WAYS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.job:
        return job(args.job, args.mb)
    cluster_jobs = harness("cluster_jobs")
    FLAVOR, NO_MACHINES = cluster_jobs.FLAVOR, cluster_jobs.NO_MACHINES
    # Killed (SIGTERM): unwind, so the machines' teardown leaves no namespace or process.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if NO_MACHINES or not FLAVOR:
        sys.exit(f"bench/cluster_data.py: {NO_MACHINES or 'no mpiexec'}")
    ways = args.ways.split(",")
    print(f"# {FLAVOR} (TCP over veth + bridge), {os.cpu_count()} cores, "
          f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC, {args.rounds} rounds, "
          f"{args.mb} MiB float32 ({COLS} columns), load {os.getloadavg()[0]:.2f}", flush=True)
    results = {}
    for n in [int(x) for x in args.machines.split(",")]:
        for rate in args.rates.split(","):
            results[(n, rate)] = run(n, rate, ways, args.mb, args.rounds, args.burst,
                                     args.quiet_wait)
    print(f"# load at the end {os.getloadavg()[0]:.2f}")
    print("| machines | link (measured) | way | build | create | total | controller's link: sent / "
          "received | /dev/shm growth per machine (MiB) | of the whole | leader's peak RSS growth "
          "per machine (MiB) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for (n, rate), (gbit, got) in results.items():
        for w in ways:
            rs = got[w]
            whole = rs[0]["bytes"]
            shm = [_med(rs, "shm", i) for i in range(n)]
            build = f"{_med(rs, 'build_s'):.2f} s" if w == "replicated" else "-"
            total = statistics.median(r["build_s"] + r["create_s"] for r in rs)
            print(f"| {n} | {rate} ({gbit:.1f} Gbit/s) | {w} | {build} | "
                  f"{_med(rs, 'create_s'):.2f} s | {total:.2f} s | {_bytes(_med(rs, 'tx', 0))} / "
                  f"{_bytes(_med(rs, 'rx', 0))} | {' / '.join(_mib(s) for s in shm)} | "
                  f"{' / '.join(f'{s / whole:.2f}' for s in shm)} | "
                  f"{' / '.join(_mib(_med(rs, 'hwm', i)) for i in range(n))} |")
    if args.plot:
        plot(args.plot, results)


if __name__ == "__main__":
    main()
