"""How a cluster's processes find each other in ``fork()``: MPI, the layout, the sentinels.

Runs after the local ranks are forked (forking after ``MPI_Init`` is unsafe).
The controller returns from ``join``; a node master serves until the end.
"""

import logging
import os
import socket
import struct

import numpy as np

from ..errors import SynkError
from ..runtime.liveness import deadline_check, wait_until
from .controller import Controller
from .elastic.env import Elastic
from .launch import init_mpi, mpi_segments, placement_problem
from .layout import Layout, take_place
from .mpi_link import MpiLink
from .node import NodeMaster, serve
from .doorbell import Doorbell
from .auth import new_secret
from .settings import controller_host
from .heartbeats import Heartbeats
from .sentinel import CONNECT_TIMEOUT_S, send_address, start_sentinel

logger = logging.getLogger(__name__)


def join_cluster(rt, launch, tell_janitor, join_workers, pin):
    """Start MPI and join the other machines; return the run's size (controller only).

    Args:
        rt: this machine's Runtime, its ranks already forked.
        launch: this process's ``launchers.Launch``, or ``elastic.env.Elastic`` (cluster/elastic/).
        tell_janitor: ``tell_janitor(paths)``: files the janitor removes if this process dies.
        join_workers: ends the machine's workers after the last command (node masters).
        pin: pins this process to its core, once MPI has started.
    """
    if isinstance(launch, Elastic):
        from .elastic import door  # ZeroMQ and torch: only where machines come and go
        return door.join_elastic(rt, launch, tell_janitor, join_workers, pin)
    sentinel, sentinel_fd, bell = None, None, None
    if launch.rank != 0:
        sentinel, sentinel_fd, bell = start_sentinel(close_fds=[rt.processes.janitor.fd])
    try:
        mpi = init_mpi(launch)
        made = mpi_segments()
        if made:
            tell_janitor(made)
        link, heartbeats, pids = _connect(rt, mpi, sentinel_fd, launch)
    except BaseException:
        rt.abandon(rt, "the cluster could not be set up")
        raise
    layout = link.layout
    if link.node == 0:
        take_place(rt, link, lambda: Controller(rt, link, heartbeats, pids))
    else:
        node = take_place(rt, link, lambda: NodeMaster(rt, link, sentinel, Doorbell(bell)))
    pin()
    if link.node != 0:
        serve(rt, node, join_workers)  # never returns
    logger.info("cluster of %d machines, %d ranks (%s per machine)", layout.n_machines,
                layout.n_parallel, ", ".join(str(n) for n in layout.n_local))
    return layout.n_parallel


def _connect(rt, mpi, sentinel_fd, launch):
    """Exchange the layout, link the sentinels to the controller; return (MpiLink, Heartbeats, pids)."""
    comm = mpi.COMM_WORLD.Dup()
    me, size = comm.Get_rank(), comm.Get_size()
    check = deadline_check(
        CONNECT_TIMEOUT_S,
        f"fork: not every one of the {size} MPI processes reached fork() within "
        f"{CONNECT_TIMEOUT_S:g} s (does every process run the same script and call synk.fork()?)")

    def wait(req):
        try:
            wait_until(lambda: req.Test(), check, 0.01, poll_max_s=5e-3)
        except mpi.Exception as exc:  # a process of the job died while it started
            raise SynkError(f"fork: MPI failed while the {size} MPI processes met "
                            f"({exc.Get_error_string()}); the job cannot start") from None
    mine = np.array([rt.place.n_local, os.getpid(), launch.local_index, launch.local_count],
                    dtype=np.int64)
    everyone = np.empty((size, 4), dtype=np.int64)
    wait(comm.Iallgather(mine, everyone))
    hosts_buf = bytearray(256 * size)
    name = mpi.Get_processor_name().encode()[:255].ljust(256, b"\0")
    wait(comm.Iallgather(name, hosts_buf))
    hosts = [bytes(hosts_buf[256 * i:256 * (i + 1)]).rstrip(b"\0").decode() for i in range(size)]
    # Every process checks every one's place, so that all refuse together.
    wrong = placement_problem(launch, hosts, everyone[:, 2:].tolist())
    if wrong:
        raise SynkError(wrong)
    layout = Layout([int(n) for n in everyone[:, 0]], hosts)
    link = MpiLink(mpi, comm, layout, rt.config.spin_s)
    addr = bytearray(_ADDR.size)
    listener = None
    if me == 0:
        secret = new_secret()
        host, advertised = _listen_address(hosts)
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind((host, 0))
        listener.listen(size)
        _ADDR.pack_into(addr, 0, advertised.encode()[:255], listener.getsockname()[1], secret)
    wait(comm.Ibcast(addr, 0))
    raw_host, port, secret = _ADDR.unpack(addr)
    heartbeats = Heartbeats(layout, secret)
    if me == 0:
        try:
            heartbeats.accept(listener, size)
        finally:
            listener.close()
        heartbeats.start_beating()
    else:
        where = raw_host.rstrip(b"\0").decode()
        if where == hosts[0] and hosts[me] == hosts[0]:
            where = "127.0.0.1"  # same host: no name to resolve
        send_address(sentinel_fd, where, port, me, secret, remote=hosts[me] != hosts[0])
    logger.info("cluster: %s, this process is %s", layout,
                "the controller" if me == 0 else layout.describe(me))
    return link, heartbeats, [int(p) for p in everyone[:, 1]]


_ADDR = struct.Struct("256sq32s")  # the liveness port's host, its port, the job's secret


def _listen_address(hosts):
    """Return (address to bind the liveness port to, what node masters connect to).

    The address the cluster uses: ``SYNK_CONTROLLER_HOST``, loopback when every
    process runs on this host, else this host's own address.  Only where that
    resolves to nothing but loopback (a host name mapped to 127.0.1.1) does the
    port listen on every interface; it admits only sentinels that prove the
    job's secret in any case.
    """
    named = controller_host()
    if not named and all(h == hosts[0] for h in hosts):
        return "127.0.0.1", "127.0.0.1"
    name = named or socket.gethostname()
    try:
        ip = socket.gethostbyname(name)
    except OSError:
        ip = None
    if ip is None or (ip.startswith("127.") and not named):
        logger.info("liveness port: %s resolves to %s here; listening on every interface", name, ip)
        return "", name
    return ip, ip
