"""cluster.sentinel and cluster.heartbeats: the liveness port admits only sentinels that prove the
job's secret; the controller's heartbeats name a machine lost or silent."""

import socket
import struct
import threading
import time

import pytest

from synkhronos.cluster import auth, heartbeats, sentinel
from synkhronos.cluster.layout import Layout
from synkhronos.errors import MachineLostError, SynkError, WorkerStalledError

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def port():
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    yield listener
    listener.close()


def _connect(listener):
    return socket.create_connection(listener.getsockname(), timeout=5)


def _sentinel(listener, node, secret, keep):
    sock = _connect(listener)
    sentinel.prove(sock, node, secret)
    keep.append(sock)


def _accept_in_thread(beats, listener, n, timeout_s=10):
    box = []

    def run():
        try:
            beats.accept(listener, n, timeout_s=timeout_s)
            box.append(None)
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            box.append(exc)
    t = threading.Thread(target=run)
    t.start()
    return t, box


def test_proven_sentinels_are_admitted_and_strangers_dropped(port):
    secret = auth.new_secret()
    beats = heartbeats.Heartbeats(Layout([1, 1, 1], ["a", "b", "c"]), secret)
    t, box = _accept_in_thread(beats, port, 3)
    keep = []
    # Strangers first: one silent, one sending garbage, one with the wrong secret,
    # one that replays what a real sentinel sent on another connection.
    silent = _connect(port)
    garbage = _connect(port)
    garbage.recv(auth.NONCE_BYTES)
    garbage.sendall(b"x" * 100)
    wrong = _connect(port)
    sentinel.prove(wrong, 1, auth.new_secret())
    recorder = _connect(port)
    nonce = recorder.recv(auth.NONCE_BYTES)
    answer = struct.pack("q", 1) + auth.mac(secret, nonce, struct.pack("q", 1))
    recorder.close()
    replay = _connect(port)
    replay.recv(auth.NONCE_BYTES)
    replay.sendall(answer)
    # Then the job's two sentinels.
    _sentinel(port, 1, secret, keep)
    _sentinel(port, 2, secret, keep)
    t.join(15)
    assert box == [None]
    assert sorted(beats.socks) == [1, 2]
    # The admitted connections are the sentinels' own, not a stranger's.
    assert [beats.socks[n].getpeername() for n in (1, 2)] == [s.getsockname() for s in keep]
    for s in keep:
        s.sendall(b".")
    time.sleep(0.1)
    beats.read()
    for s in (silent, garbage, wrong, replay, *keep):
        s.close()
    beats.close()


def test_a_machine_cannot_connect_twice(port):
    secret = auth.new_secret()
    beats = heartbeats.Heartbeats(Layout([1, 1, 1], ["a", "b", "c"]), secret)
    t, box = _accept_in_thread(beats, port, 3, timeout_s=2)
    keep = []
    _sentinel(port, 1, secret, keep)
    _sentinel(port, 1, secret, keep)   # someone holding the secret, but machine 1 is in
    t.join(10)
    assert isinstance(box[0], SynkError) and "1 of 2" in str(box[0])
    assert list(beats.socks) == [1]
    for s in keep:
        s.close()
    beats.close()


def test_nothing_proven_in_time_is_an_error_naming_the_count(port):
    beats = heartbeats.Heartbeats(Layout([1, 1], ["a", "b"]), auth.new_secret())
    silent = _connect(port)
    with pytest.raises(SynkError, match="0 of 1 within 0.5 s"):
        beats.accept(port, 2, timeout_s=0.5)
    silent.close()


def _three_machines(port, monkeypatch, limit_s="30"):
    monkeypatch.setenv("SYNK_HEARTBEAT_S", limit_s)
    secret = auth.new_secret()
    beats = heartbeats.Heartbeats(Layout([2, 1, 3], ["a", "b", "c"]), secret)
    t, box = _accept_in_thread(beats, port, 3)
    keep = []
    _sentinel(port, 1, secret, keep)
    _sentinel(port, 2, secret, keep)
    t.join(15)
    assert box == [None]
    beats.start_beating()
    return beats, keep


def test_a_closed_connection_is_logged_at_once_and_raised_naming_the_machine(port, monkeypatch,
                                                                              caplog):
    beats, keep = _three_machines(port, monkeypatch)
    # The thread beats both sentinels.
    time.sleep(3 * sentinel.BEAT_S)
    assert all(s.recv(64) for s in keep)
    beats.read()
    t0 = time.monotonic()
    keep[1].close()  # machine 2's sentinel (its node master died)
    deadline = time.monotonic() + 5
    while 2 not in beats.closed and time.monotonic() < deadline:
        time.sleep(0.005)
    assert beats.closed[2] - t0 < 0.5
    assert "machine 2 (c, ranks 3..5) lost" in caplog.text
    with pytest.raises(MachineLostError, match=r"machine 2 \(c, ranks 3\.\.5\)") as info:
        beats.read()
    assert info.value.machines == [2] and info.value.rank == 3
    # Going on without it: machine 1 keeps its connection, nothing is raised any more.
    beats.keep([0, 1], Layout([2, 1], ["a", "b"]))
    assert list(beats.socks) == [1] and not beats.closed
    beats.read()
    keep[0].close()
    beats.close()


def test_silence_is_a_stall_naming_the_machine(port, monkeypatch):
    beats, keep = _three_machines(port, monkeypatch, limit_s="0.5")
    keep[0].sendall(b".")
    deadline = time.monotonic() + 5
    with pytest.raises(WorkerStalledError, match=r"machine 1 \(b, ranks 2\.\.2\).*no heartbeat"):
        while time.monotonic() < deadline:
            keep[1].sendall(b".")  # machine 2 beats; machine 1 went silent
            beats.read()
            time.sleep(0.05)
    for s in keep:
        s.close()
    beats.close()
