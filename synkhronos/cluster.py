"""Clusters: one controller and one node master per MPI process (DESIGN.md, decision 9).

``mpiexec -n N python train.py`` starts the script N times.  In ``fork()``
each copy first forks its own local ranks, exactly as on one machine, and only
then initialises MPI (forking after ``MPI_Init`` is unsafe; the local ranks
never touch MPI).  MPI rank 0 becomes the controller: ``fork()`` returns
there and the program goes on.  Every other MPI process becomes a node
master: it serves the controller's commands (``serve``) and exits when the
controller closes, so the user's code after ``fork()`` never runs there.

Commands: the controller posts a command to its own ranks as on one machine
and sends the same bytes to every node master (``forward``), which posts it
to its ranks and runs its own share; every node master then sends one report
(its ranks' failures, and what they contributed to the call's outputs), and
the controller's command ends when its own ranks and every report are in.

Collectives between machines run among the node leaders only
(``comm.mpi_backend``); inside a machine the shared-memory backend moves the
bytes.  Every MPI wait here is a loop over ``improbe`` or ``Test`` that keeps
calling the liveness check, so none waits without a bound.

Liveness: MPI cannot tell that a peer died.  Each node master forks a
sentinel before MPI starts; it holds a TCP connection to the controller and
sends a heartbeat every ``BEAT_S`` while its node master runs (not while it is
stopped).  The controller reads them while it waits: a closed connection
means the node master died, silence for ``SYNK_HEARTBEAT_S`` (default 5 s)
that it stopped answering; either ends the job with an error naming the
machine.  The sentinel kills its node master when the controller's end of
the connection closes, so killing the controller ends every machine.
"""

import ctypes
import logging
import os
import pickle
import select
import signal
import socket
import struct
import sys
import time
from typing import NamedTuple

import numpy as np

from .control import Command, handler
from .errors import SynkError, WorkerDiedError, WorkerStalledError
from .liveness import pid_alive, proc_start_time, proc_state, wait_until

logger = logging.getLogger(__name__)

# Tags of the messages between the controller and node masters.
CMD, REPORT, ABORT, DATA, DONE = 1, 2, 3, 4, 5   # DONE: a report of nothing but success
TAG_BASE = 64            # collectives: TAG_BASE + (seq * PER_CMD + k) % TAG_SPAN
PER_CMD = 256
EXIT = -1                # an ABORT message with this seq: stop serving and exit
INBAND_BYTES = 1 << 16   # smaller buffers travel inside the pickle
POOL_BYTES = 1 << 16     # received buffers this large are reused (Cluster._buffer)
POOL_MAX = 64
BEAT_S = 0.2
CONNECT_TIMEOUT_S = 60.0
END_GRACE_S = 3.0
# Commands that stay on the machine that posts them.
LOCAL_ONLY = frozenset({Command.GROW_MESSAGE, Command.LAYOUT})


def launched():
    """Return ``(mpi rank, mpi size, index on this host, MPI processes on this host)``, or None.

    Read from the environment mpiexec sets (MPICH's Hydra, Open MPI, PMIx),
    without initialising MPI.  None when not started by mpiexec, when the job
    has one process, or when ``SYNK_CLUSTER=0``.
    """
    if os.environ.get("SYNK_CLUSTER", "1") == "0":
        return None
    env = os.environ
    for rank_k, size_k, lrank_k, lsize_k in (
            ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
            ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
             "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
            ("PMIX_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
             "OMPI_COMM_WORLD_LOCAL_SIZE")):
        if rank_k in env and size_k in env:
            size = int(env[size_k])
            if size < 2:
                return None
            return (int(env[rank_k]), size, int(env.get(lrank_k, 0)), int(env.get(lsize_k, 1)))
    return None


