"""The elastic controller's door under abuse (cluster/elastic/knocks.Knocks), without a network.

Knocks go straight to ``Knocks.stranger`` as ``ZmqLink.drain`` hands them over: garbage,
wrong secrets, replayed proofs, handshakes never finished.  The door's memory stays
bounded and a machine with the secret is still let in.
"""

import pytest
import zmq

from synkhronos.cluster.elastic import knocks
from synkhronos.cluster.auth import mac
from synkhronos.cluster.elastic.join import PROOF_MSG
from synkhronos.cluster.elastic.zmq_link import GONE, HELLO, NONCE, PROOF, TAG

SECRET = b"the-job-secret-0123456789abcdef"


class FakeLink:
    def __init__(self):
        self.sent = []   # (ident, tag, body)

    def send_to(self, ident, tag, buf):
        self.sent.append((ident, tag, bytes(buf)))

    def last(self, ident):
        return next((tag, body) for i, tag, body in reversed(self.sent) if i == ident)


def _frames(tag, body=b""):
    return [zmq.Frame(TAG.pack(tag)), zmq.Frame(body)]


def _proof(secret, nonce, ident, n_local=1):
    return PROOF_MSG.pack(mac(secret, nonce, ident), n_local, 1234, b"node")


@pytest.fixture
def door():
    link = FakeLink()
    return knocks.Knocks(link, SECRET, set()), link


def _knock(door, link, ident, secret):
    door.stranger(ident, _frames(HELLO))
    tag, nonce = link.last(ident)
    assert tag == NONCE and len(nonce) == 32
    door.stranger(ident, _frames(PROOF, _proof(secret, nonce, ident)))
    return nonce


def test_a_thousand_bad_knocks_keep_the_door_bounded_and_open(door, caplog):
    door, link = door
    for i in range(1000):
        ident = b"x%05d" % i
        kind = i % 4
        if kind == 0:      # garbage: wrong frame count, short tag, unknown tag
            door.stranger(ident, [zmq.Frame(b"junk")])
            door.stranger(ident, _frames(99, b"\0" * 100))
        elif kind == 1:    # a wrong secret: refused, told GONE
            _knock(door, link, ident, b"wrong")
            assert link.last(ident)[0] == GONE
        elif kind == 2:    # a handshake never finished
            door.stranger(ident, _frames(HELLO))
        else:              # a replay: a proof made for another knock's challenge
            src = b"src%05d" % i
            old = _knock(door, link, src, b"wrong")
            door.stranger(ident, _frames(HELLO))
            door.stranger(ident, _frames(PROOF, _proof(SECRET, old, src)))
            assert link.last(ident)[0] == GONE
    assert len(door.knocking) <= knocks.MAX_KNOCKING
    assert len(door.refused) <= knocks.MAX_REFUSED
    assert door.ready == []
    # One warning for the flood, not one per knock.
    assert len([r for r in caplog.records if "refused" in r.getMessage()]) == 1
    # A refused stranger that knocks again is told GONE at once.
    door.stranger(b"x00001", _frames(HELLO))
    assert link.last(b"x00001")[0] == GONE
    # The right machine still gets in (ready for the next command boundary).
    _knock(door, link, b"good", SECRET)
    assert [j.ident for j in door.ready] == [b"good"] and door.ready[0].host == "node"


def test_refused_strangers_are_remembered_up_to_a_limit(door):
    door, link = door
    for i in range(knocks.MAX_REFUSED + 50):
        _knock(door, link, b"r%06d" % i, b"wrong")
    assert len(door.refused) == knocks.MAX_REFUSED
    assert b"r000000" not in door.refused and b"r%06d" % (knocks.MAX_REFUSED + 49) in door.refused


def test_an_unanswered_challenge_is_forgotten_after_the_deadline(door, monkeypatch):
    door, link = door
    now = [1000.0]
    monkeypatch.setattr(knocks.time, "monotonic", lambda: now[0])
    door.stranger(b"slow", _frames(HELLO))
    nonce = link.last(b"slow")[1]
    now[0] += knocks.KNOCK_DEADLINE_S + 1
    door.stranger(b"other", _frames(HELLO))      # a knock sweeps the stale challenges
    assert b"slow" not in door.knocking
    # Its proof, though right, comes too late: no challenge to answer any more.
    door.stranger(b"slow", _frames(PROOF, _proof(SECRET, nonce, b"slow")))
    assert door.ready == []
