"""Liveness between machines: each node master's sentinel process, and the heartbeats it sends.

MPI cannot tell that a peer died. Each node master forks a sentinel before MPI starts; it holds a
TCP connection to the controller and sends a heartbeat every ``BEAT_S`` while its node master runs
(not while it is stopped). A thread of the controller reads them (``Heartbeats``): a closed
connection means the node master died (logged at once, so the machine is named even where the
launcher then ends the job), silence for ``SYNK_HEARTBEAT_S`` (default 5 s) that it stopped
answering; the controller's next check raises either as an error naming the machine. The sentinel
ends its node master when the controller's end of the connection closes, so killing the controller
ends every machine. The same connection rings an idle node master's doorbell (doorbell.py). Both
ends of this one connection live here, hence over 400 lines.
"""

import logging
import os
import pickle
import secrets
import select
import signal
import socket
import struct
import threading
import time

from ..errors import MachineLostError, SynkError, WorkerStalledError
from ..runtime.liveness import proc_start_time, proc_state, stop_process
from ..runtime.process_setup import fork_quietly
from .auth import NONCE_BYTES, mac, proves, recv_exact
from .doorbell import RING, make_pipe, ring
from .launch import close_launcher_fds, parent_and_name
from .settings import heartbeat_limit_s

logger = logging.getLogger(__name__)

BEAT_S = 0.2
_ANSWER = struct.Struct("q32s")  # machine, HMAC-SHA256(secret, nonce + machine)
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
    sock.sendall(_ANSWER.pack(node, mac(secret, nonce, struct.pack("q", node))))


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


