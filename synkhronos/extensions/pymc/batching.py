"""Every chain's (logp, dlogp) request in one data-parallel call: a batcher for sampler threads.

Chains run as threads of the master.  Each asks for (logp, dlogp) at its
position and waits; when every chain that is sampling has asked, the last
one to ask makes one call over all positions and hands each chain its row.
So C chains cost one call's fixed overhead and one pass over the rows per
step, not C.

Two ways to know who is sampling: ``expect(n)`` / ``leave()`` from a driver
that starts the threads itself (PyMC's chains); or, for threads started by
someone else (nutpie's), the callers seen in the last few calls, with a
short wait after which a batch goes without a caller that stopped asking.
"""

import threading
import time

_RECENT_CALLS = 3


class BatchAborted(RuntimeError):
    """The sampling this request belongs to was stopped (another chain failed)."""


class Batcher:
    """Batch concurrent (logp, dlogp) requests into calls of ``evaluate(positions)``.

    Args:
        evaluate: ``evaluate(positions)`` for a sequence of k position vectors
            returns ``(logps, grads)`` of shapes (k,) and (k, size), fresh
            arrays (each chain keeps its row past the next call).
        max_wait_s: in the heuristic mode, how long a batch waits for callers
            seen recently but not yet asking.
        one: ``one(x)`` returns ``(logp, grad)`` at one position (a fresh
            gradient); default: ``evaluate`` on a batch of one.  A request
            that finds no other chain sampling goes straight to it.
    """

    def __init__(self, evaluate, max_wait_s=0.005, one=None):
        self._evaluate = evaluate
        self._one = one if one is not None else self._one_by_batch
        # A plain lock under the condition: ``with self._lock`` runs in C (a lone chain
        # takes it twice a step); nothing here takes it twice in one thread.
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._members = None           # explicit membership (expect/leave), or None
        self._pending = {}             # ticket -> position
        self._results = {}             # ticket -> (logp, grad) or an exception
        self._busy = False
        self._waiting = 0              # threads waiting in _batched
        self._tickets = 0
        self._calls = 0
        self._seen = {}                # thread id -> last call it took part in
        self._aborted = None
        self.max_wait_s = max_wait_s
        self.calls = 0                 # data-parallel calls made
        self.positions = 0             # positions evaluated by them

    def _one_by_batch(self, x):
        logps, grads = self._evaluate([x])
        return logps[0], grads[0]

    def expect(self, n):
        """Say that ``n`` threads will ask until each calls ``leave()``."""
        with self._cond:
            self._members = n
            self._aborted = None

    def leave(self):
        """One expected thread stops asking (it finished or failed)."""
        with self._cond:
            if self._members:
                self._members -= 1
            self._cond.notify_all()

    def abort(self, exc):
        """Make every waiting and later request raise ``BatchAborted`` from ``exc``."""
        with self._cond:
            self._aborted = exc
            self._cond.notify_all()

    def reset(self):
        """Back to the heuristic mode (no expected threads)."""
        with self._cond:
            self._members = None
            self._aborted = None
            self._seen.clear()

    def _expected(self):
        if self._members is not None:
            return max(self._members, 1)
        floor, recent = self._calls - _RECENT_CALLS, 0
        for last in self._seen.values():
            if last >= floor:
                recent += 1
        return recent or 1

    def __call__(self, x):
        """Return ``(logp, grad)`` at position ``x`` (blocks until its batch ran)."""
        lock = self._lock
        with lock:
            if self._aborted is not None:
                raise BatchAborted("sampling stopped") from self._aborted
            members = self._members
            if members is None:
                # Threads started elsewhere: who asked lately tells who is sampling.
                self._seen[threading.get_ident()] = self._calls
                alone = self._expected() == 1
            else:
                alone = members <= 1
            alone = alone and not self._busy and not self._pending
            if alone:
                # One chain (or the others finished): no batch to wait for or build.
                self._busy = True
                self._calls += 1
        if not alone:
            return self._batched(x)
        try:
            return self._one(x)
        finally:
            with lock:
                self._busy = False
                self.calls += 1
                self.positions += 1
                if self._waiting:   # a chain that came while this one ran
                    self._cond.notify_all()

    def _batched(self, x):
        """Wait for the other chains' requests; the last one to ask makes the call."""
        with self._cond:
            ticket = self._tickets
            self._tickets += 1
            self._pending[ticket] = x
            first = time.monotonic()
            while True:
                if ticket in self._results:
                    return self._take(ticket)
                if self._aborted is not None:
                    self._pending.pop(ticket, None)
                    raise BatchAborted("sampling stopped") from self._aborted
                if not self._busy and ticket in self._pending:
                    waited = time.monotonic() - first
                    if (len(self._pending) >= self._expected()
                            or (self._members is None and waited >= self.max_wait_s)):
                        break
                self._waiting += 1
                try:
                    self._cond.wait(self.max_wait_s if self._members is None else 0.5)
                finally:
                    self._waiting -= 1
            batch, self._pending = self._pending, {}
            self._busy = True
            self._calls += 1
        try:
            if len(batch) == 1:
                results = {t: self._one(p) for t, p in batch.items()}
            else:
                logps, grads = self._evaluate(list(batch.values()))
                results = {t: (logps[i], grads[i]) for i, t in enumerate(batch)}
        except BaseException as exc:  # noqa: BLE001 - handed to every chain of the batch
            results = {t: exc for t in batch}
        with self._cond:
            self._results.update(results)
            self._busy = False
            self.calls += 1
            self.positions += len(batch)
            self._cond.notify_all()
            return self._take(ticket)

    def _take(self, ticket):
        out = self._results.pop(ticket)
        if isinstance(out, BaseException):
            raise out
        return out
