"""The simulated machines of the cluster tests (helpers/machines.py): cores, names, teardown."""

import os
import subprocess

import pytest

from helpers.machines import Machines, core_sets, why_no_machines

WHY = why_no_machines()
needs_machines = pytest.mark.skipif(WHY is not None, reason=WHY or "")


def test_core_sets_give_each_machine_its_own_cores_where_there_are_enough():
    assert core_sets(2, [0, 1]) == [[0], [1]]
    assert core_sets(2, [0, 1, 2, 3]) == [[0, 1], [2, 3]]
    # Fewer cores than machines: the controller's machine keeps a core of its own.
    assert core_sets(3, [0, 1]) == [[0], [1], [1]]
    assert core_sets(5, [0, 1, 2]) == [[0], [1], [2], [1], [2]]
    assert core_sets(2, [7]) == [[7], [7]]


def _netns():
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


@needs_machines
@pytest.mark.timeout(60)
def test_machines_are_separate_and_leave_nothing():
    with Machines(2) as m:
        tag = m.tag
        assert tag in _netns()
        for i in range(2):
            p = m.run(i, ["sh", "-c", "hostname; getent hosts $(hostname); ls /sys/class/net; "
                          "touch /dev/shm/synk_probe; sleep 30 >/dev/null 2>&1 & echo started"],
                      capture_output=True, text=True, timeout=20)
            host, resolved, *_ = p.stdout.split("\n")
            assert host == m.names[i], p
            assert resolved.split()[0] == m.addresses[i], p
            assert set(p.stdout.split()) >= {"eth0", "lo"} and "started" in p.stdout, p
            assert m.segments(i) == ["synk_probe"]       # its own /dev/shm
            assert [c for _, c in m.processes(i)] == ["sleep 30"]
        assert "synk_probe" not in os.listdir("/dev/shm")
        # The launcher (as mpiexec calls ssh) reaches machine 1 from machine 0, over the switch.
        p = m.run(0, [m.launcher, m.names[1], "hostname"], capture_output=True, text=True,
                  timeout=20)
        assert p.stdout.strip() == m.names[1], p
        m.crash(1)
        assert m.processes(1) == [] and m.processes(0) != []
        m.limit(0, "100mbit")
        m.cut(0)
    assert tag not in _netns()
