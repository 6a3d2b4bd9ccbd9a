"""plan: what fork() decides from its arguments and the machine, checked without processes."""

import math

import pytest

from synkhronos import SynkStateError
from synkhronos.cluster.launchers import Launch
from synkhronos.fork_plan import Machine, control_bytes, plan, process_limit, setting_problems, share

FOUR = Machine(cores=(0, 1, 2, 3))


def test_cpu_mode_takes_one_rank_per_core_and_spins_while_each_has_its_own():
    p = plan(FOUR)
    assert (p.n_parallel, p.device, p.n_gpus, p.master_rank) == (4, "cpu", 0, 0)
    assert p.cores == (0, 1, 2, 3) and p.spin_s > 0 and p.launch is None
    oversubscribed = plan(FOUR, n_parallel=5)
    assert oversubscribed.spin_s == 0.0   # ranks outnumber cores: never spin


def test_gpu_mode_takes_one_rank_per_gpu_unless_told_otherwise():
    gpus = Machine(cores=(0, 1, 2, 3), n_gpus=2)
    assert (plan(gpus).n_parallel, plan(gpus).device) == (2, "gpu")
    cpu = plan(gpus, use_gpu=False)
    assert (cpu.device, cpu.n_gpus, cpu.n_parallel) == ("cpu", 0, 4)
    with pytest.raises(RuntimeError, match="use_gpu=True"):
        plan(FOUR, use_gpu=True)
    with pytest.raises(SynkStateError, match="jax.devices"):
        plan(gpus._replace(cuda_user="jax.devices()"))
    # CUDA in use does not matter in CPU mode.
    assert plan(gpus._replace(cuda_user="torch"), use_gpu=False).device == "cpu"


@pytest.mark.parametrize("kwargs,error,match", [
    ({"use_gpu": "yes"}, TypeError, "use_gpu"),
    ({"n_parallel": 0}, ValueError, "n_parallel"),
    ({"n_parallel": 2.0}, TypeError, "n_parallel"),
    ({"n_parallel": True}, TypeError, "n_parallel"),
    ({"master_rank": 4}, ValueError, "master_rank"),
    ({"master_rank": -1}, ValueError, "master_rank"),
    ({"max_n_var": 0}, ValueError, "max_n_var"),
    ({"max_dim": "8"}, TypeError, "max_dim"),
    ({"timeout": 0}, ValueError, "timeout"),
    ({"timeout": math.nan}, ValueError, "timeout"),
    ({"timeout": True}, ValueError, "timeout"),
])
def test_bad_arguments_name_themselves(kwargs, error, match):
    with pytest.raises(error, match=match):
        plan(FOUR, **kwargs)


@pytest.mark.parametrize("name,value", [
    ("SYNK_SPIN_S", "abc"), ("SYNK_SPIN_S", "-1"), ("SYNK_SPIN_S", "nan"),
    ("SYNK_TIMEOUT_S", "abc"), ("SYNK_TIMEOUT_S", "0"), ("SYNK_TIMEOUT_S", "-5"),
    ("SYNK_BACKEND", "nonesuch"), ("SYNK_CLUSTER", "no"),
])
def test_bad_settings_name_the_variable(name, value):
    with pytest.raises(ValueError, match=f"{name} must be .*; got '{value}'"):
        plan(FOUR._replace(env={name: value}))


def test_cluster_settings_are_checked_where_a_cluster_reads_them():
    env = {"SYNK_HEARTBEAT_S": "soon", "SYNK_SPIN_S": "0", "SYNK_UNKNOWN": "x"}
    assert setting_problems(env) == {
        "SYNK_HEARTBEAT_S": "SYNK_HEARTBEAT_S must be a number of seconds > 0; got 'soon'"}
    assert setting_problems(env, cluster=False) == {}
    assert plan(FOUR._replace(env=env)).spin_s == 0.0          # one machine: not read
    launch = Launch(rank=0, size=2, local_index=0, local_count=1)
    with pytest.raises(ValueError, match="SYNK_HEARTBEAT_S"):
        plan(FOUR._replace(env=env, launch=launch))
    assert setting_problems({"SYNK_BACKEND": "", "SYNK_TIMEOUT_S": "inf"}) == {}


def test_more_ranks_than_the_machine_can_start_name_n_parallel_and_the_limit():
    few = FOUR._replace(max_procs=(100, "kernel.pid_max"))
    assert plan(few, n_parallel=100).n_parallel == 100
    with pytest.raises(ValueError, match=r"n_parallel=101 .* at most 100 more processes "
                                         r"\(kernel.pid_max\)"):
        plan(few, n_parallel=101)
    small = FOUR._replace(shm_free=control_bytes(8))
    assert plan(small, n_parallel=8).n_parallel == 8
    with pytest.raises(ValueError, match=r"n_parallel=9 .* /dev/shm"):
        plan(small, n_parallel=9)


def test_the_process_limit_is_read_from_this_machine():
    n, what = process_limit()
    assert n > 1 and what


def test_settings_are_read_from_the_environment_given():
    p = plan(FOUR._replace(env={"SYNK_SPIN_S": "0.25", "SYNK_TIMEOUT_S": "inf"}))
    assert p.spin_s == 0.25 and p.timeout_s == math.inf
    assert plan(FOUR, timeout=3).timeout_s == 3.0      # the argument wins over the default


def test_a_cluster_process_takes_its_share_of_the_host():
    launch = Launch(rank=1, size=3, local_index=1, local_count=2)
    p = plan(Machine(cores=(0, 1, 2, 3), n_gpus=4, launch=launch), use_gpu=False)
    assert p.cores == (2, 3) and p.n_parallel == 2 and p.launch == launch
    g = plan(Machine(cores=(0, 1, 2, 3), n_gpus=4, launch=launch))
    assert g.n_gpus == 2 and g.n_parallel == 2
    # Two processes of two ranks each on four cores: every rank has a core, so spin.
    assert p.spin_s > 0
    assert plan(Machine(cores=(0, 1, 2, 3), launch=launch), n_parallel=3).spin_s == 0.0
    with pytest.raises(ValueError, match="master_rank"):
        plan(Machine(cores=(0, 1), launch=launch), master_rank=1)
    with pytest.raises(SynkStateError, match="forks once"):
        plan(Machine(cores=(0, 1), launch=launch, cluster_finished=True))


def test_share_splits_a_host_among_its_mpi_processes():
    cores = list(range(8))
    shares = [share(cores, i, 3) for i in range(3)]
    assert sorted(c for s in shares for c in s) == cores  # each core once
    assert all(s for s in shares)
    assert share(cores, 0, 1) == cores
    assert share([0, 1], 3, 4) == [1]       # more processes than cores
