"""The link suite's runs (helpers/link_suite.py), one carrier each; run by tests/cluster/test_link.py.

    mpiexec -n 2 python link_job.py mpi DIR   # MpiLink on COMM_WORLD: rank 0 the controller
    python link_job.py zmq DIR                # ZmqLink: this process the controller, a fork the node

Every expectation runs on both machines; machine k writes ``DIR/machine<k>``
(a file each: mpiexec's merged output can join two lines), a line per
expectation, ``OK <name>`` or ``FAIL <name> <traceback as JSON>``, and
``END`` once its link is finished.
"""

import os
import socket
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "helpers"))

from link_suite import run_all  # noqa: E402
from synkhronos.cluster.layout import Layout  # noqa: E402

SPIN_S = 0.0  # two machines on one host's shared cores: yield while waiting, as SYNK_SPIN_S=0


def _run(link):
    with open(os.path.join(sys.argv[2], f"machine{link.node}"), "w") as f:
        def out(line):
            f.write(line + "\n")
            f.flush()
        run_all(link, out)
        link.finish()
        out("END")


def run_mpi():
    from synkhronos.cluster.launch import init_mpi
    from synkhronos.cluster.mpi_link import MpiLink

    mpi = init_mpi()
    comm = mpi.COMM_WORLD.Dup()
    assert comm.Get_size() == 2, "run under mpiexec -n 2"
    link = MpiLink(mpi, comm, Layout([1, 1], [socket.gethostname()] * 2), SPIN_S)
    _run(link)


def run_zmq():
    import zmq

    from synkhronos.cluster.elastic.zmq_link import ZmqLink

    layout = Layout([1, 1], [socket.gethostname()] * 2)
    ident = os.urandom(16)
    port_r, port_w = os.pipe()
    pid = os.fork()  # before any ZeroMQ context: each machine makes its own
    if pid == 0:
        os.close(port_w)
        port = int(os.read(port_r, 16))
        sock = zmq.Context.instance().socket(zmq.DEALER)
        for opt, value in ((zmq.LINGER, 0), (zmq.ROUTING_ID, ident)):
            sock.setsockopt(opt, value)
        sock.connect(f"tcp://127.0.0.1:{port}")
        link = ZmqLink(sock, layout, 1, SPIN_S, None)
    else:
        os.close(port_r)
        sock = zmq.Context.instance().socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        os.write(port_w, str(port).encode())
        link = ZmqLink(sock, layout, 0, SPIN_S, None, idents=[None, ident])
    try:
        _run(link)
    finally:
        if pid == 0:
            os._exit(0)
    os.waitpid(pid, 0)


if __name__ == "__main__":
    {"mpi": run_mpi, "zmq": run_zmq}[sys.argv[1]]()
