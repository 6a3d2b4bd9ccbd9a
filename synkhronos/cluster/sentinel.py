"""Liveness between machines, the node's end: each node master's sentinel process.

MPI cannot tell that a peer died. Each node master forks a sentinel before MPI starts; it holds a
TCP connection to the controller and sends a heartbeat every ``BEAT_S`` while its node master runs
(not while it is stopped). The controller reads them (heartbeats.py): a closed connection means
the node master died, silence for ``SYNK_HEARTBEAT_S`` (default 5 s) that it stopped answering.
The sentinel ends its node master when the controller's end of the connection closes, or when the
controller's own beats stop, so killing or cutting off the controller ends every machine. The same
connection rings an idle node master's doorbell (doorbell.py).
"""

import logging
import os
import pickle
import select
import signal
import socket
import struct
import time

from ..runtime.liveness import proc_start_time, proc_state, stop_process
from ..runtime.process_setup import fork_quietly
from .auth import NONCE_BYTES, mac, recv_exact
from .doorbell import RING, make_pipe, ring
from .launch import close_launcher_fds, parent_and_name
from .settings import heartbeat_limit_s

logger = logging.getLogger(__name__)

BEAT_S = 0.2
ANSWER = struct.Struct("q32s")  # machine, HMAC-SHA256(secret, nonce + machine)
CONNECT_TIMEOUT_S = 60.0
END_GRACE_S = 3.0
SENTINEL_LIMIT = 1.5  # a sentinel ends its machine after this many SYNK_HEARTBEAT_S of silence


def start_sentinel(close_fds=()):
    """Fork the node master's sentinel (before MPI starts); return its pid and two pipes.

    The node master writes the controller's address into the first pipe once
    it is known (``send_address``); it reads its doorbell from the second
    (the sentinel writes there when the controller rings, doorbell.py).
    ``close_fds`` are closed in the sentinel (the janitor's pipe: the janitor
    must see it close when the node master goes).
    """
    read_fd, write_fd = os.pipe()
    bell_r, bell_w = make_pipe()
    parent = os.getpid()
    pid = fork_quietly()
    if pid == 0:
        try:
            for fd in close_fds:
                os.close(fd)
            close_launcher_fds()
            os.close(write_fd)
            os.close(bell_r)
            # A process group of its own: a launcher that ends the dead node master's group
            # (MPICH's Hydra does, at once) leaves the sentinel the moment it needs to
            # close the connection, which names the machine before the launcher ends the job.
            os.setpgid(0, 0)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            _sentinel_main(parent, read_fd, bell_w)
        finally:
            os._exit(0)
    os.close(read_fd)
    os.close(bell_w)
    return pid, write_fd, bell_r


def send_address(fd, host, port, node, secret, remote):
    """Node master: tell its sentinel where the controller listens, which machine it is,
    the job's secret, and whether the controller runs on another host (through a pipe
    to its own child)."""
    os.write(fd, pickle.dumps((host, port, node, secret, remote)))
    os.close(fd)


# The MPI launchers' daemons on each host: MPICH's Hydra proxy, Open MPI's PRRTE daemon.
# On a machine cut off from the controller they would wait forever: the sentinel ends them.
LAUNCHER_DAEMONS = ("hydra_pmi_proxy", "prted")
# Slurm's step daemon, the parent under srun (and of the daemons above inside an
# allocation): left alone.  It reports its tasks' end to Slurm by itself once it can reach
# it, and the controller cancels the step meanwhile (launch.end_step_at_exit); ending it
# would leave slurmd a step it cannot account for.
STEP_DAEMONS = ("slurmstepd",)


def launcher_daemon(pid):
    """(pid, start time) of the MPI launcher's daemon that started ``pid``, or None (no
    launcher daemon, or Slurm's ``STEP_DAEMONS``, which the sentinel leaves alone)."""
    ppid, _ = parent_and_name(pid)
    name = parent_and_name(ppid)[1] if ppid is not None else None
    if name not in LAUNCHER_DAEMONS:
        if name in STEP_DAEMONS:
            logger.debug("node master %d runs under %s, which ends with its step", pid, name)
        return None
    return ppid, proc_start_time(ppid)