class Heartbeats:
    """The controller's end of the sentinels' connections.

    Args:
        layout: the run's ``Layout`` (to name a lost machine).
        secret: the job's secret (``new_secret``), which every sentinel proves it holds.
        drop_silent: silence is a loss the run survives (``MachineLostError``, elastic/door.py).
    """

    def __init__(self, layout, secret, drop_silent=False):
        self.layout = layout
        self.secret = secret
        self.drop_silent = drop_silent
        self.socks = {}        # machine -> connected socket
        self.last_beat = {}    # machine -> when its sentinel was last heard
        self.closed = {}       # machine -> when its connection closed (the beating thread saw it)
        self.limit = heartbeat_limit_s()
        self.quitting = False  # QUIT was sent: a closed connection is no failure
        self.silent = None     # the machine that stopped answering, once read() said so
        self._lock = threading.Lock()  # the thread and keep() both change the machines
        self._stop = threading.Event()
        self._beater = None

    def accept(self, listener, n_machines, timeout_s=CONNECT_TIMEOUT_S, expected=None):
        """Take one proven connection per node master from ``listener``.

        Each connection gets a fresh nonce and must answer it (``prove``) within the deadline;
        a connection that answers wrongly, names a machine already connected, sends too much or
        closes is dropped with a warning, and the wait goes on: strangers cannot take a
        sentinel's place or stall the job.  Nothing received is unpickled.

        ``expected``: {number a sentinel proves: its machine} (default: m -> m, 1..n-1).

        Raises:
            SynkError: not every node master's sentinel proved itself in time.
        """
        if expected is None:
            expected = {m: m for m in range(1, n_machines)}
        deadline = time.monotonic() + timeout_s
        want = len(self.socks) + len(expected)
        listener.setblocking(False)
        pending = {}  # socket -> (nonce, bytes received so far)
        try:
            while len(self.socks) < want:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise SynkError(
                        f"fork: not every node master's sentinel reached the controller "
                        f"({len(self.socks)} of {want} within {timeout_s:g} s)")
                ready, _, _ = select.select([listener, *pending], [], [], min(left, 0.5))
                for sock in ready:
                    if sock is listener:
                        self._challenge(listener, pending)
                    else:
                        self._answer(sock, pending, expected)
        finally:
            for sock in pending:
                sock.close()

    @staticmethod
    def _challenge(listener, pending):
        try:
            sock, _ = listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        nonce = secrets.token_bytes(NONCE_BYTES)
        try:
            sock.setblocking(True)
            sock.settimeout(1.0)
            sock.sendall(nonce)
            sock.setblocking(False)
        except OSError:
            sock.close()
            return
        pending[sock] = (nonce, b"")

    def _answer(self, sock, pending, expected):
        nonce, got = pending[sock]
        try:
            more = sock.recv(_ANSWER.size - len(got) + 1)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            more = b""
        got += more
        if more and len(got) < _ANSWER.size:
            pending[sock] = (nonce, got)
            return
        del pending[sock]
        node, answer = _ANSWER.unpack(got) if len(got) == _ANSWER.size else (None, None)
        machine = expected.get(node)
        if machine is None or machine in self.socks \
                or not proves(self.secret, nonce, struct.pack("q", node), answer):
            logger.warning("liveness port: dropped a connection that did not prove it "
                           "belongs to this job")
            sock.close()
            return
        with self._lock:  # the beating thread may run (a machine joining)
            self.socks[machine] = sock
            self.last_beat[machine] = time.monotonic()

    def read(self):
        """Raise if a machine died or went silent (what the beating thread saw)."""
        if self.quitting:
            return
        now = time.monotonic()
        with self._lock:
            closed = min(self.closed, default=None)
            if closed is not None:
                raise MachineLostError(
                    f"{self.layout.describe(closed)}: its node master died (the connection to "
                    "its sentinel closed)", self.layout.offsets[closed], [closed])
            for m, beat in self.last_beat.items():
                if now - beat <= self.limit:
                    continue
                what = (f"{self.layout.describe(m)}: its node master stopped answering (no heartbeat "
                        f"for {now - beat:.1f} s, SYNK_HEARTBEAT_S={self.limit:g})")
                if self.drop_silent:  # cut off or stopped: the run goes on without it
                    raise MachineLostError(what + "; it is dropped", self.layout.offsets[m], [m])
                self.silent = m
                raise WorkerStalledError(what + "; the job is ended", self.layout.offsets[m], None)

    def start_beating(self):
        """Beat every sentinel each ``BEAT_S`` and read their beats, from a thread.

        Heartbeats go both ways: a sentinel that hears nothing for
        ``SYNK_HEARTBEAT_S`` ends its machine, so a controller that is cut off or
        stopped leaves no machine waiting for it forever.  A thread, because the
        user's program may compute for hours between two commands; it also
        names a machine whose connection closed at once, in the log, since
        some launchers (MPICH's Hydra) end the whole job a moment later.
        """
        self._beater = threading.Thread(target=self._beat, name="synk-heartbeats", daemon=True)
        self._beater.start()

    def _beat(self):
        next_beat = 0.0
        while not self._stop.is_set():
            with self._lock:
                live = {m: s for m, s in self.socks.items() if m not in self.closed}
            now = time.monotonic()
            if now >= next_beat:
                for sock in live.values():
                    try:
                        sock.send(b".")
                    except OSError:  # full, or closed: reading tells what happened
                        pass
                next_beat = now + BEAT_S
            try:
                ready, _, _ = select.select(list(live.values()), [], [],
                                            max(0.0, next_beat - now))
            except (OSError, ValueError):  # a socket closed by keep() or close()
                continue
            now = time.monotonic()
            for m, sock in live.items():
                if sock in ready:
                    self._take(m, sock, now)

    def _take(self, m, sock, now):
        try:
            got = sock.recv(4096)
        except BlockingIOError:
            return
        except OSError:
            got = b""
        with self._lock:
            if self.socks.get(m) is not sock:
                return  # renumbered or closed meanwhile
            if got:
                self.last_beat[m] = now
                return
            self.closed[m] = now
            quitting = self.quitting
        if not quitting:
            logger.error("%s lost: the connection to its sentinel closed", self.layout.describe(m))

    def ring(self, machines):
        """Ring the doorbells of ``machines``' node masters (a command follows, doorbell.py)."""
        socks = self.socks
        for m in machines:
            sock = socks.get(m)
            if sock is not None:
                try:
                    sock.send(RING)
                except OSError:  # full, or closed: the beating thread tells what happened
                    pass

    def keep(self, survivors, layout):
        """Go on with the machines ``survivors`` (old indices, controller first), now ``layout``."""
        with self._lock:
            for m, sock in self.socks.items():
                if m not in survivors:
                    sock.close()
            index = {old: new for new, old in enumerate(survivors)}
            now = time.monotonic()
            self.socks = {index[m]: s for m, s in self.socks.items() if m in index}
            self.last_beat = dict.fromkeys(self.socks, now)
            self.closed = {index[m]: t for m, t in self.closed.items() if m in index}
            self.layout = layout

    def close(self):
        """Stop beating and close every connection: each sentinel then ends its node master."""
        self._stop.set()
        if self._beater is not None:
            self._beater.join()
            self._beater = None
        with self._lock:
            for sock in self.socks.values():
                sock.close()
            self.socks = {}
            self.last_beat = {}
