"""errors: the exception hierarchy that user code catches."""

import pickle

import pytest

import synkhronos as synk
from synkhronos import errors


def test_everything_derives_from_synk_error():
    for cls in (synk.SynkStateError, synk.WorkerError, synk.WorkerDiedError,
                synk.BackendUnavailableError):
        assert issubclass(cls, synk.SynkError)
    assert issubclass(synk.SynkError, Exception)


def test_state_error_is_a_runtime_error():
    # The original API documents RuntimeError for call-order mistakes.
    assert issubclass(synk.SynkStateError, RuntimeError)
    with pytest.raises(RuntimeError):
        raise synk.SynkStateError("function() needs fork() first")


def test_backend_unavailable_is_an_import_error():
    assert issubclass(synk.BackendUnavailableError, ImportError)


def test_worker_error_carries_rank_and_failures():
    failures = {2: "rank 2 of 4 (pid 1)\nTraceback ...", 3: "rank 3 of 4 (pid 2)\n..."}
    err = synk.WorkerError("call failed in rank 2 (and 1 other rank)", 2, failures)
    assert err.rank == 2
    assert err.failures == failures
    assert "rank 2" in str(err)


def test_worker_died_error_carries_rank_and_exit_code():
    err = synk.WorkerDiedError("rank 1 died", 1, -9)
    assert err.rank == 1
    assert err.exitcode == -9
    assert "rank 1" in str(err)


def test_public_names():
    for name in ("SynkError", "SynkStateError", "WorkerError", "WorkerDiedError",
                 "BackendUnavailableError"):
        assert name in synk.__all__
        assert getattr(synk, name) is getattr(errors, name)


def test_plain_errors_pickle():
    err = pickle.loads(pickle.dumps(synk.SynkStateError("x")))
    assert type(err) is synk.SynkStateError and str(err) == "x"
