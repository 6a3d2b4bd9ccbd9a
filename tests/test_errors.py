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


def _record(exc, max_bytes):
    raw = errors.error_record("rank 1 of 2 (pid 42)", exc, max_bytes)
    assert len(raw) <= max_bytes
    text, exc_bytes = pickle.loads(raw)
    return text, errors.unpickle_exception(exc_bytes)


def _raised(exc):
    try:
        raise exc
    except Exception as caught:  # noqa: BLE001 - the traceback is the point
        return caught


def test_an_error_too_big_for_its_slot_keeps_its_type_header_and_tail():
    exc = _raised(ValueError("x" * (1 << 20) + " END OF MESSAGE"))
    exc.add_note("a note " + "n" * (1 << 20) + " END OF NOTE")
    text, back = _record(exc, 64 * 1024)
    assert text.splitlines()[0] == "rank 1 of 2 (pid 42)"
    assert "ValueError" in text and text.rstrip().endswith("END OF NOTE")
    assert "characters cut" in text
    assert type(back) is ValueError
    assert str(back).startswith("xxx") and str(back).endswith(" END OF MESSAGE")
    assert back.__notes__[0].endswith("END OF NOTE")
    assert type(exc.args[0]) is str and len(exc.args[0]) > (1 << 20)  # the original is intact


def test_a_small_error_is_recorded_whole():
    exc = _raised(KeyError("k"))
    text, back = _record(exc, 64 * 1024)
    assert text.splitlines()[0] == "rank 1 of 2 (pid 42)" and "characters cut" not in text
    assert type(back) is KeyError and back.args == ("k",)


def test_a_big_error_that_will_not_copy_or_pickle_arrives_as_text():
    class Odd(Exception):
        def __init__(self, a, b):
            super().__init__(a + b)

    text, back = _record(_raised(Odd("y" * (1 << 20), " END")), 64 * 1024)
    assert back is None
    assert text.splitlines()[0] == "rank 1 of 2 (pid 42)" and text.rstrip().endswith("END")
