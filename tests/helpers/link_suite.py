"""The link suite's expectations: what every carrier of ``cluster.link.LinkBase`` must do.

Written once, run per carrier (tests/cluster/test_link.py; the runs:
tests/cluster/link_job.py).  Each expectation is a function of one link that
both machines run at once, the controller as machine 0 and a node master as
machine 1, between two barriers; it asserts what its side sees, and every
wait in it is bounded (``DEADLINE_S``), so a carrier that breaks the
contract fails the expectation instead of hanging it.
"""

import struct

import numpy as np

from synkhronos.cluster.link import ABORT, CMD, DATA, DONE, INBAND_BYTES, OUTPUTS, POOL_BYTES, REPORT, \
    REPORTS
from synkhronos.errors import MachineLostError, SynkError
from synkhronos.runtime.liveness import deadline_check

DEADLINE_S = 20.0
BARRIER = 99          # the suite's own tag: the messages between two expectations
BIG = 3 * INBAND_BYTES  # bytes: out of band, kept in a pool, sent without a copy

EXPECTATIONS = {}


def expectation(fn):
    """Add ``fn(link)`` to the suite."""
    EXPECTATIONS[fn.__name__] = fn
    return fn


def check(what="the other machine's message"):
    return deadline_check(DEADLINE_S, f"{what} did not come within {DEADLINE_S:g} s")


def _must_not_wait():
    raise AssertionError("waited where nothing was pending")


def peer(link):
    return 1 - link.node


def barrier(link, number):
    """Both machines reach expectation ``number`` (machine 1 speaks first: ZeroMQ's ROUTER
    can send to a node master only once it has heard from it)."""
    mine = struct.pack("q", number)
    got = bytearray(8)
    if link.node == 1:
        link.send_bytes(0, BARRIER, mine)
        link.recv_into(0, BARRIER, got, check("the barrier"))
    else:
        link.recv_into(1, BARRIER, got, check("the barrier"))
        link.send_bytes(1, BARRIER, mine)
    assert struct.unpack("q", got)[0] == number, (struct.unpack("q", got)[0], number)
    link.complete_sends(check("the barrier's send"))


def recv_obj(link, src, tag):
    """Receive one object ``link.send`` sent (its head, then its out-of-band buffers)."""
    head = link.recv_bytes(src, tag, check())
    return link.rest(src, tag, head, check(), pooled=False)


