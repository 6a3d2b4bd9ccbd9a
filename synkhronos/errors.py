"""The exceptions synkhronos raises."""


class SynkError(Exception):
    """Base class of every synkhronos-specific error."""


class SynkStateError(SynkError, RuntimeError):
    """A call made in the wrong order (``function()`` before ``fork()``, ...).

    Derives from ``RuntimeError``, the type the original API documents.
    """


class WorkerError(SynkError):
    """One or more ranks raised while running a command.

    Attributes:
        rank: the lowest failing rank.
        failures: dict mapping each failing rank to its traceback text.
    """

    def __init__(self, message, rank, failures):
        super().__init__(message)
        self.rank = rank
        self.failures = failures


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


class BackendUnavailableError(SynkError, ImportError):
    """A communication backend needs a package that is not installed."""


class CommAborted(SynkError):
    """Internal: another rank failed, so this rank left a collective early."""
