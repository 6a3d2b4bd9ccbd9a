"""errors: the exception hierarchy that user code catches."""

import pickle


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


def test_backend_unavailable_is_an_import_error():
    assert issubclass(synk.BackendUnavailableError, ImportError)


def test_a_builtin_error_in_a_rank_keeps_its_type():
    cls = errors.worker_error_type(ValueError("bad"))
    assert issubclass(cls, synk.WorkerError) and issubclass(cls, ValueError)
    assert errors.worker_error_type(KeyError("k")) is errors.worker_error_type(KeyError("j"))
    assert issubclass(errors.worker_error_type(FileNotFoundError(2, "x")), OSError)
    assert issubclass(errors.worker_error_type(synk.SharedMemoryError("full")),
                      synk.SharedMemoryError)


def test_other_errors_in_a_rank_are_plain_worker_errors():
    class Custom(Exception):
        pass

    assert errors.worker_error_type(Custom()) is synk.WorkerError
    assert errors.worker_error_type(None) is synk.WorkerError
    assert errors.worker_error_type(synk.WorkerError("x", 0, {})) is synk.WorkerError
    # a built-in type whose constructor takes other arguments cannot be mixed in
    exc = UnicodeDecodeError("utf-8", b"x", 0, 1, "bad")
    assert errors.worker_error_type(exc) is synk.WorkerError


def test_public_names():
    for name in ("SynkError", "SynkStateError", "WorkerError", "WorkerDiedError",
                 "WorkerStalledError", "SharedMemoryError", "BackendUnavailableError"):
        assert name in synk.__all__
        assert getattr(synk, name) is getattr(errors, name)


def test_plain_errors_pickle():
    err = pickle.loads(pickle.dumps(synk.SynkStateError("x")))
    assert type(err) is synk.SynkStateError and str(err) == "x"
