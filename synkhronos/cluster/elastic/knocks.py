"""Strangers at the elastic controller's door: challenge, proof, refusal, in bounded memory.

A node master that wants to join knocks (HELLO), gets a fresh challenge (NONCE)
and answers with an HMAC of it under the job's secret (PROOF); nothing it sends
is unpickled before.  A proof that holds makes it a ``Joiner``, admitted by the
door (elastic/door.py) at the program's next call.  Whatever else arrives
(garbage, wrong secrets, replayed proofs, handshakes never finished) costs
bounded memory and one warning line per ``REFUSAL_LOG_S``.
"""

import logging
import secrets
import time
from collections import OrderedDict
from typing import NamedTuple

from ..auth import proves
from .join import PROOF_MSG
from .zmq_link import GONE, HELLO, NONCE, PROOF, TAG

logger = logging.getLogger(__name__)

MAX_KNOCKING = 64        # challenges outstanding at once (strangers cannot pile up)
KNOCK_DEADLINE_S = 10.0  # a challenge unanswered this long is forgotten
MAX_REFUSED = 1024       # refused strangers remembered (told GONE if they knock again)
REFUSAL_LOG_S = 10.0     # refusals are logged at most this often (a flood says so once)


class Joiner(NamedTuple):
    ident: bytes
    n_local: int
    pid: int
    host: str


class Knocks:
    """The knocks of strangers (routing ids the link does not know), from ``ZmqLink.drain``.

    Args:
        link: the controller's link (``send_to`` answers a routing id).
        secret: the job's secret.
        banned: routing ids of machines dropped from the run (told GONE, never let in).
    """

    def __init__(self, link, secret, banned):
        self.link = link
        self.secret = secret
        self.banned = banned
        self.knocking = {}            # routing id -> (the challenge it was sent, when)
        self.ready = []               # Joiner: proved, to be admitted at the next boundary
        self.refused = OrderedDict()  # routing ids of strangers refused, the latest MAX_REFUSED
        self.n_refused = self.warned_at = 0   # refusals, and how many were logged
        self.last_warned = float("-inf")

    def stranger(self, ident, frames):
        """Answer one message of a stranger: a challenge, a joiner, or a refusal."""
        if ident in self.banned or ident in self.refused:
            self.link.send_to(ident, GONE, b"")
            return
        if len(frames) != 2 or len(frames[0]) != TAG.size:
            return
        tag = TAG.unpack(frames[0].bytes)[0]
        if tag == HELLO:
            self.forget_stale()
            if len(self.knocking) >= MAX_KNOCKING:
                self.knocking.pop(next(iter(self.knocking)))
            nonce = secrets.token_bytes(32)
            self.knocking.pop(ident, None)   # a knock again: a new challenge, at the end
            self.knocking[ident] = (nonce, time.monotonic())
            self.link.send_to(ident, NONCE, nonce)
        elif tag == PROOF and ident in self.knocking:
            nonce, _ = self.knocking.pop(ident)
            body = frames[1].bytes
            if len(body) == PROOF_MSG.size:
                mac, n_local, pid, host = PROOF_MSG.unpack(body)
                if proves(self.secret, nonce, ident, mac) and n_local >= 1:
                    self.ready.append(Joiner(ident, n_local, pid,
                                             host.rstrip(b"\0").decode(errors="replace")))
                    return
            self._refusing()
            self.refused[ident] = True
            while len(self.refused) > MAX_REFUSED:
                self.refused.popitem(last=False)
            self.link.send_to(ident, GONE, b"")

    def _refusing(self):
        """Log a refusal: the first, then at most one line per ``REFUSAL_LOG_S`` with a count."""
        self.n_refused += 1
        now = time.monotonic()
        if now - self.last_warned >= REFUSAL_LOG_S:
            more = self.n_refused - self.warned_at
            logger.warning("elastic door: refused %s that did not prove %s to this job (a "
                           "wrong secret?)", "a machine" if more == 1 else f"{more} machines",
                           "it belongs" if more == 1 else "they belong")
            self.last_warned, self.warned_at = now, self.n_refused

    def forget_stale(self):
        """Drop challenges older than ``KNOCK_DEADLINE_S`` (a handshake never finished)."""
        old = time.monotonic() - KNOCK_DEADLINE_S
        while self.knocking:
            ident, (_, t) = next(iter(self.knocking.items()))
            if t >= old:
                break
            del self.knocking[ident]
