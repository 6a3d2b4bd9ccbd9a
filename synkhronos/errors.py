"""The exceptions synkhronos raises, and how they cross between processes."""

import copy
import os
import pickle
import traceback


class SynkError(Exception):
    """Base class of every synkhronos-specific error."""


class SynkStateError(SynkError, RuntimeError):
    """A call made in the wrong order (``function()`` before ``fork()``, ...).

    Derives from ``RuntimeError``, the type the original API documents.
    """


class WorkerError(SynkError):
    """One or more ranks raised while running a command (the master's own share included).

    Whichever rank failed, the error raised is a WorkerError; when the lowest
    failing rank raised a built-in exception type (or one of synkhronos's,
    such as SharedMemoryError), it is also an instance of that type
    (``except ValueError`` still catches a ValueError raised in a rank), and
    ``__cause__`` is that rank's exception.

    Attributes:
        rank: the lowest failing rank.
        failures: dict mapping each failing rank to its traceback text.
        causes: dict mapping each failing rank to its exception, or None where
            it did not unpickle in this process.
    """

    def __init__(self, message, rank, failures, causes=None):
        super().__init__(message)
        self.rank = rank
        self.failures = failures
        self.causes = causes if causes is not None else dict.fromkeys(failures)


_WORKER_ERRORS = {}


def worker_error_type(cause):
    """Return WorkerError, or its subclass that is also ``type(cause)`` (a built-in or ours)."""
    kind = type(cause)
    if cause is None or not issubclass(kind, Exception) or issubclass(kind, WorkerError) \
            or kind.__module__ not in ("builtins", __name__):
        return WorkerError
    cls = _WORKER_ERRORS.get(kind)
    if cls is None:
        try:
            cls = type(f"Worker{kind.__name__}", (WorkerError, kind),
                       {"__module__": __name__, "__doc__": f"A {kind.__name__} raised in a rank."})
            cls("probe", 0, {})  # a type whose constructor takes other arguments is not used
        except TypeError:
            cls = WorkerError
        _WORKER_ERRORS[kind] = cls
    return cls


class WorkerDiedError(SynkError):
    """A worker process exited while the master waited for it.

    The runtime is closed afterwards: call ``fork()`` again to go on.

    Attributes:
        rank: the rank whose process died.
        exitcode: its exit code (negative: killed by that signal).
    """

    def __init__(self, message, rank, exitcode):
        super().__init__(message)
        self.rank = rank
        self.exitcode = exitcode


class WorkerStalledError(WorkerDiedError):
    """A rank stopped making progress: its process is stopped, or it ran past the timeout.

    Handled as a dead rank: the master stops every worker and closes the run.

    Attributes:
        rank: the rank that stalled.
        exitcode: None (the process was killed by the master, not by itself).
    """


class MachineLostError(WorkerDiedError):
    """A cluster lost a machine: its node master or ranks died, or MPI lost it.

    Under Open MPI with ULFM (``mpirun --with-ft ulfm``) the run goes on with
    the machines left, unless ``SYNK_ON_MACHINE_LOSS=end``: ranks are
    renumbered (``synk.layout()``), shared variables keep the values the
    surviving ranks hold, and every Data keeps all its rows.  Otherwise the
    runtime is closed, as for any dead rank.

    Attributes:
        rank: the first global rank the lost machine held.
        machines: the lost machines' indices in the layout before the loss.
        survived: whether the run goes on with the machines left.
        completed: where it goes on, whether the command that raised finished
            on every machine left (True: its updates were made, its outputs
            are lost), on none (False: run it again), or on some (None).
    """

    def __init__(self, message, rank, machines=(), survived=False, completed=None):
        super().__init__(message, rank, None)
        self.machines = list(machines)
        self.survived = survived
        self.completed = completed
        self.base = message

    def settled(self, completed, words):
        """Record whether the operation that raised took effect, and say so; return self."""
        self.completed = completed
        self.args = (f"{self.base}; {words}",)
        return self


class SharedMemoryError(SynkError, OSError):
    """A shared-memory segment could not be made: /dev/shm is full, or the name is taken."""


class BackendUnavailableError(SynkError, ImportError):
    """A communication backend needs a package that is not installed."""


class CommAborted(SynkError):
    """Internal: another rank failed, so this rank left a collective early."""


def pickle_exception(exc):
    """Return ``exc`` pickled, or None when it will not pickle (the text still tells what happened)."""
    if exc is None:
        return None
    try:
        return pickle.dumps(exc)
    except Exception:  # noqa: BLE001 - any failure to pickle means "send the text only"
        return None


def unpickle_exception(raw):
    """Return the exception ``pickle_exception`` made, or None when its type does not unpickle here."""
    if raw is None:
        return None
    try:
        return pickle.loads(raw)
    except Exception:  # noqa: BLE001 - the type may not exist in this process; the text remains
        return None


def describe_error(header, exc):
    """Return (traceback text under ``header``, the pickled exception or None)."""
    text = header + "\n" + "".join(traceback.format_exception(exc))
    return text, pickle_exception(exc)


def error_record(header, exc, max_bytes):
    """Return the pickled ``(text, pickled exception)`` of a failure, in at most ``max_bytes``.

    A record too long for its slot is cut, not dropped: the text keeps its
    head (``header``, the start of the traceback) and its tail (the end of the
    message, PyTensor's notes), and the exception's long strings are cut the
    same way, so the master still sees its type.
    """
    text, exc_bytes = describe_error(header, exc)
    raw = pickle.dumps((text, exc_bytes))
    if len(raw) <= max_bytes:
        return raw
    budget = max_bytes // 16  # characters: UTF-8 takes up to 4 bytes each, text and exception
    raw = pickle.dumps((_cut(text, budget), pickle_exception(_shortened(exc, budget))))
    if len(raw) > max_bytes:
        raw = pickle.dumps((_cut(text, budget), None))
    return raw


def _cut(s, n):
    """``s`` with its middle cut out if it is longer than ``n`` characters."""
    if len(s) <= n:
        return s
    head = n // 2
    return f"{s[:head]}\n... [{len(s) - n} characters cut] ...\n{s[len(s) - (n - head):]}"


def _shortened(exc, n):
    """A copy of ``exc`` whose string arguments and notes are cut to ``n`` characters."""
    try:
        short = copy.copy(exc)
        short.args = tuple(_cut(a, n) if isinstance(a, str) else a for a in exc.args)
        notes = getattr(exc, "__notes__", None)
        if isinstance(notes, list):
            short.__notes__ = [_cut(x, n) if isinstance(x, str) else x for x in notes]
    except Exception:  # noqa: BLE001 - a type that does not copy is sent as text only
        return None
    return short


def rank_header(rank, n_parallel):
    """The line that opens a rank's traceback text."""
    return f"rank {rank} of {n_parallel} (pid {os.getpid()})"