def prove(sock, node, secret):
    """Sentinel: answer the controller's challenge, proving it belongs to this job.

    The controller sends a fresh nonce; the answer is the machine's number and an HMAC of the
    nonce under the job's secret (the secret never crosses the socket; a replay fails).
    """
    nonce = recv_exact(sock, NONCE_BYTES)
    sock.sendall(ANSWER.pack(node, mac(secret, nonce, struct.pack("q", node))))


def _sentinel_main(parent, read_fd, bell):
    ready, _, _ = select.select([read_fd], [], [], CONNECT_TIMEOUT_S)
    raw = os.read(read_fd, 4096) if ready else b""
    os.close(read_fd)
    if not raw:
        return  # the node master never reached MPI: it exits by itself
    host, port, node, secret, remote = pickle.loads(raw)  # from its own parent, through a pipe
    # On a host of its own, the launcher's daemon here serves only this job's node
    # masters: when the controller goes silent it is ended too, since it would wait
    # for a launcher it cannot reach, and the launcher for it (mpiexec never returns).
    daemon = launcher_daemon(parent) if remote else None
    try:
        sock = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S)
        prove(sock, node, secret)
    except OSError:
        stop_process(parent, grace_s=END_GRACE_S)
        return
    sock.setblocking(False)
    started = proc_start_time(parent)
    # Readable the moment the node master exits: the controller then learns of it at once
    # (MPICH's Hydra ends the whole job about 0.1 s after a process dies).
    watch = [sock] + ([_pidfd(parent)] if hasattr(os, "pidfd_open") else [])
    # Later than the controller's own limit: where a link is cut, the controller names
    # the machine first; the machine is gone within 2 x SYNK_HEARTBEAT_S all the same.
    limit = SENTINEL_LIMIT * heartbeat_limit_s()
    heard = None  # when the controller's beats last arrived (None: not beating yet)
    while True:
        # Reparented: the node master is gone (its pid may already name another process).
        if os.getppid() != parent or proc_start_time(parent) != started:
            return
        readable, _, _ = select.select(watch, [], [], BEAT_S)
        if len(watch) > 1 and watch[1] in readable:
            # Closing the connection tells the controller: now, not when this process's
            # exit gets to its files (after unmapping all it inherited, milliseconds in
            # which MPICH's launcher may already end the job).
            sock.close()
            return
        if readable:
            try:
                got = sock.recv(4096)
            except OSError:
                got = b""
            if got == b"":
                # The controller is gone, or ended the job: end this machine.  SIGTERM
                # first: the node master finalises MPI, so mpiexec ends the job quietly.
                stop_process(parent, grace_s=END_GRACE_S)
                return
            if RING in got:
                ring(bell)  # a command follows: the node master may be blocked on its doorbell
            heard = time.monotonic()
        elif heard is not None and time.monotonic() - heard > limit:
            # The controller stopped beating (cut off, stopped, or its host is gone
            # without closing the connection): nobody will ever order this machine to end.
            # SIGUSR2: the node master ends without MPI_Finalize, which would wait for
            # the silent controller.
            stop_process(parent, grace_s=END_GRACE_S, sig=signal.SIGUSR2)
            if daemon is not None:
                stop_process(daemon[0], started=daemon[1])
            return
        if proc_state(parent) not in ("T", "t"):
            try:
                sock.send(b".")
            except BlockingIOError:
                pass
            except OSError:
                stop_process(parent, grace_s=END_GRACE_S)
                return


def _pidfd(pid):
    try:
        return os.pidfd_open(pid)
    except OSError:  # an old kernel: getppid() below still notices, within BEAT_S
        r, _ = os.pipe()
        return r
