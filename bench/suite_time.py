"""How long ``make test`` takes on a fresh clone, target by target (its budget: 45 minutes on 2 cores).

Clones this repository (its committed state) into a temporary folder and runs the
targets ``make test`` runs, in its order, each timed, environments included; with
``--cold`` PyTensor's compile cache (``~/.pytensor``) is moved aside for the run (and
put back), as on a fresh CI machine.  Prints one line per target as it ends, then a
table with each target's minutes and pass or fail.

    python bench/suite_time.py --cold          # about 45 minutes on 2 cores
    python bench/suite_time.py --busy 2        # beside two spinning processes (issue 48)
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

from common import cpu_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGETS = ("slurm-packages", "test-current", "test-main", "test-lowest", "test-pymc",
           "test-openmpi")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cold", action="store_true", help="an empty PyTensor compile cache")
    p.add_argument("--targets", default=",".join(TARGETS))
    p.add_argument("--keep", action="store_true", help="keep the clone and its logs")
    p.add_argument("--busy", type=int, default=0,
                   help="processes spinning (while True: pass, not pinned) for the whole run")
    a = p.parse_args()
    cache = os.path.expanduser("~/.pytensor")
    aside = cache + f".suite-time-{os.getpid()}"
    if a.cold and os.path.exists(cache):
        os.rename(cache, aside)
    work = tempfile.mkdtemp(prefix="synk-suite-")
    clone = os.path.join(work, "clone")
    rows = []
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(a.busy)]
    try:
        subprocess.run(["git", "clone", "-q", ROOT, clone], check=True)
        print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {cpu_model()}, "
              f"{os.cpu_count()} CPUs, commit "
              + subprocess.run(["git", "-C", clone, "rev-parse", "--short", "HEAD"],
                               capture_output=True, text=True).stdout.strip()
              + (", cold compile cache" if a.cold else "")
              + (f", beside {a.busy} busy process(es)" if a.busy else ""), flush=True)
        t_all = time.perf_counter()
        for target in a.targets.split(","):
            log = os.path.join(work, f"{target}.log")
            t0 = time.perf_counter()
            with open(log, "w") as f:
                rc = subprocess.run(["make", "--no-print-directory", target], cwd=clone,
                                    stdout=f, stderr=subprocess.STDOUT).returncode
            secs = time.perf_counter() - t0
            rows.append((target, secs, rc))
            print(f"# {target}: {secs / 60:.1f} min, {'pass' if rc == 0 else f'FAIL ({rc})'} "
                  f"(load {os.getloadavg()[0]:.1f})", flush=True)
        total = time.perf_counter() - t_all
        print("\n| target | minutes | result |\n|---|---:|---|")
        for target, secs, rc in rows:
            print(f"| `make {target}` | {secs / 60:.1f} | {'pass' if rc == 0 else 'FAIL'} |")
        print(f"| all | {total / 60:.1f} | {'pass' if all(r[2] == 0 for r in rows) else 'FAIL'} |")
        if a.keep or any(r[2] for r in rows):
            a.keep = True
            print(f"\nlogs in {work}")
    finally:
        for b in busy:
            b.kill()
            b.wait()
        if a.cold and os.path.exists(aside):
            shutil.rmtree(cache, ignore_errors=True)
            os.rename(aside, cache)
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    sys.exit(0 if all(r[2] == 0 for r in rows) else 1)


if __name__ == "__main__":
    main()
