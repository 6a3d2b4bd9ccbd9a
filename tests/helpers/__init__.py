"""What the tests share but pytest must not collect: imported modules and scripts run by path.

Imported as ``helpers.<module>`` (tests/ is on ``sys.path`` through conftest.py):
child (test bodies in a forked child), fork_each (a pytest plugin), fake_cupy
(CuPy and NCCL on the CPU), gpu_env (GPU skip marks), procs (process and
segment checks).  Run as scripts by path: ckpt_train.py (test_checkpoint.py),
cluster_checks.py and cluster_faults.py (test_cluster.py, under mpiexec).
"""