def share_cores(cores, index, count):
    """The cores one of ``count`` MPI processes on a host uses: its own contiguous share."""
    n = len(cores)
    if count <= 1:
        return list(cores)
    if count >= n:
        return [cores[index % n]]
    return list(cores[index * n // count:(index + 1) * n // count])


def heartbeat_limit_s():
    """Seconds of silence after which a node master counts as stopped (``SYNK_HEARTBEAT_S``)."""
    return float(os.environ.get("SYNK_HEARTBEAT_S", "5"))


class Layout:
    """Where the ranks are: machine by machine, ``n_local[m]`` ranks on machine ``m``.

    Attributes:
        n_local: ranks on each machine (machine 0 holds the controller).
        offsets: the first global rank of each machine.
        hosts: each machine's host name.
    """

    def __init__(self, n_local, hosts):
        self.n_local = list(n_local)
        self.hosts = list(hosts)
        self.offsets = [sum(self.n_local[:m]) for m in range(len(self.n_local))]

    @property
    def n_machines(self):
        return len(self.n_local)

    @property
    def n_parallel(self):
        return sum(self.n_local)

    def ranks(self, machine):
        """The global ranks on ``machine``."""
        lo = self.offsets[machine]
        return range(lo, lo + self.n_local[machine])

    def machine_of(self, rank):
        """The machine that holds global ``rank``."""
        for m in range(self.n_machines):
            if rank < self.offsets[m] + self.n_local[m]:
                return m
        raise ValueError(f"rank {rank} is not in the run's {self.n_parallel} ranks")

    def describe(self, machine):
        r = self.ranks(machine)
        return f"machine {machine} ({self.hosts[machine]}, ranks {r.start}..{r.stop - 1})"

    def __repr__(self):
        return f"Layout(n_local={self.n_local}, hosts={self.hosts})"


def _inband(buf, out):
    if buf.raw().nbytes < INBAND_BYTES:
        return True
    out.append(buf)
    return False


class Cluster:
    """The MPI side of one process: the controller's or a node master's.

    Args:
        comm: this job's communicator (a duplicate of COMM_WORLD).
        layout: the ``Layout``.
        spin_s: how long waits spin before sleeping.
    """

    def __init__(self, mpi, comm, layout, spin_s):
        self.MPI = mpi
        self.comm = comm
        self.node = comm.Get_rank()
        self.is_controller = self.node == 0
        self.layout = layout
        self.spin_s = spin_s
        self.seq = 0           # the controller's command count: tags of a command's messages
        self.k = 0             # the collective within the command
        self.sends = []        # (request, buffer) not yet known complete
        self.reports = {}      # controller: machine -> report of the current command
        self.pending = False   # controller: reports of the current command still to take
        self.failed = False    # controller: a machine reported a failure in this command
        self.socks = {}        # controller: machine -> heartbeat socket
        self.last_beat = {}
        self.beat_limit = heartbeat_limit_s()
        self.control = None    # set by attach: the local control block (abort flag)
        self.pool = {}         # reused receive buffers
        self.orphans = []      # (request, buffer) of sends an aborted command left behind
        self.sentinel = None   # node master: the sentinel's pid
        self.quitting = False  # controller: QUIT was sent
        self.broken = False    # a machine failed: MPI is not used again (nor finalised)
        span = int(mpi.COMM_WORLD.Get_attr(mpi.TAG_UB)) - TAG_BASE
        self.tag_span = max(PER_CMD, span - span % PER_CMD)
        self.others = [m for m in range(layout.n_machines) if m != self.node]

    # -- messages ---------------------------------------------------------------------
    def next_tag(self):
        """A fresh tag for one collective of the current command (the same on every machine)."""
        self.k += 1
        return TAG_BASE + (self.seq * PER_CMD + self.k) % self.tag_span

    def send(self, dest, tag, obj):
        """Send ``obj`` (pickled; large buffers out of band, not copied) to machine ``dest``.

        A reduction's partial, ``(list of small arrays, float)``, travels in a
        compact form instead: pickling arrays costs several microseconds each way.
        """
        packed = _pack_partial(obj)
        if packed is not None:
            self.sends.append((self.comm.Isend(packed, dest, tag), packed))
            return
        bufs = []
        head = pickle.dumps(obj, protocol=5, buffer_callback=lambda b: _inband(b, bufs))
        head = struct.pack("q", len(bufs)) + head
        comm = self.comm
        self.sends.append((comm.Isend(head, dest, tag), head))
        for b in bufs:
            raw = b.raw()
            self.sends.append((comm.Isend(raw, dest, tag), raw))

    def _probe(self, src, tag, check):
        """Wait for a message; return (message, its size in bytes)."""
        comm = self.comm
        st = self.MPI.Status()
        box = []

        def arrived():
            m = comm.Improbe(src, tag, st)
            if m is None:
                return False
            box.append(m)
            return True
        wait_until(arrived, check, self.spin_s)
        return box[0], st.Get_count(self.MPI.BYTE)

    def _recv_bytes(self, src, tag, check, slot=None):
        m, n = self._probe(src, tag, check)
        buf = self._buffer(src, slot, n)
        m.Recv(buf)
        return buf

    def _buffer(self, src, slot, n):
        """A receive buffer: large ones are kept per (sender, place in message, size).

        Fresh memory costs a page fault per 4 KiB at every call (about as much
        as the transfer itself); what was received is only valid until the
        next collective (the backend contract), so the buffer can be reused.
        """
        if slot is None or n < POOL_BYTES:
            return bytearray(n)
        key = (src, slot, n)
        buf = self.pool.get(key)
        if buf is None:
            if len(self.pool) >= POOL_MAX:
                self.pool.clear()
            buf = self.pool[key] = bytearray(n)
        return buf

    def recv_into(self, src, tag, buf, check):
        """Receive raw bytes from machine ``src`` into ``buf`` (a writable buffer of their size)."""
        m, n = self._probe(src, tag, check)
        if n != len(buf):
            raise SynkError(f"expected {len(buf)} bytes from machine {src}, got {n}")
        m.Recv(buf)

    def recv(self, src, tag, check):
        """Receive what ``send`` sent from machine ``src`` with ``tag``."""
        return self._rest(src, tag, self._recv_bytes(src, tag, check), check, pooled=True)

    def _rest(self, src, tag, head, check, pooled):
        """Unpickle a message from its head, receiving its out-of-band buffers.

        ``pooled``: receive them into kept buffers (results valid until the
        next collective), not for what must outlive the command.
        """
        n_bufs = struct.unpack_from("q", head)[0]
        if n_bufs == PACKED:
            return _unpack_partial(head)
        bufs = [self._recv_bytes(src, tag, check, slot=i if pooled else None)
                for i in range(n_bufs)]
        return pickle.loads(memoryview(head)[8:], buffers=bufs)

    def complete_sends(self, check):
        """Wait until every send so far has completed (its buffer may be reused)."""
        if not self.sends:
            return
        reqs = [r for r, _ in self.sends]
        wait_until(lambda: self.MPI.Request.Testall(reqs), check, self.spin_s)
        self.sends.clear()

    def retire_sends(self):
        """Stop waiting for sends a command left pending; return nothing.

        Called when a command is over on this side: every message a peer still
        wanted has been received by then (its report says so), so a send still
        pending belongs to a collective that a failure abandoned, and the peer
        will never receive it (a large message waits for its receiver).  Its
        request and buffer are kept, tested again later, never waited for.
        """
        if self.sends or self.orphans:
            self.orphans = [(r, b) for r, b in self.orphans + self.sends if not r.Test()]
            self.sends = []

    # -- controller -------------------------------------------------------------------
    def forward(self, cmd, data):
        """Controller: send a posted command's bytes to every node master."""
        if not self.is_controller or cmd in LOCAL_ONLY:
            return
        self.seq += 1
        self.k = 0
        # Node masters stop their sentinels on QUIT: a closed connection then means no failure.
        self.quitting = cmd == Command.QUIT
        self.reports = {}
        self.failed = False
        msg = struct.pack("q", self.seq) + bytes(data)
        for m in self.others:
            self.sends.append((self.comm.Isend(msg, m, CMD), msg))
        self.pending = True

    def wait_reports(self, check):
        """Controller: wait for every node master's report; return {rank: (text, exc)} failures.

        Node masters' contributions to the call's outputs are kept for
        ``contributions()``.  Raises WorkerDiedError if a machine died.
        """
        if not self.is_controller or not self.pending:
            return None
        wait_until(self._all_reported, check, self.spin_s)
        self.pending = False
        self.retire_sends()
        failures = {}
        died = None
        for m in self.others:
            rep = self.reports[m]
            if rep["died"] is not None and died is None:
                died = (m, rep["died"])
            for rank, text, exc_bytes in rep["failures"]:
                failures[rank] = (text, _unpickle(exc_bytes))
        if died is not None:
            m, text = died
            raise WorkerDiedError(f"{self.layout.describe(m)}: {text}",
                                  self.layout.offsets[m], None)
        return failures

    def _all_reported(self):
        """Take the reports that have arrived; return whether every machine's is in."""
        comm = self.comm
        st = self.MPI.Status()
        done = True
        for m in self.others:
            if m not in self.reports:
                probed = comm.Improbe(m, DONE, st)
                if probed is not None:
                    buf = bytearray(8)
                    probed.Recv(buf)
                    self._check_seq(m, struct.unpack("q", buf)[0])
                    self.reports[m] = _DONE
                    continue
                probed = comm.Improbe(m, REPORT, st)
                if probed is None:
                    done = False
                else:
                    self._take_report(m, probed, st.Get_count(self.MPI.BYTE))
        return done

    def _check_seq(self, m, seq):
        if seq != self.seq:
            raise SynkError(f"{self.layout.describe(m)} reported command {seq} "
                            f"while the controller ran {self.seq}")

    def _take_report(self, m, probed, n):
        head = bytearray(n)
        probed.Recv(head)
        # Contributions are kept until the call's results are combined: not pooled.
        rep = self._rest(m, REPORT, head, self._bare_check, pooled=False)
        self._check_seq(m, rep["seq"])
        self.reports[m] = rep
        if (rep["failures"] or rep["died"]) and not self.failed:
            # The other machines may wait for this one inside a collective.
            self.failed = True
            msg = struct.pack("q", self.seq)
            for q in self.others:
                if q not in self.reports:
                    self.sends.append((self.comm.Isend(msg, q, ABORT), msg))
            if self.control is not None:
                self.control.abort(self.control.current)

    def late_ranks(self):
        """Controller: the ranks of the machines whose report of this command is not in."""
        if not self.pending:
            return []
        return [r for m in self.others if m not in self.reports for r in self.layout.ranks(m)]

    def _bare_check(self):
        self.beats()

    def contributions(self):
        """Controller: {global rank: (arrays, weight)} the other machines' ranks contributed."""
        out = {}
        for rep in self.reports.values():
            for rank, arrays, weight in rep["contributions"]:
                out[rank] = (arrays, weight)
        return out

    def poll(self):
        """Controller's check while it waits: heartbeats, and reports that carry failures."""
        self.beats()
        if self.pending:
            self._all_reported()

    def beats(self):
        """Read the sentinels' heartbeats; raise if a machine died or went silent."""
        now = time.monotonic()
        for m, sock in self.socks.items():
            try:
                got = sock.recv(4096)
            except BlockingIOError:
                got = None
            except OSError:
                got = b""
            if got == b"" and not self.quitting:
                raise WorkerDiedError(
                    f"{self.layout.describe(m)}: its node master died (the connection to its "
                    "sentinel closed); the job is ended", self.layout.offsets[m], None)
            if got or self.quitting:
                self.last_beat[m] = now
            elif now - self.last_beat[m] > self.beat_limit:
                raise WorkerStalledError(
                    f"{self.layout.describe(m)}: its node master stopped answering (no heartbeat "
                    f"for {now - self.last_beat[m]:.1f} s, SYNK_HEARTBEAT_S="
                    f"{self.beat_limit:g}); the job is ended", self.layout.offsets[m], None)

    def sync_data(self, data_id, offset, raw, check):
        """Controller: copy ``raw`` into Data ``data_id``'s memory at byte ``offset`` on every machine."""
        payload = pickle.dumps((int(Command.DATA_SYNC), (data_id, offset, len(raw)), None))
        self.forward(Command.DATA_SYNC, payload)
        for m in self.others:
            self.sends.append((self.comm.Isend(raw, m, DATA), raw))
        failures = self.wait_reports(check)
        if failures:
            raise SynkError("mirroring Data failed: " + "; ".join(t for t, _ in failures.values()))

    def end(self):
        """Controller, after a failure: end every machine, without waiting and without MPI.

        Closing the heartbeat connections makes each sentinel stop its node
        master (MPI itself may be broken by now: a send to a dead process can
        abort this one).
        """
        for sock in self.socks.values():
            sock.close()
        self.socks = {}
        self.broken = True

    # -- node master -------------------------------------------------------------------
    def receive_command(self, check):
        """Node master: wait for the controller's next command; return (seq, bytes)."""
        buf = self._recv_bytes(0, CMD, check)
        self.seq = struct.unpack_from("q", buf)[0]
        self.k = 0
        return memoryview(buf)[8:]

    def node_check(self):
        """Node master's check while it waits: an abort or exit order from the controller."""
        probed = self.comm.Improbe(0, ABORT)
        if probed is None:
            return
        buf = bytearray(8)
        probed.Recv(buf)
        seq = struct.unpack("q", buf)[0]
        if seq == EXIT:
            raise Exit()
        if seq == self.seq and self.control is not None:
            self.control.abort(self.control.current)

    def report(self, failures, contributions, died=None):
        """Node master: send the command's outcome to the controller."""
        if not failures and not contributions and died is None:
            msg = struct.pack("q", self.seq)  # most commands: 8 bytes, nothing to unpickle
            self.sends.append((self.comm.Isend(msg, 0, DONE), msg))
            return
        self.send(0, REPORT, {"seq": self.seq, "failures": failures,
                              "contributions": contributions, "died": died})


PACKED = -1  # first word of a compact partial (a pickled message starts with its buffer count)


def _pack_partial(obj):
    """``(arrays, mass)`` with small plain arrays, as bytes that unpickle fast; else None.

    Arrays as (dtype, shape, bytes) tuples pickle and unpickle in ~3 us, where
    pickling the arrays themselves costs ~12 us.
    """
    if type(obj) is not tuple or len(obj) != 2 or type(obj[0]) is not list \
            or not isinstance(obj[1], float):
        return None
    items = []
    total = 0
    for a in obj[0]:
        if type(a) is not np.ndarray or a.dtype.hasobject:
            return None
        total += a.nbytes
        if total > INBAND_BYTES:
            return None
        items.append((a.dtype.str, a.shape, a.tobytes()))
    return _PACKED_HEAD + pickle.dumps((items, obj[1]), protocol=5)


def _unpack_partial(buf):
    items, mass = pickle.loads(memoryview(buf)[8:])
    return [np.frombuffer(raw, d).reshape(shape) for d, shape, raw in items], mass


_PACKED_HEAD = struct.pack("q", PACKED)


_DONE = {"seq": None, "failures": [], "contributions": [], "died": None}


class Exit(BaseException):
    """The controller ordered this node master to stop."""


def _unpickle(raw):
    if raw is None:
        return None
    try:
        return pickle.loads(raw)
    except Exception:  # noqa: BLE001 - the text still tells what happened
        return None


# -- setting up ------------------------------------------------------------------------

def close_launcher_fds():
    """In a process forked from an MPI process: close its link to the MPI launcher.

    mpiexec (MPICH's Hydra) passes each process a socket (``PMI_FD``); a forked
    child that keeps it open can make the launcher see the MPI process's end
    wrongly, and end the job.
    """
    fd = os.environ.get("PMI_FD")
    if fd and fd.isdigit():
        try:
            os.close(int(fd))
        except OSError:
            pass


def start_sentinel(close_fds=()):
    """Fork the node master's sentinel (before MPI starts); return the pipe to send it the address.

    ``close_fds`` are closed in the sentinel (the janitor's pipe: the janitor
    must see it close when the node master goes).
    """
    read_fd, write_fd = os.pipe()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        try:
            for fd in close_fds:
                os.close(fd)
            close_launcher_fds()
            os.close(write_fd)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            _sentinel_main(parent, read_fd)
        finally:
            os._exit(0)
    os.close(read_fd)
    return pid, write_fd


def _sentinel_main(parent, read_fd):
    ready, _, _ = select.select([read_fd], [], [], CONNECT_TIMEOUT_S)
    raw = os.read(read_fd, 4096) if ready else b""
    os.close(read_fd)
    if not raw:
        return  # the node master never reached MPI: it exits by itself
    host, port, node = pickle.loads(raw)
    try:
        sock = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S)
        sock.sendall(struct.pack("q", node))
    except OSError:
        _end(parent)
        return
    sock.setblocking(False)
    started = proc_start_time(parent)
    while True:
        # Reparented: the node master is gone (its pid may already name another process).
        if os.getppid() != parent or proc_start_time(parent) != started:
            return
        readable, _, _ = select.select([sock], [], [], BEAT_S)
        if readable:
            try:
                got = sock.recv(64)
            except OSError:
                got = b""
            if got == b"":
                _end(parent)  # the controller is gone, or ended the job: end this machine
                return
        if proc_state(parent) not in ("T", "t"):
            try:
                sock.send(b".")
            except BlockingIOError:
                pass
            except OSError:
                _end(parent)
                return


def _end(pid):
    """Make the node master exit: SIGTERM (it finalises MPI, so mpiexec lets the job end
    normally), SIGKILL if it has not gone within ``END_GRACE_S``."""
    for sig in (signal.SIGCONT, signal.SIGTERM):
        try:
            os.kill(pid, sig)
        except OSError:
            return
    deadline = time.monotonic() + END_GRACE_S
    while time.monotonic() < deadline:
        if not pid_alive(pid) or proc_state(pid) in ("Z", "X", None):
            return
        time.sleep(0.02)
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass


def init_mpi():
    """Initialise MPI (after the local fork) and return the module; finalised by ``finalize``."""
    import mpi4py
    mpi4py.rc.finalize = False  # synkhronos finalises at close; never a blocking atexit
    mpi4py.rc.thread_level = "single"
    from mpi4py import MPI
    return MPI


def mpi_segments():
    """The /dev/shm files this process has mapped since MPI started (MPICH's ``mpich_shm_*``).

    MPI unlinks them when it finalises; a killed process leaves them, so the
    janitor removes them after its master has gone.
    """
    out = set()
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rstrip("\n").split(None, 5)[-1] if line.count(" ") >= 5 else ""
                name = os.path.basename(path)
                if path.startswith("/dev/shm/") and not name.startswith("synk_"):
                    out.add(path.replace(" (deleted)", ""))
    except OSError:
        pass
    return sorted(out)


def connect(rt, mpi, sentinel_fd, spin_s):
    """Exchange the layout, link the sentinels to the controller; return the ``Cluster``."""
    comm = mpi.COMM_WORLD.Dup()
    me, size = comm.Get_rank(), comm.Get_size()
    deadline = time.monotonic() + CONNECT_TIMEOUT_S

    def _no_check():
        if time.monotonic() > deadline:
            raise SynkError(f"fork: not every one of the {size} MPI processes reached fork() "
                            f"within {CONNECT_TIMEOUT_S:g} s (does every process run the same "
                            "script and call synk.fork()?)")
    mine = np.array([rt.n_local, os.getpid()], dtype=np.int64)
    everyone = np.empty((size, 2), dtype=np.int64)
    req = comm.Iallgather(mine, everyone)
    wait_until(lambda: req.Test(), _no_check, 0.01, poll_max_s=5e-3)
    host = mpi.Get_processor_name()
    hosts_buf = bytearray(256 * size)
    name = host.encode()[:255].ljust(256, b"\0")
    req = comm.Iallgather(name, hosts_buf)
    wait_until(lambda: req.Test(), _no_check, 0.01, poll_max_s=5e-3)
    hosts = [bytes(hosts_buf[256 * i:256 * (i + 1)]).rstrip(b"\0").decode() for i in range(size)]
    layout = Layout([int(n) for n in everyone[:, 0]], hosts)
    cluster = Cluster(mpi, comm, layout, spin_s)
    cluster.pids = [int(p) for p in everyone[:, 1]]
    addr = bytearray(512)
    listener = None
    if me == 0:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind(("", 0))
        listener.listen(size)
        where = os.environ.get("SYNK_CONTROLLER_HOST") or socket.gethostname()
        raw = pickle.dumps((where, listener.getsockname()[1]))
        addr[:len(raw)] = raw
    req = comm.Ibcast(addr, 0)
    wait_until(lambda: req.Test(), _no_check, 0.01, poll_max_s=5e-3)
    if me == 0:
        listener.settimeout(CONNECT_TIMEOUT_S)
        try:
            for _ in range(size - 1):
                sock, _ = listener.accept()
                sock.settimeout(CONNECT_TIMEOUT_S)
                node = struct.unpack("q", _recv_exact(sock, 8))[0]
                sock.setblocking(False)
                cluster.socks[node] = sock
                cluster.last_beat[node] = time.monotonic()
        except OSError as exc:
            raise SynkError(f"fork: not every node master's sentinel reached the controller "
                            f"({len(cluster.socks)} of {size - 1}): {exc}") from exc
        finally:
            listener.close()
    else:
        where, port = pickle.loads(bytes(addr))
        if hosts[me] == hosts[0] and not os.environ.get("SYNK_CONTROLLER_HOST"):
            where = "127.0.0.1"  # same host: no name to resolve
        os.write(sentinel_fd, pickle.dumps((where, port, me)))
        os.close(sentinel_fd)
    logger.info("cluster: %s, this process is %s", layout,
                "the controller" if me == 0 else layout.describe(me))
    return cluster


def _recv_exact(sock, n):
    out = b""
    while len(out) < n:
        got = sock.recv(n - len(out))
        if not got:
            raise OSError("connection closed")
        out += got
    return out


_FINISHED = []


def finished():
    """Whether this process's cluster job has ended (MPI cannot start again)."""
    return bool(_FINISHED)


def finalize(mpi):
    """Finalise MPI in this process (after which mpiexec lets the others run on)."""
    _FINISHED.append(True)
    try:
        if mpi.Is_initialized() and not mpi.Is_finalized():
            mpi.Finalize()
    except Exception as exc:  # noqa: BLE001 - exiting anyway
        logger.warning("MPI_Finalize failed: %s", exc)


def exit_finalized(status=0):
    """End this process after ``finalize``, the way a C program ends: ``exit(status)``.

    MPICH's PMI client tells mpiexec that the process finished in a C exit
    handler; ``os._exit`` skips it, and mpiexec then takes the exit for a crash
    and kills every other process of the job, a controller still running the
    user's script after ``close()`` included.  C's exit runs that handler and
    none of Python's (no ``atexit``, no ``finally`` in the user's script around
    ``fork()``).  Python's own buffers are flushed first, as a normal exit would.
    """
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError, RuntimeError):
            # RuntimeError: SIGTERM's handler ends here, maybe in the middle of a write.
            pass
    try:
        ctypes.CDLL(None).exit(status)
    except (OSError, AttributeError):  # no C library to call: no PMI handler either
        pass
    os._exit(status)


class LayoutMsg(NamedTuple):
    """LAYOUT: this machine's first global rank and the run's number of ranks."""

    offset: int
    n_parallel: int


def set_layout(rt, offset, n_parallel):
    """Give this process its global rank, once the layout is known."""
    rt.rank_offset = offset
    rt.rank = offset + rt.local_index
    rt.n_parallel = n_parallel


@handler(Command.LAYOUT, LayoutMsg)
def _layout_worker(rt, msg):
    set_layout(rt, msg.offset, msg.n_parallel)


def layout():
    """Return where the run's ranks are: a ``Layout`` (machines, ranks on each, host names).

    On one machine: one machine holding every rank.  Master (controller) only,
    after ``fork()``.

    Example::

        synk.fork()
        lay = synk.layout()
        lay.n_machines, lay.n_local, lay.ranks(1)   # 2, [2, 2], range(2, 4)
    """
    from .runtime import require_forked
    rt = require_forked("layout()")
    if rt.cluster is not None:
        return rt.cluster.layout
    return Layout([rt.n_parallel], [socket.gethostname()])
