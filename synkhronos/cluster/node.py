"""The node master: a cluster machine's leader, serving the controller's commands until QUIT.

It receives each command's bytes from the controller, runs the command's
``node`` step if it declares one (runtime/commands.py), posts it to its ranks and
runs its own share as a master does, then sends one report (none where a
small all-reduce's ballot made it implied, comm/mpi_small.py).  It holds this
machine's copy of every Data (the segments its ranks map).
"""

import logging
import os
import signal
import struct
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from ..runtime.control import DECODE_CACHE_BYTES, DECODE_CACHE_SIZE
from ..runtime.commands import COMMANDS, decode
from ..runtime.run import run_command
from ..errors import rank_header
from ..errors import (CommAborted, MachineLostError, WorkerDiedError, WorkerError, describe_error,
                      pickle_exception)
from ..runtime.liveness import no_check, stop_process
from ..runtime.shmem import SharedArray
from ..runtime.peers import Peers
from . import recovery
from .launch import exit_finalized
from .link import ABORT, CMD, CMD_HEAD, DATA, DONE, OUTPUTS, REPORT
from .reports import NodeReport, pack_outputs

if TYPE_CHECKING:
    from .layout import Layout
    from .link import LinkBase

logger = logging.getLogger(__name__)

FINALIZE_S = 10
ENDED_FINALIZE_S = 2.0  # after the sentinel ended this machine (its grace is END_GRACE_S, 3 s)


@runtime_checkable
class NodeSide(Protocol):
    """The node master's side: what the rest of the library may use of a node master.

    A command's ``node`` step (``runtime.commands.CommandSpec.node``) gets the
    node master as its ``machine`` and may use its first group (where it is,
    this machine's copies of the controller's Data); ``serve`` drives the
    second.  ``NodeMaster`` implements it (checked by tests/cluster/test_link.py),
    and as ``rt.peers`` on its machine it is a ``runtime.peers.Peers`` too.
    """

    # What a command's node step uses.
    layout: "Layout"
    node: int                   # this machine's number in ``layout``
    segments: dict              # data id -> this machine's copy of that Data (a SharedArray)

    def make_segment(self, data_id, nbytes):
        """Make this machine's memory for Data ``data_id``; return its segment name."""

    def free_segments(self, ids):
        """Free this machine's copies of Data objects ``ids``."""

    def receive_segment(self, data_id, offset, nbytes):
        """Receive ``nbytes`` written to Data ``data_id`` at byte ``offset`` from the controller."""

    # What the serve loop uses.
    link: "LinkBase"
    sentinel: int               # the pid of this machine's sentinel process
    done_seq: int               # the last command this machine finished

    def receive_command(self, check):
        """Wait for the controller's next command; return its bytes (its head taken off)."""

    def decode(self, raw):
        """Return (command, payload, ids of dropped Data or None) of a command's bytes."""

    def poll(self):
        """The check while waiting: raise on an abort order or a membership change."""

    def report(self, failures, contributions, died=None):
        """Send the command's outcome to the controller."""

    def go_on(self):
        """Go on with the machines left after a loss: shrink, renumber this machine's ranks."""


class _Ended(BaseException):
    """This machine's ranks died: stop serving."""


