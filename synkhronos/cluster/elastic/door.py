"""Machines that come and go: the controller's door, a node master's join, and regrouping.

No launcher holds every machine's fate here.  The controller runs with
``SYNK_LISTEN=[HOST:]PORT``; each node master is started on its own (ssh, a
scheduler, a container, by hand) with ``SYNK_JOIN=HOST:PORT``, both with the
job's secret (``SYNK_SECRET`` or ``SYNK_SECRET_FILE``).  A node master knocks
(HELLO), gets a fresh challenge (NONCE) and answers with an HMAC of it under
the secret (PROOF), as sentinels do; nothing it sends is unpickled before.
The controller admits it at a command boundary (the next public call, or
``fork()`` waiting for ``SYNK_MACHINES``): WELCOME (its machine number, the
store's and the liveness port's), its sentinel proves itself on the liveness
port, then it catches up on its own (every function with the shared
variables' current values, every replicated Data), and only then do all
machines regroup (MEMBERS, each answers ACK): a new gloo group, the ranks
renumbered.  A lost machine (its sentinel's connection closed, or silent
for ``SYNK_HEARTBEAT_S``) is dropped the same way, and its routing id is
banned: if it comes back it is told GONE and ends itself.  Between the
program's calls the door is served by a thread of its own (knocks answered,
a lost machine dropped at once).  The knocks themselves: elastic/knocks.py.
"""

import logging
import os
import pickle
import socket
import struct
import threading
import time
from datetime import timedelta

import zmq

from ...comm.gloo_leaders import GROUP_TIMEOUT_S, GlooLeaders, import_torch
from ...errors import MachineLostError, SynkError
from ...functions.distribute import DistributeMsg
from ...inputs.mappings import DataAllocMsg, DataSyncMsg
from ...runtime.commands import Command, encode
from ...runtime.liveness import deadline_check, no_check
from ...runtime.state import holding_calls
from ..controller import Controller
from ..layout import Layout, take_place
from ..link import CMD, CMD_HEAD, DATA, DONE, REPORT
from ..recovery import relayout
from ..heartbeats import Heartbeats
from ..sentinel import CONNECT_TIMEOUT_S
from ..settings import heartbeat_limit_s, join_timeout_s
from .join import Welcome, join_as_node, survives_loss, zmq_socket
from .knocks import Knocks
from .zmq_link import ACK, GONE, MEMBERS, WELCOME, ZmqLink


logger = logging.getLogger(__name__)

DOOR_POLL_S = 0.1   # how often the door's thread answers knocks between calls



# -- the controller ---------------------------------------------------------------------------

def join_elastic(rt, launch, tell_janitor, join_workers, pin):
    """``fork()`` of an elastic cluster: the controller returns the run's size; a node master serves."""
    if launch.rank != 0:
        join_as_node(rt, launch, join_workers, pin)  # never returns
    try:
        controller = _start_controller(rt, launch)
        pin()
        controller.door.wait_for(launch.size)
        controller.door.open()
    except BaseException:
        rt.abandon(rt, "the cluster could not be set up")
        raise
    lay = controller.layout
    logger.info("elastic cluster of %d machines, %d ranks (%s per machine), listening on %s:%d",
                lay.n_machines, lay.n_parallel, ", ".join(map(str, lay.n_local)),
                launch.host or "*", launch.port)
    return lay.n_parallel


def _own_address(host):
    if host and host not in ("0.0.0.0", "*"):
        return socket.gethostbyname(host)
    return socket.gethostbyname(socket.gethostname())


def _start_controller(rt, launch):
    _, dist = import_torch()
    bind = "0.0.0.0" if launch.host in ("", "*") else launch.host
    me = _own_address(launch.host)
    sock = zmq_socket(zmq.Context.instance(), zmq.ROUTER)
    sock.bind(f"tcp://{bind}:{launch.port}")
    store = dist.TCPStore(me, 0, None, True, timeout=timedelta(seconds=GROUP_TIMEOUT_S),
                          wait_for_workers=False)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind((bind, 0))
    listener.listen(16)
    layout = Layout([rt.place.n_local], [socket.gethostname()])
    heartbeats = Heartbeats(layout, launch.secret, drop_silent=True)
    heartbeats.start_beating()
    leaders = GlooLeaders(store, me, rt.config.spin_s, None)
    link = ZmqLink(sock, layout, 0, rt.config.spin_s, leaders)
    leaders.lost = link.lost
    leaders.regroup(0, 1, 0, 0, no_check)
    controller = take_place(rt, link, lambda: Controller(rt, link, heartbeats, [os.getpid()]))
    controller.door = link.members = Door(rt, controller, listener, store, launch.secret)
    return controller


