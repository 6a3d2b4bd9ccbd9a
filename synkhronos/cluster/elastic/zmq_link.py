"""The link between machines that come and go: control messages over ZeroMQ, collectives over gloo.

The same messages as ``mpi_link.MpiLink`` (commands, reports, aborts, Data writes,
by tag), carried by one ZeroMQ socket per leader in a star: the controller's
ROUTER, bound where ``SYNK_LISTEN`` says, and each node master's DEALER,
which names itself by a routing id drawn at random when it joins and never
used again (a machine that was dropped cannot come back under it).  Messages
are queued per (machine, tag) as they arrive, so a probe, a receive and a
bounded wait look as they do over MPI.  Messages from a routing id the
controller does not know go to the door (elastic/door.py), which admits
only node masters that prove the job's secret; nothing of theirs is
unpickled before that.  The leaders' collectives are gloo's
(``comm.gloo_leaders.GlooLeaders``).
"""

import collections
import struct

import zmq

from ...errors import MachineLostError, SynkError
from ..launch import mark_finished
from ..link import CMD, INBAND_BYTES, LinkBase

TAG = struct.Struct("q")
# Besides link.CMD .. link.DONE (1-5): the door's handshake and the membership's changes.
HELLO, NONCE, PROOF, WELCOME, MEMBERS, ACK, GONE = range(10, 17)


class ZmqLink(LinkBase):
    """This leader's messages to and from the other machines' leaders, over ZeroMQ.

    Args:
        sock: the controller's ROUTER or a node master's DEALER (connected).
        layout: the run's ``Layout``.
        node: this leader's machine.
        spin_s: how long waits spin before sleeping.
        leaders: the leaders' collectives (``GlooLeaders``).
        idents: the controller's: each machine's routing id (machine 0: None).
    """

    MPI = None

    def __init__(self, sock, layout, node, spin_s, leaders, idents=None):
        self.sock = sock
        self.layout = layout
        self.node = node
        self.spin_s = spin_s
        self.leaders = leaders
        self.idents = list(idents or [None])
        self.index = {ident: m for m, ident in enumerate(self.idents) if ident is not None}
        self.others = [m for m in range(layout.n_machines) if m != node] if node == 0 else [0]
        self.seq = 0
        self.inbox = collections.defaultdict(collections.deque)  # (machine, tag) -> frames
        self.pool = {}
        self.sends = []        # trackers of large messages sent without a copy
        self.orphans = []
        self.members = None    # the membership (door.Door or join.Follower)

    # -- the carrier ---------------------------------------------------------------------
    def drain(self):
        """Queue every message that has arrived (strangers' go to the door)."""
        sock = self.sock
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if self.node == 0:
                ident, frames = frames[0].bytes, frames[1:]
                src = self.index.get(ident)
                if src is None:
                    if self.members is not None:
                        self.members.stranger(ident, frames)
                    continue
            else:
                src = 0
            if len(frames) != 2 or len(frames[0]) != TAG.size:
                continue
            self.inbox[(src, TAG.unpack(frames[0].bytes)[0])].append(frames[1])

    def send_to(self, ident, tag, buf):
        """Send ``buf`` with ``tag`` to the peer with routing id ``ident`` (the controller's door)."""
        self.sock.send_multipart([ident, TAG.pack(tag), buf])

    def send_bytes(self, dest, tag, buf):
        """Send ``buf`` to machine ``dest`` (large buffers without a copy, tracked until sent)."""
        big = memoryview(buf).nbytes >= INBAND_BYTES
        frames = [TAG.pack(tag), buf]
        if self.node == 0:
            ident = self.idents[dest] if dest < len(self.idents) else None
            if ident is None:
                raise SynkError(f"no machine {dest} to send to")
            frames.insert(0, ident)
        tracker = self.sock.send_multipart(frames, copy=not big, track=big)
        if big:
            self.sends.append(tracker)

    def probe(self, src, tag):
        """Return (message, size in bytes) if one from ``src`` with ``tag`` has arrived, else None."""
        q = self.inbox.get((src, tag))
        if not q:
            self.drain()
            q = self.inbox.get((src, tag))
            if not q:
                return None
        if tag == CMD and self.inbox.get((0, MEMBERS)):
            return None  # a command sent before the machines regrouped: the wait's check goes first
        return q[0], len(q[0].buffer)

    def receive(self, message, buf, src):
        """Take a probed ``message`` from machine ``src`` into ``buf``."""
        for (m, _), q in self.inbox.items():
            if m == src and q and q[0] is message:
                q.popleft()
                break
        memoryview(buf).cast("B")[:] = message.buffer

    def take(self, src, tag):
        """The bytes of the next message from ``src`` with ``tag`` (probed already), or None."""
        got = self.probe(src, tag)
        if got is None:
            return None
        self.inbox[(src, tag)].popleft()
        return got[0].bytes

    def forget(self, keep=()):
        """Drop every queued message but those with a tag in ``keep`` (the machines regrouped)."""
        for key in list(self.inbox):
            if key[1] not in keep:
                del self.inbox[key]

    def complete_sends(self, check):
        """Wait until every large message so far has left (its buffer may be reused)."""
        if self.sends:
            self.wait(lambda: all(t.done for t in self.sends), check)
            self.sends.clear()

    def retire_sends(self):
        """Stop waiting for messages a command left unsent (kept until ZeroMQ lets them go)."""
        self.orphans = [t for t in self.orphans + self.sends if not t.done]
        self.sends = []

    def begin(self, seq):
        """Start command ``seq`` (its reports carry the number)."""
        self.seq = seq

    def renew(self, gen):
        """A command aborted before: every leader builds a fresh gloo group (generation ``gen``)."""
        self.leaders.renew(None, gen)

    def lost(self, exc, machine=None):
        """The MachineLostError for a failed collective (the controller's heartbeats name the machine)."""
        machines = [] if machine is None else [machine]
        where = self.layout.describe(machine) if machine is not None else "a machine"
        return MachineLostError(f"{where}: lost ({exc})".splitlines()[0],
                                self.layout.offsets[machine or 0], machines)

    def survives(self):
        """Whether the run goes on after losing a machine (unless SYNK_ON_MACHINE_LOSS=end)."""
        return self.members is not None and self.members.survives

    def shrink(self, done_seq, lost=None):
        """Go on with the machines the controller keeps; return (survivors, each one's done_seq)."""
        return self.members.regroup_after_loss(done_seq, lost)

    def news(self):
        """Node master: whether the controller regrouped the machines (MEMBERS queued)."""
        if self.node == 0:
            return False
        self.drain()
        if self.inbox.get((0, GONE)):
            raise SynkError("the controller dropped this machine (lost or cut off before); "
                            "it ends itself")
        return bool(self.inbox.get((0, MEMBERS)))

    def rebind(self, layout, node, idents=None):
        """Go on as machine ``node`` of ``layout`` (the controller: with routing ids ``idents``)."""
        self.layout = layout
        self.node = node
        if idents is not None:
            self.idents = list(idents)
            self.index = {ident: m for m, ident in enumerate(self.idents) if ident is not None}
            self.others = list(range(1, layout.n_machines))
        self.pool.clear()

    def finish(self):
        """At this process's end: close the socket (nothing waits for unsent messages)."""
        mark_finished()
        if self.leaders is not None:
            self.leaders.close()
        try:
            self.sock.close(linger=0)
        except zmq.ZMQError:
            pass