def _payload(k):
    return {"k": k, "small": np.arange(10, dtype=np.int32) * k,
            "big": np.arange(BIG // 8, dtype=np.float64) * k, "text": "é" * k}


def _same(got, want):
    assert got.keys() == want.keys()
    for key, value in want.items():
        if isinstance(value, np.ndarray):
            assert got[key].dtype == value.dtype and np.array_equal(got[key], value), key
        else:
            assert got[key] == value, key


# ---- the expectations ----------------------------------------------------------------
@expectation
def where_it_is(link):
    """Its attributes: this machine, the other one, the layout; ``begin`` sets the number."""
    assert link.node in (0, 1) and link.others == [peer(link)]
    assert link.layout.n_machines == 2 and link.spin_s >= 0
    for seq in (7, 8, 0):
        link.begin(seq)
        assert link.seq == seq
    assert link.news() is False  # nobody regrouped anything
    assert link.survives() in (True, False)


@expectation
def objects_travel_pickled_large_buffers_out_of_band(link):
    """``send`` pickles; ``recv_bytes`` and ``rest`` give back an equal object, both ways."""
    if link.node == 0:
        link.send(1, CMD, _payload(3))
        link.complete_sends(check())
        got = link.probe_any(1, REPORTS)
        while got is None:
            got = link.probe_any(1, REPORTS)
            check()
        message, n, tag = got
        assert tag == REPORT
        head = bytearray(n)
        link.receive(message, head, 1)
        _same(link.rest(1, REPORT, head, check(), pooled=False), _payload(4))
    else:
        _same(recv_obj(link, 0, CMD), _payload(3))
        link.send(0, REPORT, _payload(4))
        link.complete_sends(check())


@expectation
def one_tags_messages_arrive_in_the_order_sent(link):
    """Fifty messages under one tag, small, empty and large mixed: in order, each intact."""
    sizes = [(i * 37) % 300 if i % 5 else BIG + i for i in range(50)]
    if link.node == 0:
        for i, n in enumerate(sizes):
            link.send_bytes(1, DATA, bytes([i]) * n)
        link.complete_sends(check())
    else:
        for i, n in enumerate(sizes):
            got = link.recv_bytes(0, DATA, check())
            assert bytes(got) == bytes([i]) * n, (i, len(got), n)


@expectation
def tags_keep_their_messages_apart(link):
    """A message under one tag waits while one under another, sent later, is taken first;
    ``probe_any`` finds each report, under its tag."""
    if link.node == 0:
        link.send_bytes(1, DATA, b"first")
        link.send_bytes(1, CMD, b"second")
        link.complete_sends(check())
        seen = []
        while len(seen) < 3:
            got = link.probe_any(1, REPORTS)
            check()
            if got is not None:
                message, n, tag = got
                buf = bytearray(n)
                link.receive(message, buf, 1)
                seen.append((tag, bytes(buf)))
        assert sorted(seen) == [(REPORT, b"report"), (DONE, struct.pack("q", 5)),
                                (OUTPUTS, b"outputs")], seen
    else:
        assert bytes(link.recv_bytes(0, CMD, check())) == b"second"
        assert link.probe(0, REPORT) is None
        assert bytes(link.recv_bytes(0, DATA, check())) == b"first"
        link.send_bytes(0, DONE, struct.pack("q", 5))
        link.send_bytes(0, OUTPUTS, b"outputs")
        link.send_bytes(0, REPORT, b"report")
        link.complete_sends(check())


@expectation
def a_probed_message_is_received_whole(link):
    """A probe returns at once, None until the message came; what it found, ``receive``
    takes whole, and the next probe finds nothing (the carrier may have matched it already:
    a probed message is for ``receive``, not for probing again)."""
    if link.node == 1:
        link.send_bytes(0, DATA, b"x" * 1000)
        link.complete_sends(check())
        return
    wait = check()
    got = link.probe(1, DATA)
    while got is None:
        wait()
        got = link.probe(1, DATA)
    message, n = got
    assert n == 1000
    buf = bytearray(n)
    link.receive(message, buf, 1)
    assert bytes(buf) == b"x" * 1000
    assert link.probe(1, DATA) is None


@expectation
def a_wait_for_nothing_ends_by_its_check(link):
    """Nothing sent: probes return None at once, and every wait ends when its check raises.

    Machine 1 first, then machine 0 (told by a DONE): neither sends while the other looks.
    """
    if link.node == 0:
        link.recv_into(1, DONE, bytearray(8), check())
        _nothing_arrives(link)
        link.send_bytes(1, DONE, struct.pack("q", 0))
        link.complete_sends(check())
    else:
        _nothing_arrives(link)
        link.send_bytes(0, DONE, struct.pack("q", 1))
        link.complete_sends(check())
        link.recv_into(0, DONE, bytearray(8), check())


def _nothing_arrives(link):
    other = peer(link)
    for tag in (CMD, REPORT, DATA, DONE, OUTPUTS):
        assert link.probe(other, tag) is None
    assert link.probe_any(other, REPORTS) is None
    for wait in (lambda c: link.recv_bytes(other, DATA, c),
                 lambda c: link.recv_into(other, DATA, bytearray(4), c),
                 lambda c: link.wait(lambda: False, c)):
        try:
            wait(deadline_check(0.2, "waited long enough"))
        except SynkError as exc:
            assert "waited long enough" in str(exc)
        else:
            raise AssertionError("a wait for nothing returned")


@expectation
def recv_into_takes_its_size_and_refuses_another(link):
    """``recv_into`` fills a buffer of the message's size, and refuses one of another size with
    both sizes named (a broken protocol: the refused message is lost to it, so the suite sends
    it under a tag of its own, ABORT, that nothing else here uses)."""
    if link.node == 0:
        link.send_bytes(1, DATA, bytes(range(250)) * 4)
        link.send_bytes(1, DATA, b"\x07" * BIG)
        link.send_bytes(1, ABORT, b"\x01" * 1000)
        link.complete_sends(check())
        return
    buf = bytearray(1000)
    link.recv_into(0, DATA, buf, check())
    assert bytes(buf) == bytes(range(250)) * 4
    big = np.zeros(BIG, np.uint8)
    link.recv_into(0, DATA, big, check())
    assert (big == 7).all()
    try:
        link.recv_into(0, ABORT, bytearray(999), check())
    except SynkError as exc:
        assert "999" in str(exc) and "1000" in str(exc), exc
    else:
        raise AssertionError("a buffer of the wrong size was filled")


@expectation
def large_receive_buffers_are_kept_per_slot(link):
    """``recv_bytes`` with a slot reuses one buffer for large messages; small ones get fresh ones."""
    if link.node == 0:
        for k in (1, 2, 3, 4):
            link.send_bytes(1, DATA, bytes([k]) * (POOL_BYTES if k < 3 else 100))
        link.complete_sends(check())
        return
    first = link.recv_bytes(0, DATA, check(), slot=0)
    assert bytes(first) == b"\x01" * POOL_BYTES
    second = link.recv_bytes(0, DATA, check(), slot=0)
    assert second is first and bytes(second) == b"\x02" * POOL_BYTES
    small = [link.recv_bytes(0, DATA, check(), slot=0) for _ in range(2)]
    assert small[0] is not small[1] and bytes(small[1]) == b"\x04" * 100


@expectation
def a_sent_buffer_may_be_reused_once_complete(link):
    """Large sends leave without a copy: once ``complete_sends`` returned the sender may
    overwrite them, and the receiver still gets what was sent."""
    if link.node == 0:
        buf = np.full(4 * BIG, 7, np.uint8)
        link.send_bytes(1, DATA, buf)
        link.send_bytes(1, DATA, b"")
        link.complete_sends(check())
        buf[:] = 9
        link.complete_sends(_must_not_wait)  # nothing left to wait for
        link.send_bytes(1, DONE, b"written over")
        link.complete_sends(check())
        return
    got = link.recv_bytes(0, DATA, check())
    assert len(got) == 4 * BIG and bytes(got) == b"\x07" * (4 * BIG)
    assert len(link.recv_bytes(0, DATA, check())) == 0
    assert bytes(link.recv_bytes(0, DONE, check())) == b"written over"


@expectation
def a_retired_send_is_not_waited_for_and_still_arrives(link):
    """A send nobody receives yet, retired, no longer holds ``complete_sends``; the peer may
    still receive it, intact."""
    big = b"\x05" * (4 * BIG)
    if link.node == 1:
        link.send_bytes(0, REPORT, big)
        link.retire_sends()
        link.complete_sends(_must_not_wait)
        link.send_bytes(0, DONE, struct.pack("q", 1))
        link.complete_sends(check())
        got = bytearray(8)
        link.recv_into(0, DONE, got, check())  # the controller took the retired one
        link.retire_sends()  # completed now: forgotten
        link.complete_sends(_must_not_wait)
        return
    buf = bytearray(8)
    link.recv_into(1, DONE, buf, check())
    assert bytes(link.recv_bytes(1, REPORT, check())) == big
    link.send_bytes(1, DONE, struct.pack("q", 2))
    link.complete_sends(check())


@expectation
def a_lost_machine_is_named(link):
    """``lost`` makes the MachineLostError of a carrier's failure: the machine named where
    known, its first rank."""
    other = peer(link)
    err = link.lost(RuntimeError("the carrier failed"), other)
    assert isinstance(err, MachineLostError), err
    assert err.machines == [other] and err.rank == link.layout.offsets[other], err
    assert link.layout.describe(other) in str(err) and "lost" in str(err), err
    anonymous = link.lost(RuntimeError("the carrier failed"))
    assert isinstance(anonymous, MachineLostError) and anonymous.machines == [], anonymous


def run_all(link, out):
    """Run every expectation on this machine; ``out(line)`` one line each: OK or FAIL."""
    import json
    import traceback

    for i, (name, fn) in enumerate(EXPECTATIONS.items()):
        try:
            barrier(link, i)
            fn(link)
        except BaseException:  # noqa: BLE001 - reported, and the next expectation runs
            out(f"FAIL {name} {json.dumps(traceback.format_exc())}")
        else:
            out(f"OK {name}")
    barrier(link, len(EXPECTATIONS))
