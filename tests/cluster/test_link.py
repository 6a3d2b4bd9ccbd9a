"""The link between machines (cluster/link.py): every carrier against the same expectations.

``LinkSuite`` runs helpers/link_suite.py's expectations (send and receive,
order, tags, probes, bounded waits, sizes refused, kept buffers, sends
completed and retired, a lost machine named) on two machines of one carrier
at once: ``MpiLink`` under ``mpiexec -n 2``, ``ZmqLink`` in two processes
(link_job.py).  Each carrier's job runs once; each expectation is a test of
its own.  Beside it: the node master's side as declared (``node.NodeSide``).
"""

import ast
import inspect
import json
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

from helpers.link_suite import EXPECTATIONS
from synkhronos.cluster import link
from synkhronos.cluster.elastic.zmq_link import ZmqLink
from synkhronos.cluster.link import LinkBase
from synkhronos.cluster.mpi_link import MpiLink
from synkhronos.cluster.node import NodeMaster, NodeSide

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(HERE, "link_job.py")
JOB_TIMEOUT_S = 120
_RUNS = {}  # carrier -> its job's outcomes


def _outcomes(folder, output):
    """{expectation: {machine: "OK" or the failure}} from the job's files (``output``: its log)."""
    got = {}
    for machine in (0, 1):
        path = os.path.join(folder, f"machine{machine}")
        assert os.path.exists(path), f"machine {machine} wrote nothing:\n{output}"
        with open(path) as f:
            lines = f.read().splitlines()
        assert lines and lines[-1] == "END", f"machine {machine} did not finish:\n{lines}\n{output}"
        for line in lines[:-1]:
            verdict, name, *why = line.split(" ", 2)
            got.setdefault(name, {})[machine] = "OK" if verdict == "OK" else why[0]
    return got


class LinkSuite:
    carrier = None  # the LinkBase subclass under test

    @staticmethod
    def run_job(folder):
        """Run link_job.py for this carrier, writing into ``folder``; return its output."""
        raise NotImplementedError

    @pytest.fixture
    def outcomes(self, tmp_path_factory):
        """The carrier's job, run once for all its tests."""
        if self.carrier not in _RUNS:
            folder = str(tmp_path_factory.mktemp(self.carrier.__name__))
            _RUNS[self.carrier] = _outcomes(folder, self.run_job(folder))
        return _RUNS[self.carrier]

    @pytest.mark.parametrize("name", list(EXPECTATIONS))
    def test_keeps_the_contract(self, outcomes, name):
        got = outcomes.get(name, {})
        assert got == {0: "OK", 1: "OK"}, "\n".join(
            f"machine {m}: {why if why == 'OK' else json.loads(why)}" for m, why in sorted(got.items()))


class TestMpiLink(LinkSuite):
    carrier = MpiLink

    @staticmethod
    def run_job(folder):
        from helpers.cluster_jobs import OneHost, mpirun, why_no_mpi
        from helpers.procs import DEADLINE_S, wait_for

        if why_no_mpi() is not None:
            pytest.skip(why_no_mpi())
        with OneHost(2) as m:
            rc, out, _ = mpirun(m, 2, [JOB, "mpi", folder], timeout=JOB_TIMEOUT_S)
            wait_for(lambda: not m.leftovers("synk_no_segment_", JOB), DEADLINE_S)
            assert not m.leftovers("synk_no_segment_", JOB), out
        assert rc == 0, out
        return out


class TestZmqLink(LinkSuite):
    carrier = ZmqLink

    @staticmethod
    def run_job(folder):
        env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(HERE))}
        p = subprocess.run([sys.executable, JOB, "zmq", folder], capture_output=True, text=True,
                           timeout=JOB_TIMEOUT_S, env=env)
        assert p.returncode == 0, p.stdout + p.stderr
        return p.stdout + p.stderr


def test_every_link_has_a_suite():
    concrete, todo = set(), list(LinkBase.__subclasses__())
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        if not inspect.isabstract(cls) and cls.__module__.startswith("synkhronos."):
            concrete.add(cls)
    assert concrete == {MpiLink, ZmqLink}  # a new carrier: add it here and give it a suite
    assert concrete <= {cls.carrier for cls in LinkSuite.__subclasses__()}
    assert inspect.isabstract(LinkBase)


def test_command_head_carries_the_number_and_the_generation():
    raw = link.CMD_HEAD.pack(41, 3) + b"payload"
    assert link.CMD_HEAD.unpack_from(raw) == (41, 3)
    assert raw[link.CMD_HEAD.size:] == b"payload"


# ---- the node master's side ------------------------------------------------------------
def _members(protocol):
    methods = {n for n, v in vars(protocol).items() if callable(v) and not n.startswith("_")}
    return methods, set(protocol.__annotations__)


def test_the_node_master_is_the_declared_node_side():
    methods, attributes = _members(NodeSide)
    assert {"make_segment", "receive_command", "report"} <= methods and "segments" in attributes
    for name in methods:
        assert inspect.signature(getattr(NodeMaster, name)) == \
            inspect.signature(getattr(NodeSide, name)), name
    made = NodeMaster(SimpleNamespace(), SimpleNamespace(layout=None, node=1), sentinel=4321)
    assert isinstance(made, NodeSide)
    missing = [a for a in attributes if not hasattr(made, a)]
    assert not missing, missing


def test_commands_node_steps_use_only_the_node_side():
    """What a command's ``node`` step reads of its machine is declared in ``NodeSide``."""
    import synkhronos  # noqa: F401 - registers every command
    from synkhronos.runtime.commands import COMMANDS

    methods, attributes = _members(NodeSide)
    steps = {spec.node for spec in COMMANDS.values() if spec.node is not None}
    assert len(steps) >= 4
    for step in steps:
        tree = ast.parse(textwrap.dedent(inspect.getsource(step)))
        fn = tree.body[0]
        machine = fn.args.args[0].arg
        used = {n.attr for n in ast.walk(fn) if isinstance(n, ast.Attribute)
                and isinstance(n.value, ast.Name) and n.value.id == machine}
        assert used and used <= methods | attributes, (step.__qualname__, used)