class NodeMaster(Peers):
    """One machine's leader in a cluster (``NodeSide``), and the ``Peers`` its commands see.

    Args:
        rt: the Runtime (this process is its machine's leader).
        link: the ``link.LinkBase`` to the controller and the other node masters.
        sentinel: the pid of this machine's sentinel process.
        doorbell: what the controller rings, through the sentinel, before a command that
            follows a pause (``doorbell.Doorbell``), or None.
    """

    def __init__(self, rt, link, sentinel, doorbell=None):
        self.rt = rt
        self.link = link
        self.layout = link.layout
        self.node = link.node
        self.sentinel = sentinel
        self.doorbell = doorbell
        self.segments = {}     # data id -> this machine's copy of that Data
        self.done_seq = 0      # the last command this machine finished
        self.decoded = {}      # a command's bytes -> (command, payload), see ``decode``

    # -- messages from and to the controller ------------------------------------------
    def receive_command(self, check):
        """Wait for the controller's next command; return its bytes.

        After spinning a while this blocks on the doorbell, which the
        controller rings before a command that follows a pause.
        """
        buf = self.link.recv_bytes(0, CMD, check, doorbell=self.doorbell)
        seq, gen = CMD_HEAD.unpack_from(buf)
        self.link.begin(seq)
        if gen != self.link.leaders.gen:
            # A command before aborted: every leader renews the collective communicator here.
            self.link.renew(gen)
        return memoryview(buf)[CMD_HEAD.size:]

    def decode(self, raw):
        """Return (command, payload, ids of dropped Data or None) of a command's bytes.

        A loop sends the same few commands again and again: a dict look-up of
        their bytes costs a tenth of unpickling them.  Handlers never change
        a payload, so a decoded one is reused (as ``Control.read_message`` does).
        """
        if len(raw) > DECODE_CACHE_BYTES:
            return decode(raw)
        key = bytes(raw)
        hit = self.decoded.get(key)
        if hit is not None:
            return hit
        out = decode(raw)
        if out[2] is None:
            if len(self.decoded) >= DECODE_CACHE_SIZE:
                self.decoded.clear()
            self.decoded[key] = out
        return out

    def go_on(self):
        """Go on with the machines left: shrink to them and renumber this machine's ranks."""
        self.link.shrink(self.done_seq)
        self.layout = self.link.layout
        self.node = self.link.node
        recovery.relayout(self.rt, self.layout, self.node)

    def survive(self, rt, exc, seq, leader_ok):
        """A node master's side of a lost machine in command ``seq``: its ranks leave the command.

        Returns ``exc`` (the serve loop then shrinks) where the run goes on, else None.
        """
        if not isinstance(exc, MachineLostError) or not self.link.survives():
            return None
        if recovery.settle_local(rt, seq, leader_ok):
            self.done_seq = self.link.seq  # this machine's share was made: the controller asks
        return exc

    def poll(self):
        """The check while this node master waits: an abort order, or the machines regrouped."""
        if self.link.news():
            raise MachineLostError("the controller regrouped the machines", self.rt.place.rank)
        got = self.link.probe(0, ABORT)
        if got is None:
            return
        buf = bytearray(8)
        self.link.receive(got[0], buf, 0)
        control = self.rt.control
        if struct.unpack("q", buf)[0] == self.link.seq:
            control.abort(control.current)

    def report(self, failures, contributions, died=None):
        """Send the command's outcome to the controller."""
        link = self.link
        if not failures and died is None:
            if not contributions:
                link.send_bytes(0, DONE, struct.pack("q", link.seq))  # 8 bytes, nothing to unpickle
                return
            try:
                packed = pack_outputs(link.seq, contributions)
            except (struct.error, TypeError, ValueError):
                packed = None  # a weight or shape struct does not take: pickled below
            if packed is not None:
                link.send_bytes(0, OUTPUTS, packed)
                return
        link.send(0, REPORT, NodeReport(link.seq, failures, contributions, died))

    # -- this machine's copies of the controller's Data --------------------------------
    def make_segment(self, data_id, nbytes):
        """Make this machine's memory for Data ``data_id``; return its segment name."""
        self.free_segments([data_id])
        seg = SharedArray(self.rt.segment_name(f"d{data_id}"), nbytes)
        self.segments[data_id] = seg
        return seg.name

    def free_segments(self, ids):
        """Free this machine's copies of Data objects ``ids``."""
        for data_id in ids:
            seg = self.segments.pop(data_id, None)
            if seg is not None:
                seg.unlink()
                seg.close()

    def receive_segment(self, data_id, offset, nbytes):
        """Receive ``nbytes`` written to Data ``data_id`` at byte ``offset`` from the controller."""
        view = memoryview(self.segments[data_id].buffer)[offset:offset + nbytes]
        self.link.recv_into(0, DATA, view, self.rt.check)


