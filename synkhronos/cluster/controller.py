"""The controller's side of a cluster: forward each command to the machines, take their reports.

The controller posts a command to its own ranks as on one machine and sends
the same bytes to every node master (``forward``), which posts it to its
ranks and runs its own share; every node master then sends one report (its
ranks' failures, and what they contributed to the call's outputs), and the
controller's command ends when its own ranks and every report are in.  A
small all_reduce on machines of one rank needs none: the ballot it carries
(comm/mpi_small.py) says that every machine's share ended with it.
"""

import struct
import time

from ..errors import MachineLostError, SynkError, WorkerDiedError, unpickle_exception
from ..runtime.commands import COMMANDS, encode
from ..runtime.peers import Peers
from .launch import end_launcher_at_exit, end_step_at_exit
from .doorbell import QUIET_S
from .link import ABORT, CMD, CMD_HEAD, DATA, DONE, OUTPUTS, REPORT, REPORTS
from .recovery import relayout, settle_local
from .reports import DONE_REPORT, unpack_outputs


# Public calls that only read the run's state: a loss found between calls is raised by the
# next call that drives the ranks, not by these.
PASSIVE_CALLS = frozenset({"layout", "on_machines", "close"})


class Controller(Peers):
    """The controller's view of the other machines: the ``Peers`` of a cluster's one program.

    Args:
        rt: the controller's Runtime (its control block, its ranks' liveness, abandon).
        link: the ``link.LinkBase`` to the node masters (``MpiLink``, ``ZmqLink``).
        heartbeats: the sentinels' connections (``Heartbeats``).
        pids: each machine's node master pid (machine 0: the controller).
    """

    copies = True  # every machine holds every (replicated) Data
    door = None    # where machines come and go: cluster/elastic/door.Door

    def __init__(self, rt, link, heartbeats, pids):
        self.rt = rt
        self.link = link
        self.layout = link.layout
        self.heartbeats = heartbeats
        self.pids = pids
        self.seq = 0           # commands forwarded so far
        self.reports = {}      # machine -> NodeReport of the current command
        self.pending = False   # reports of the current command still to take
        self.failed = False    # a machine reported a failure in this command
        self.control = rt.control  # the local control block (its abort flag)
        self.broken = False    # a machine failed: MPI is not used again (nor finalised)
        self.local_done = 0    # the last command this machine's own ranks finished
        self.survivors, self.done = [], []  # after a loss: machines left, what each finished
        # The leaders' collective communicator: one generation more after every command
        # that aborted, sent with the next command so every leader renews it there.
        self.gen = 0
        self.node_only = False  # the current command runs on the node masters only
        self.collected = False  # the current command's ranks leave results (reports carry them)
        self.quiet_since = 0.0  # when the last command's reports were in (perf_counter)

    def between(self, name=None):
        """Before public call ``name``: admit the machines that asked to join (cluster/elastic/door.py).

        A machine lost while the program sat between calls was dropped then (the
        door's thread); the first call that drives the ranks raises that loss.
        """
        if self.door is not None and not self.broken:
            self.door.admit()
            if self.door.pending_loss is not None and name not in PASSIVE_CALLS:
                err, self.door.pending_loss = self.door.pending_loss, None
                raise err

    def watch(self, callback):
        """Call ``callback(event, machine, layout)`` when machines join or are lost."""
        if self.door is not None:
            self.door.watchers.append(callback)

    def forward(self, cmd, data):
        """Send a posted command's bytes to every node master (unless it stays on this machine)."""
        if COMMANDS[cmd].local:
            return
        link = self.link
        self.seq += 1
        self.collected = COMMANDS[cmd].collected
        link.begin(self.seq)
        # Node masters stop their sentinels on the final command: a closed connection then means no failure.
        self.heartbeats.quitting = COMMANDS[cmd].final
        self.reports = {}
        self.failed = False
        if link.leaders.gen != self.gen:
            link.renew(self.gen)
        msg = CMD_HEAD.pack(self.seq, self.gen) + bytes(data)
        if time.perf_counter() - self.quiet_since > QUIET_S:
            # The node masters may have stopped spinning: wake them while the message travels.
            self.heartbeats.ring(link.others)
        for m in link.others:
            link.send_bytes(m, CMD, msg)
        self.pending = True

    def finish(self, check):
        """After this machine's end barrier: wait for every node master's report (``wait_reports``)."""
        if not self.pending:
            return None
        self.local_done = self.seq  # a machine lost now finds this one's share made
        if self.rt.backend.reports_implied() and not self.collected:
            # Every machine's share ended with the collective that just completed, whose
            # ballot said so (comm/mpi_small.py): their success is implied, no report comes.
            self.pending = False
            self.reports = dict.fromkeys(self.link.others, DONE_REPORT)
            self.link.retire_sends()
            self.quiet_since = time.perf_counter()
            return {}
        return self.wait_reports(check)

    def mirror(self, cmd, payload, attachment):
        """Run ``cmd`` on the node masters only, ``attachment`` after it (``send_command``).

        A lost machine ends the run here unless the run goes on (then every
        machine left got the bytes).
        """
        try:
            self.send_command(cmd, payload, attachment, self.rt.check)
        except WorkerDiedError as exc:
            if not getattr(exc, "survived", False):
                self.rt.abandon(self.rt, "a machine died while Data was mirrored")
            raise

    def send_data(self, machine, buffer):
        """Send ``buffer`` to ``machine`` as data of the command in flight (its node step receives it)."""
        self.link.send_bytes(machine, DATA, buffer)

    def wait_reports(self, check):
        """Wait for every node master's report; return {rank: (text, exc)} failures.

        Node masters' contributions to the call's outputs are kept for
        ``contributions()``.  Raises WorkerDiedError if a machine died.
        """
        if not self.pending:
            return None
        control = self.control
        if not (self.failed or self.node_only) and control is not None and control.aborted_now():
            # This machine's share aborted: the others may wait for it inside a collective.
            self._abort_others()
        self.link.wait(self._all_reported, check)
        self.quiet_since = time.perf_counter()
        self.pending = False
        if self.failed:
            self.gen += 1  # a collective may have been left pending on some leader
        self.link.retire_sends()
        failures = {}
        died = None
        for m in self.link.others:
            rep = self.reports[m]
            if rep.died is not None and died is None:
                died = (m, rep.died)
            for rank, text, exc_bytes in rep.failures:
                failures[rank] = (text, unpickle_exception(exc_bytes))
        if died is not None:
            m, text = died
            raise MachineLostError(f"{self.layout.describe(m)}: {text}", self.layout.offsets[m], [m])
        return failures

    def _all_reported(self):
        """Take the reports that have arrived; return whether every machine's is in."""
        link = self.link
        reports = self.reports
        done = True
        for m in link.others:
            if m in reports:
                continue
            got = link.probe_any(m, REPORTS)
            if got is None:
                done = False
                continue
            probed, n, tag = got
            if tag == DONE:
                buf = bytearray(8)
                link.receive(probed, buf, m)
                self._check_seq(m, struct.unpack("q", buf)[0])
                reports[m] = DONE_REPORT
            elif tag == OUTPUTS:
                buf = bytearray(n)
                link.receive(probed, buf, m)
                rep = unpack_outputs(buf)
                self._check_seq(m, rep.seq)
                reports[m] = rep
            else:
                self._take_report(m, probed, n)
        return done

    def _check_seq(self, m, seq):
        if seq != self.seq:
            raise SynkError(f"{self.layout.describe(m)} reported command {seq} "
                            f"while the controller ran {self.seq}")

    def _take_report(self, m, probed, n):
        head = bytearray(n)
        self.link.receive(probed, head, m)
        # Contributions are kept until the call's results are combined: not pooled.
        rep = self.link.rest(m, REPORT, head, self.heartbeats.read, pooled=False)
        self._check_seq(m, rep.seq)
        self.reports[m] = rep
        if (rep.failures or rep.died) and not self.failed:
            # The other machines may wait for this one inside a collective.
            self._abort_others()
            if self.control is not None:
                self.control.abort(self.control.current)

    def _abort_others(self):
        """Order the machines whose report is not in to abort this command."""
        self.failed = True
        msg = struct.pack("q", self.seq)
        for q in self.link.others:
            if q not in self.reports:
                self.link.send_bytes(q, ABORT, msg)

    def late_ranks(self):
        """The ranks of the machines whose report of this command is not in."""
        if not self.pending:
            return []
        return [r for m in self.link.others if m not in self.reports
                for r in self.layout.ranks(m)]

    def contributions(self):
        """{global rank: (arrays, weight)} the other machines' ranks contributed."""
        out = {}
        for rep in self.reports.values():
            for rank, arrays, weight in rep.contributions:
                out[rank] = (arrays, weight)
        return out

    def poll(self):
        """The check while the controller waits: heartbeats, and reports that carry failures."""
        if self.pending:
            self._all_reported()
        try:
            self.heartbeats.read()
        except MachineLostError as exc:
            # A machine whose ranks died reports why before its node master goes: say that.
            m = exc.machines[0]
            rep = self.reports.get(m)
            if rep is None or rep.died is None:
                raise
            raise MachineLostError(f"{self.layout.describe(m)}: {rep.died}", exc.rank,
                                   exc.machines) from None

    def send_command(self, cmd, payload, attachment, check):
        """Run ``cmd`` on the node masters only, sending ``attachment`` (bytes) after it.

        What the node masters do with it is the command's ``node`` step
        (runtime/commands.py); here, e.g., writes to a Data reach the machines' copies.
        If a machine is lost meanwhile and the run goes on, the command runs
        again on the machines left (each then holds what it sent) before the
        MachineLostError is raised.
        """
        try:
            self._send_command(cmd, payload, attachment, check)
        except MachineLostError as exc:
            if not self.link.survives():
                raise
            lost = self.go_on(exc)
            self._send_command(cmd, payload, attachment, check)
            raise lost.settled(True, "what was sent reached every machine left") from exc

    def _send_command(self, cmd, payload, attachment, check):
        self.forward(cmd, encode(cmd, payload))
        for m in self.link.others:
            self.link.send_bytes(m, DATA, attachment)
        self.node_only = True  # this machine's control block still shows the last command
        try:
            failures = self.wait_reports(check)
        finally:
            self.node_only = False
        if failures:
            raise SynkError(f"{cmd.name.lower()} failed: "
                            + "; ".join(t for t, _ in failures.values()))

    def survive(self, rt, exc, seq, leader_ok):
        """The controller's side of a machine lost in command ``seq``: the error to raise.

        Its own ranks leave the command first; then, where the run goes on
        (``recovery.going_on``), the survivors shrink to a new layout.
        Returns the error for the user: a MachineLostError saying whether the
        run goes on.  Where it does not, the caller ends the run.
        """
        if not isinstance(exc, MachineLostError):
            return None
        if not self.link.survives():
            exc.args = (f"{exc}; the run is ended (it goes on only under Open MPI with ULFM, "
                        "mpirun --with-ft ulfm, or with machines that come and go, "
                        "SYNK_LISTEN; unless SYNK_ON_MACHINE_LOSS=end)",)
            return None
        if settle_local(rt, seq, leader_ok):
            self.local_done = self.seq
        err = self.go_on(exc)
        return err.settled(*_outcome(self.done, self.seq, self.survivors))

    def go_on(self, exc):
        """Shrink to the machines left, renumber every rank; return the error for the user."""
        rt = self.rt
        before = self.layout
        survivors, done = self.link.shrink(self.local_done, getattr(exc, "machines", None))
        lost = [m for m in range(before.n_machines) if m not in survivors]
        self.layout = self.link.layout
        self.heartbeats.keep(survivors, self.layout)
        self.pids = [self.pids[m] for m in survivors]
        self.reports, self.pending, self.failed = {}, False, False
        relayout(rt, self.layout, 0)
        named = "; ".join(before.describe(m) for m in lost) or str(exc)
        self.survivors, self.done = survivors, done
        if self.door is not None:
            for m in lost:
                self.door.tell("lost", before.describe(m))
        return MachineLostError(
            f"{named}: {str(exc).split(': ', 1)[-1]}; the run goes on with "
            f"{self.layout.n_machines} machines and {self.layout.n_parallel} ranks "
            "(synk.layout())", before.offsets[lost[0]] if lost else exc.rank, lost, survived=True)

    def end(self):
        """After a failure: end every machine, without waiting and without MPI.

        Closing the heartbeat connections makes each sentinel stop its node
        master (MPI itself may be broken by now: a send to a dead process can
        abort this one).
        """
        if self.heartbeats.silent is not None and not self.broken:
            # Cut off or stopped: mpiexec would wait for that machine forever.
            end_launcher_at_exit(f"{self.layout.describe(self.heartbeats.silent)} stopped "
                                 "answering")
        elif self.heartbeats.closed and not self.broken:
            # Died: srun cannot learn of it where its whole host went down.
            end_step_at_exit(f"{self.layout.describe(min(self.heartbeats.closed))} died")
        self.heartbeats.close()
        self.broken = True

    def close(self):
        """At the run's end: stop the door and the heartbeats; then MPI ends (the node masters may go)."""
        if self.door is not None:
            self.door.stop()
        self.heartbeats.close()
        if not self.broken:
            # After this mpiexec lets the node masters end; MPI cannot start again here.
            self.link.finish()


def _outcome(done, seq, survivors):
    """Whether the machines left finished command ``seq``: (True/False/None, the words for it)."""
    finished = [m for m, q in zip(survivors, done) if q == seq]
    if len(finished) == len(survivors):
        return True, ("the command finished on every machine left (updates made, outputs lost)")
    if not finished:
        return False, "the command did not happen on the machines left: run it again"
    return None, (f"the command finished on machines {finished} (numbered as before) and not "
                  "on the others: shared variables it updated may differ between ranks")
