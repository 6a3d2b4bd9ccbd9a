"""The controller's side of a cluster: forward each command to the machines, take their reports.

The controller posts a command to its own ranks as on one machine and sends
the same bytes to every node master (``forward``), which posts it to its
ranks and runs its own share; every node master then sends one report (its
ranks' failures, and what they contributed to the call's outputs), and the
controller's command ends when its own ranks and every report are in.
"""

import struct
from typing import NamedTuple, Optional

from ..commands import COMMANDS, encode
from ..errors import SynkError, WorkerDiedError, unpickle_exception
from ..liveness import wait_until
from .link import ABORT, CMD, DATA, DONE, REPORT


class NodeReport(NamedTuple):
    """A node master's outcome of one command.

    Attributes:
        seq: the command's number.
        failures: ``[(global rank, traceback text, pickled exception or None)]``.
        contributions: ``[(global rank, arrays, weight)]`` for collected commands.
        died: why the machine's ranks died, or None.
    """

    seq: Optional[int]
    failures: list
    contributions: list
    died: Optional[str]


DONE_REPORT = NodeReport(None, [], [], None)


class Controller:
    """The controller's view of the other machines.

    Args:
        link: the ``Link`` to the node masters.
        heartbeats: the sentinels' connections (``Heartbeats``).
        pids: each machine's node master pid (machine 0: the controller).
    """

    def __init__(self, link, heartbeats, pids):
        self.link = link
        self.layout = link.layout
        self.heartbeats = heartbeats
        self.pids = pids
        self.seq = 0           # commands forwarded so far
        self.reports = {}      # machine -> NodeReport of the current command
        self.pending = False   # reports of the current command still to take
        self.failed = False    # a machine reported a failure in this command
        self.control = None    # the local control block (its abort flag)
        self.broken = False    # a machine failed: MPI is not used again (nor finalised)

    def forward(self, cmd, data):
        """Send a posted command's bytes to every node master."""
        link = self.link
        self.seq += 1
        link.begin(self.seq)
        # Node masters stop their sentinels on the final command: a closed connection then means no failure.
        self.heartbeats.quitting = COMMANDS[cmd].final
        self.reports = {}
        self.failed = False
        msg = struct.pack("q", self.seq) + bytes(data)
        for m in link.others:
            link.send_bytes(m, CMD, msg)
        self.pending = True

    def wait_reports(self, check):
        """Wait for every node master's report; return {rank: (text, exc)} failures.

        Node masters' contributions to the call's outputs are kept for
        ``contributions()``.  Raises WorkerDiedError if a machine died.
        """
        if not self.pending:
            return None
        wait_until(self._all_reported, check, self.link.spin_s)
        self.pending = False
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
            raise WorkerDiedError(f"{self.layout.describe(m)}: {text}",
                                  self.layout.offsets[m], None)
        return failures

    def _all_reported(self):
        """Take the reports that have arrived; return whether every machine's is in."""
        link = self.link
        done = True
        for m in link.others:
            if m in self.reports:
                continue
            got = link.probe(m, DONE)
            if got is not None:
                buf = bytearray(8)
                link.receive(got[0], buf, m)
                self._check_seq(m, struct.unpack("q", buf)[0])
                self.reports[m] = DONE_REPORT
                continue
            got = link.probe(m, REPORT)
            if got is None:
                done = False
            else:
                self._take_report(m, *got)
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
            self.failed = True
            msg = struct.pack("q", self.seq)
            for q in self.link.others:
                if q not in self.reports:
                    self.link.send_bytes(q, ABORT, msg)
            if self.control is not None:
                self.control.abort(self.control.current)

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
        self.heartbeats.read()
        if self.pending:
            self._all_reported()

    def send_command(self, cmd, payload, attachment, check):
        """Run ``cmd`` on the node masters only, sending ``attachment`` (bytes) after it.

        What the node masters do with it is the command's ``node`` step
        (commands.py); here, e.g., writes to a Data reach the machines' copies.
        """
        self.forward(cmd, encode(cmd, payload))
        for m in self.link.others:
            self.link.send_bytes(m, DATA, attachment)
        failures = self.wait_reports(check)
        if failures:
            raise SynkError(f"{cmd.name.lower()} failed: "
                            + "; ".join(t for t, _ in failures.values()))

    def end(self):
        """After a failure: end every machine, without waiting and without MPI.

        Closing the heartbeat connections makes each sentinel stop its node
        master (MPI itself may be broken by now: a send to a dead process can
        abort this one).
        """
        self.heartbeats.close()
        self.broken = True
