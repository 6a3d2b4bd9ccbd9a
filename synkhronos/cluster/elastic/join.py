"""Machines that come and go: a node master's side (its join, and following the controller).

Started on its own with ``SYNK_JOIN=HOST:PORT`` and the job's secret, a node
master knocks at the controller's door (elastic/door.py), proves it holds
the secret, is welcomed, catches up and serves; at every membership change it
takes the controller's MEMBERS, answers, and builds the new gloo group.  The
messages both sides share are defined here.
"""

import logging
import os
import pickle
import secrets
import socket
import struct
import time
from datetime import timedelta
from typing import NamedTuple

import zmq

from ...comm.gloo_leaders import GROUP_TIMEOUT_S, GlooLeaders, import_torch
from ...errors import SynkError
from ...runtime.liveness import deadline_check, no_check
from ..layout import Layout, take_place
from ..node import NodeMaster, serve
from ..doorbell import Doorbell
from ..auth import mac
from ..sentinel import CONNECT_TIMEOUT_S, send_address, start_sentinel
from ..settings import ends_on_machine_loss, join_timeout_s
from .zmq_link import ACK, GONE, HELLO, MEMBERS, NONCE, PROOF, TAG, WELCOME, ZmqLink

logger = logging.getLogger(__name__)

PROOF_MSG = struct.Struct("32sqq64s")  # HMAC(secret, nonce + routing id), ranks, pid, host name


class Welcome(NamedTuple):
    """WELCOME: what a node master admitted into the run needs first."""

    member: int          # the number its sentinel proves (never reused)
    machine: int         # its machine in ``n_local``/``hosts``
    n_local: list
    hosts: list
    store_port: int
    liveness_port: int
    gen: int
    members: int


def survives_loss():
    return not ends_on_machine_loss()


def zmq_socket(ctx, kind):
    sock = ctx.socket(kind)
    for opt, value in ((zmq.LINGER, 0), (zmq.SNDHWM, 0), (zmq.RCVHWM, 0)):
        sock.setsockopt(opt, value)
    return sock


class Follower:
    """A node master's side of membership changes: the controller decides, it follows."""

    def __init__(self, link):
        self.link = link
        self.survives = survives_loss()

    def stranger(self, ident, frames):
        """Only the controller has a door."""

    def regroup_after_loss(self, done_seq, lost=None):
        """Take the controller's MEMBERS: answer, renumber, build the new gloo group."""
        link = self.link
        link.wait(link.news, deadline_check(
            GROUP_TIMEOUT_S, f"the controller did not regroup the machines within "
            f"{GROUP_TIMEOUT_S:g} s"))
        members, gen, index, n_local, hosts = pickle.loads(link.take(0, MEMBERS))
        link.send_bytes(0, ACK, struct.pack("q", done_seq))
        link.forget(keep=(MEMBERS, GONE))
        link.rebind(Layout(n_local, hosts, generation=members), index)
        link.leaders.regroup(index, len(n_local), members, gen, no_check)
        return None, None


def _route_address(host, port):
    """This machine's address on the way to ``host`` (what the other leaders reach it at)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect((host, port))
        return s.getsockname()[0]
    finally:
        s.close()


def _expect(sock, want, timeout_s, what):
    """The body of the next message with tag ``want`` from the controller (GONE: refused)."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise SynkError(f"fork: the controller did not {what} within {timeout_s:g} s")
        if not sock.poll(min(left, 1.0) * 1000):
            continue
        frames = sock.recv_multipart()
        if len(frames) != 2 or len(frames[0]) != TAG.size:
            continue
        tag = TAG.unpack(frames[0])[0]
        if tag == GONE:
            raise SynkError("fork: the controller refused this machine (a wrong secret, or "
                            "this machine was dropped from the run before)")
        if tag == want:
            return frames[1]


def join_as_node(rt, launch, join_workers, pin):
    """A node master started on its own: knock, prove, catch up, serve until the end."""
    sentinel, sentinel_fd, bell = start_sentinel(close_fds=[rt.processes.janitor.fd])
    try:
        _, dist = import_torch()
        ident = secrets.token_bytes(16)
        sock = zmq_socket(zmq.Context.instance(), zmq.DEALER)
        sock.setsockopt(zmq.ROUTING_ID, ident)
        sock.connect(f"tcp://{launch.host}:{launch.port}")
        logger.info("knocking on the controller at %s:%d", launch.host, launch.port)
        sock.send_multipart([TAG.pack(HELLO), b""])
        nonce = _expect(sock, NONCE, CONNECT_TIMEOUT_S, "answer")
        sock.send_multipart([TAG.pack(PROOF), PROOF_MSG.pack(
            mac(launch.secret, nonce, ident), rt.place.n_local, os.getpid(),
            socket.gethostname().encode()[:64])])
        timeout_s = join_timeout_s()
        welcome = Welcome(*pickle.loads(_expect(sock, WELCOME, timeout_s, "admit this machine")))
        send_address(sentinel_fd, launch.host, welcome.liveness_port, welcome.member,
                     launch.secret, remote=True)
        store = dist.TCPStore(launch.host, welcome.store_port, None, False,
                              timeout=timedelta(seconds=GROUP_TIMEOUT_S))
        leaders = GlooLeaders(store, _route_address(launch.host, launch.port), rt.config.spin_s,
                              None)
        leaders.gen, leaders.members = welcome.gen, welcome.members
        layout = Layout(welcome.n_local, welcome.hosts)
        link = ZmqLink(sock, layout, welcome.machine, rt.config.spin_s, leaders)
        leaders.lost = link.lost
        link.members = Follower(link)
    except BaseException:
        rt.abandon(rt, "could not join the controller")
        raise
    node = take_place(rt, link, lambda: NodeMaster(rt, link, sentinel, Doorbell(bell)))
    pin()
    logger.info("joined the controller at %s:%d as %s", launch.host, launch.port,
                layout.describe(welcome.machine))
    serve(rt, node, join_workers)  # never returns