def serve(rt, node, join_workers):
    """A node master's life after ``fork()``: run the controller's commands until the last.

    ``join_workers(rt)`` ends the machine's workers after it (process.py).
    Never returns: the process ends through ``exit_finalized``.
    """
    link = node.link
    alone = not rt.worker_ranks  # no local workers: nothing to post
    status = 0

    def ended(signum, frame):
        # The sentinel's way to end this machine when the controller has gone:
        # at once, wherever Python is (an exception could land in a callback
        # that swallows it), and with MPI finalised so mpiexec ends the job quietly.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if not rt.closed:
            rt.abandon(rt, "the controller ended the job")
        # A controller that went silent cannot take part in MPI_Finalize: bounded, and
        # SIGALRM's default action ends this process past the bound.
        signal.setitimer(signal.ITIMER_REAL, ENDED_FINALIZE_S)
        link.finish()
        exit_finalized(0)
    def silent(signum, frame):
        # The sentinel's way to end this machine when the controller stopped answering
        # (cut off, stopped): MPI_Finalize would wait for it, so none.
        signal.signal(signal.SIGUSR2, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if not rt.closed:
            rt.abandon(rt, "the controller stopped answering")
        os._exit(1)
    signal.signal(signal.SIGTERM, ended)
    signal.signal(signal.SIGUSR2, silent)
    going_on = link.survives()
    try:
        while True:
            try:
                if _serve_one(rt, node, alone, going_on):
                    break
            except MachineLostError:
                # Another machine was lost and the run goes on: with the machines left.
                if not going_on:
                    raise
                node.go_on()
    except _Ended:
        status = 1
    except BaseException as exc:  # noqa: BLE001 - the controller sees the heartbeat stop
        logger.error("node master %d failed: %r", node.node, exc)
        status = 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if status != 0 and going_on:
            # The others go on without this machine, and shrink only once MPI sees this
            # process fail: at once, by a signal (PRRTE reports an exit, even without
            # MPI_Finalize, as no failure). Its workers, janitor and sentinel follow it.
            os.kill(os.getpid(), signal.SIGKILL)
        if status != 0:
            # The controller must learn at once that this machine is gone, not by
            # heartbeats that would go on while MPI_Finalize below waits.
            stop_process(node.sentinel, reap=True)
        if not rt.closed:
            if status == 0:
                join_workers(rt)
            else:
                rt.abandon(rt, "the controller ended the job")
        # Always finalise: mpiexec ends the whole job, the controller too, when a
        # process exits without it.  MPI_Finalize waits for messages still in
        # flight, so it gets a deadline: SIGALRM ends this process past it.
        signal.alarm(FINALIZE_S)
        link.finish()
        exit_finalized(0)


def _serve_one(rt, node, alone, going_on):
    """Take and run the controller's next command; return whether it was the last."""
    link = node.link
    # Between commands nothing runs here, so no command timeout applies: only
    # the controller's orders (and the sentinel, for its death) end the wait.
    raw = node.receive_command(node.poll)
    cmd, payload, frees = node.decode(raw)
    spec = COMMANDS[cmd]
    if spec.final:
        # A normal end: the sentinel must not take the controller's exit,
        # which may come before this process's, for a failure.
        stop_process(node.sentinel, reap=True)
    if frees:
        node.free_segments(frees)
        rt.registry.unmap(frees)
    failures, died, contributions = _run(rt, node, cmd, spec, payload, frees, raw, alone,
                                         going_on)
    node.done_seq = link.seq
    link.retire_sends()  # an aborted collective's sends nobody will receive
    implied = rt.backend.reports_implied()
    if failures or died is not None or spec.collected or not implied:
        # (Where a ballot passed, this machine's share ended with the collective that
        # completed on every machine: the controller takes that as this report.)
        node.report(failures, contributions, died)
    # After a death the machine is torn down; the sentinel still ends this
    # process if the controller goes.
    link.complete_sends(rt.check if died is None else no_check)
    if died is not None:
        raise _Ended()
    return spec.final


def _run(rt, node, cmd, spec, payload, frees, raw, alone, going_on):
    """Run one command on this machine; return (failures, why the ranks died, contributions).

    The ranks get the controller's bytes (``raw``, Data to unmap included) as
    they came, unless the command's node step changed the payload.
    """
    failures, died, contributions = [], None, []
    try:
        wire = raw
        if spec.node is not None:
            payload = spec.node(node, payload)
            if payload is None:
                return failures, died, contributions  # the node master's step was all of it
            wire = None
            if frees:
                rt.registry.freed.extend(frees)  # the payload is encoded anew: they go along
        if alone and not spec.final:
            failures = _run_alone(rt, cmd, spec, payload)
        else:
            run_command(rt, cmd, payload, local=lambda seq: spec.run(rt, payload), wire=wire)
        if spec.collected:
            contributions = rt.backend.node_contributions()
            if spec.combine is not None:
                contributions = spec.combine(rt, payload, contributions)
    except MachineLostError as exc:
        if going_on:
            raise  # another machine's loss (an MPI error): the serve loop goes on without it
        died = str(exc)
    except WorkerDiedError as exc:
        # What closing this machine means is for the controller to say.
        died = str(exc).split("; synkhronos is closed")[0]
    except WorkerError as exc:
        failures = [(r, t, pickle_exception(exc.causes.get(r))) for r, t in exc.failures.items()]
    except CommAborted:
        pass
    except Exception as exc:  # noqa: BLE001 - reported to the controller
        text, raw = describe_error(rank_header(rt.place.rank, rt.place.n_parallel), exc)
        failures = [(rt.place.rank, text, raw)]
    return failures, died, contributions


def _run_alone(rt, cmd, spec, payload):
    """Run a command on a machine whose only rank is its node master; return its failures."""
    control = rt.control
    control.seq += 1
    control.current = control.seq  # what the abort flag is compared with
    rt.backend.begin(control.seq)
    rt.processes.monitor.begin(cmd)
    prof = rt.profiler
    if prof is not None:
        prof.begin(cmd.name.lower())
    try:
        spec.run(rt, payload)
    except (CommAborted, WorkerDiedError):
        raise
    except Exception as exc:  # noqa: BLE001 - reported to the controller
        text, raw = describe_error(rank_header(rt.place.rank, rt.place.n_parallel), exc)
        return [(rt.place.rank, text, raw)]
    finally:
        if prof is not None and rt.profiler is prof:
            prof.end("collective")  # what the handler did not book itself
    return []