class Door:
    """The controller's side of machines that come and go: admit, catch up, regroup, drop."""

    def __init__(self, rt, controller, listener, store, secret):
        self.rt = rt
        self.controller = controller
        self.link = controller.link
        self.heartbeats = controller.heartbeats
        self.listener = listener
        self.store = store       # kept alive: every leader's gloo groups meet through it
        self.banned = set()      # routing ids of machines dropped: never admitted again
        self.knocks = Knocks(self.link, secret, self.banned)
        self.announced = 0       # joiners in ``knocks.ready`` already logged as waiting
        self._stop = threading.Event()
        self._thread = None
        self.pending_loss = None  # a machine lost between calls: the next call raises this
        self.next_member = 1
        self.members = 0         # membership changes so far
        self.survives = survives_loss()
        self.watchers = []       # callbacks: watcher(event, description, layout)

    # -- knocks on the door (from ZmqLink.drain, for routing ids it does not know) ---------
    def stranger(self, ident, frames):
        self.knocks.stranger(ident, frames)

    # -- the door's thread: knocks answered while the program sits between calls ------------
    def open(self):
        """Start answering knocks between the program's calls (after ``fork()`` returned)."""
        self._thread = threading.Thread(target=self._serve, name="synk-door", daemon=True)
        self._thread.start()

    def stop(self):
        """Stop the door's thread (``close()``); knocks go unanswered from then on."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def _serve(self):
        # Only between public calls: a call holds the lock, and the link is its alone then.
        while not self._stop.wait(DOOR_POLL_S):
            with holding_calls() as mine:
                if not mine or self._stop.is_set() or self.controller.broken or self.rt.closed:
                    continue
                try:
                    self.link.drain()
                    self.knocks.forget_stale()
                    self._watch_losses()
                except Exception:  # noqa: BLE001 - the next call meets the same error itself
                    logger.debug("elastic door: serving knocks failed", exc_info=True)
                    continue
                for joiner in self.knocks.ready[self.announced:]:
                    logger.info("elastic door: a machine (%s, %d ranks) proved it belongs to "
                                "this job; it joins at the program's next synkhronos call",
                                joiner.host, joiner.n_local)
                self.announced = len(self.knocks.ready)

    def wait_for(self, n_machines, timeout_s=None):
        """Admit machines until the run has ``n_machines`` (``fork()`` with ``SYNK_MACHINES``)."""
        timeout_s = timeout_s or join_timeout_s()
        check = deadline_check(timeout_s, f"fork: {n_machines} machines were expected "
                               f"(SYNK_MACHINES) and not all joined within {timeout_s:g} s")
        while self.controller.layout.n_machines < n_machines:
            self.admit()
            check()
            self.heartbeats.read()
            time.sleep(0.005)

    def admit(self):
        """Admit every machine that proved itself since the last boundary."""
        self.link.drain()
        self.announced = 0
        ready = self.knocks.ready
        while ready:
            self._take(ready.pop(0))

    def _take(self, joiner):
        ctl, link, hb = self.controller, self.link, self.heartbeats
        old = ctl.layout
        k = old.n_machines
        member, self.next_member = self.next_member, self.next_member + 1
        full = Layout(old.n_local + [joiner.n_local], old.hosts + [joiner.host])
        link.idents.append(joiner.ident)
        link.index[joiner.ident] = k
        t0 = time.monotonic()
        link.send_bytes(k, WELCOME, pickle.dumps(Welcome(
            member, k, full.n_local, full.hosts, self.store.port, self.listener.getsockname()[1],
            ctl.gen, self.members)))
        try:
            hb.layout = full
            hb.accept(self.listener, 0, CONNECT_TIMEOUT_S, expected={member: k})
            self._catch_up(k)
        except (SynkError, MachineLostError) as exc:
            logger.warning("%s did not join: %s", full.describe(k), exc)
            link.idents.pop()
            link.index.pop(joiner.ident, None)
            self.banned.add(joiner.ident)
            link.send_to(joiner.ident, GONE, b"")
            hb.keep(list(range(k)), old)
            return
        self.regroup(list(range(k + 1)), full, here=True)
        ctl.pids.append(joiner.pid)
        logger.info("%s joined in %.2f s", ctl.layout.describe(k), time.monotonic() - t0)
        self.tell("joined", ctl.layout.describe(k))

    def _catch_up(self, k):
        """Machine ``k`` gets what the others hold: functions and shared values, replicated Data."""
        rt = self.rt
        if rt.registry.distributed:
            # Made now: the shared variables travel with the controller's current values.
            self._private(k, Command.DISTRIBUTE,
                          DistributeMsg.of(rt.registry.functions, rt.registry.shareds))
        for data in list(rt.registry.datas.values()):
            replica = data.replica()
            if replica is None:
                continue  # produced where it is used: made again on the new layout when used
            data_id, seg = replica
            self._private(k, Command.DATA_ALLOC, DataAllocMsg(data_id, seg.name, seg.nbytes))
            self._private(k, Command.DATA_SYNC, DataSyncMsg(data_id, 0, seg.nbytes),
                          memoryview(seg.buffer)[:seg.nbytes])

    def _private(self, k, cmd, payload, attachment=None):
        """Run ``cmd`` on machine ``k`` alone (it is not in the run yet); raise if it failed."""
        ctl, link = self.controller, self.link
        ctl.seq += 1
        link.begin(ctl.seq)
        self.heartbeats.ring([k])  # a joiner between two of these waits on its doorbell
        link.send_bytes(k, CMD, CMD_HEAD.pack(ctl.seq, ctl.gen) + encode(cmd, payload))
        if attachment is not None:
            link.send_bytes(k, DATA, attachment)
        late = deadline_check(CONNECT_TIMEOUT_S, f"machine {k} did not catch up on "
                              f"{cmd.name.lower()} within {CONNECT_TIMEOUT_S:g} s")

        def check():
            late()
            self.heartbeats.read()
        box = []
        link.wait(lambda: bool(box) or _report(link, k, box), check)
        rep = box[0]
        if rep is not None and (rep.failures or rep.died):
            raise SynkError(f"{cmd.name.lower()} failed there: "
                            f"{rep.died or rep.failures[0][1]}")
        link.complete_sends(check)

    def _watch_losses(self):
        """Drop a machine lost while the program sits between calls, at once.

        ``synk.layout()`` and the ``on_machines`` callbacks (called from this
        thread) see it now; the next call that drives the ranks raises the
        MachineLostError, with ``completed=False``: it did not run.
        """
        if not self.survives or self.pending_loss is not None:
            return
        try:
            self.heartbeats.read()
        except MachineLostError as exc:
            err = self.controller.go_on(exc)
            self.pending_loss = err.settled(False, "found between two calls: this call did not "
                                                   "run; make it again")
            logger.warning("%s", err)

    # -- membership changes ----------------------------------------------------------------
    def regroup(self, keep, full, here):
        """Go on with machines ``keep`` of layout ``full`` (old numbers, this one first).

        Every machine kept is told its new number and answers with the last
        command it finished; then all build a new gloo group.  ``here``:
        renumber this machine's ranks too (a loss: ``Controller.go_on`` does).
        Returns each kept machine's last finished command.
        """
        ctl, link = self.controller, self.link
        self.members += 1
        new = Layout([full.n_local[m] for m in keep], [full.hosts[m] for m in keep],
                     generation=self.members)
        for i, m in enumerate(keep[1:], 1):
            link.send_bytes(m, MEMBERS, pickle.dumps((self.members, ctl.gen, i, new.n_local,
                                                      new.hosts)))
        done = {0: ctl.local_done}
        late = deadline_check(GROUP_TIMEOUT_S, f"the {len(keep)} machines left did not answer "
                              f"within {GROUP_TIMEOUT_S:g} s (another was lost meanwhile?)")

        def answered():
            for m in keep[1:]:
                got = None if m in done else link.take(m, ACK)
                if got is not None:
                    done[m] = struct.unpack("q", got)[0]
            return len(done) == len(keep)
        link.wait(answered, late)
        link.rebind(new, 0, [link.idents[m] for m in keep])
        link.forget()  # what an aborted command left queued
        ctl.layout = new
        link.leaders.regroup(0, new.n_machines, self.members, ctl.gen, late)
        if here:
            self.heartbeats.keep(keep, new)
            relayout(self.rt, new, 0)
        return [done[m] for m in keep]

    def regroup_after_loss(self, done_seq, lost):
        """``Controller.go_on``'s shrink: drop ``lost`` (or whom the heartbeats name); regroup."""
        if not lost:
            lost = self._named_loss()
        for m in lost:
            self.banned.add(self.link.idents[m])
            self.link.send_bytes(m, GONE, b"")
        before = self.link.layout
        keep = [m for m in range(before.n_machines) if m not in lost]
        return keep, self.regroup(keep, before, here=False)

    def _named_loss(self):
        """A collective failed before a heartbeat told which machine went: wait for one to."""
        deadline = time.monotonic() + heartbeat_limit_s() + 1.0
        while time.monotonic() < deadline:
            try:
                self.heartbeats.read()
            except MachineLostError as exc:
                return exc.machines
            time.sleep(0.01)
        raise SynkError("a collective between machines failed, and no machine is lost")

    def tell(self, event, what):
        """Call the program's ``synk.on_machines`` callbacks (after the change is made)."""
        for watcher in list(self.watchers):
            try:
                watcher(event, what, self.controller.layout)
            except Exception:  # noqa: BLE001 - a user's callback must not break the run
                logger.exception("a synk.on_machines callback raised")


def _report(link, k, box):
    """Take machine ``k``'s report of a private command, if in (None for plain success)."""
    if link.take(k, DONE) is not None:
        box.append(None)
        return True
    got = link.probe(k, REPORT)
    if got is None:
        return False
    head = bytearray(got[1])
    link.receive(got[0], head, k)
    box.append(link.rest(k, REPORT, head, no_check, pooled=False))
    return True
