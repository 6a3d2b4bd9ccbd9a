"""Liveness between machines, the controller's end: the sentinels' connections (``Heartbeats``).

A thread of the controller beats every sentinel (sentinel.py) each ``BEAT_S`` and reads their
beats: a closed connection means the node master died (logged at once, so the machine is named
even where the launcher then ends the job), silence for ``SYNK_HEARTBEAT_S`` that it stopped
answering; the controller's next check (``Heartbeats.read``) raises either as an error naming the
machine. The same connections ring idle node masters' doorbells (doorbell.py).
"""

import logging
import secrets
import select
import struct
import threading
import time

from ..errors import MachineLostError, SynkError, WorkerStalledError
from .auth import NONCE_BYTES, proves
from .doorbell import RING
from .sentinel import ANSWER, BEAT_S, CONNECT_TIMEOUT_S
from .settings import heartbeat_limit_s

logger = logging.getLogger(__name__)


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
            more = sock.recv(ANSWER.size - len(got) + 1)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            more = b""
        got += more
        if more and len(got) < ANSWER.size:
            pending[sock] = (nonce, got)
            return
        del pending[sock]
        node, answer = ANSWER.unpack(got) if len(got) == ANSWER.size else (None, None)
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
