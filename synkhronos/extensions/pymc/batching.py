"""Every chain's (logp, dlogp) request in one data-parallel call: a batcher for sampler chains.

Each chain asks for (logp, dlogp) at its position and waits; once every
chain that is sampling has asked, one call evaluates all positions and each
chain gets its row.  So C chains cost one call's fixed overhead and one pass
over the rows per step, not C.

Two ways to run the chains:

- ``run_together(bodies)``: the chains (PyMC's) are greenlets of the calling
  thread.  A request suspends its chain; once every live chain waits, the
  calling thread makes the call and resumes each with its row.  One thread
  makes every call, so the master's share of the rows is computed in one
  malloc arena (a thread per chain kept a freed copy of its intermediates
  in an arena of its own: 58 MiB at 10^6 rows, 2 chains; bench/RESULTS.md),
  and no request waits for a thread to wake.
- Threads started by someone else (nutpie's): who asked in the last few
  calls tells who is sampling; the last one to ask makes the call, and a
  batch goes after a short wait without a caller that stopped asking.
"""

import signal
import threading
import time

import greenlet

_RECENT_CALLS = 3


class BatchAborted(RuntimeError):
    """The sampling this request belongs to was stopped (another chain failed)."""


class Batcher:
    """Batch concurrent (logp, dlogp) requests into calls of ``evaluate(positions)``.

    Args:
        evaluate: ``evaluate(positions)`` for a sequence of k position vectors
            returns ``(logps, grads)`` of shapes (k,) and (k, size), fresh
            arrays (each chain keeps its row past the next call).
        max_wait_s: for threads started elsewhere, how long a batch waits for
            callers seen recently but not yet asking.
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
        self._pending = {}             # ticket -> position
        self._results = {}             # ticket -> (logp, grad) or an exception
        self._busy = False
        self._waiting = 0              # threads waiting in _batched
        self._tickets = 0
        self._calls = 0
        self._seen = {}                # thread id -> last call it took part in
        self._hub = None               # the greenlet of run_together, while it runs
        self.max_wait_s = max_wait_s
        self.calls = 0                 # data-parallel calls made
        self.positions = 0             # positions evaluated by them

    def _one_by_batch(self, x):
        logps, grads = self._evaluate([x])
        return logps[0], grads[0]

    def reset(self):
        """Start a new sampling run: forget which threads asked lately, zero ``calls`` and ``positions``."""
        with self._cond:
            self._seen.clear()
            self.calls = self.positions = 0

    def _expected(self):
        floor, recent = self._calls - _RECENT_CALLS, 0
        for last in self._seen.values():
            if last >= floor:
                recent += 1
        return recent or 1

    # -- chains as greenlets of one thread --------------------------------------------------------
    def run_together(self, bodies):
        """Run each of ``bodies`` (no-argument callables) as a greenlet of this thread, to the end.

        A body's requests (``self(x)``) suspend it; once every body still
        running has asked, one call serves them all and each resumes with its
        row.  A body that raises stops the others: each is resumed with
        ``BatchAborted`` (its cause the error) at its request.  Ctrl-C stops
        every body the same way once the call in progress returned or the
        running body asked: it is held till then, as PyMC's chain loop would
        swallow it (ending that chain alone) and a call cut midway would
        leave the ranks to be waited for.

        Returns:
            ``(errors, interrupted)``: the exceptions the bodies ended with,
            in the order they happened, and whether Ctrl-C stopped them.
        """
        hub = greenlet.getcurrent()
        chains = [greenlet.greenlet(body, parent=hub) for body in bodies]
        asking, errors = {}, []
        stop, held = None, False

        def resume(i, *value, exc=None):
            nonlocal stop
            try:
                x = chains[i].throw(exc) if exc is not None else chains[i].switch(*value)
            except BaseException as e:  # noqa: BLE001 - the body's end, reported to the caller
                errors.append(e)
                stop = e if stop is None else stop
                return
            if not chains[i].dead:
                asking[i] = x

        def on_sigint(signum, frame):
            nonlocal held
            held = True

        previous = _install_sigint(on_sigint)
        self._hub = hub
        try:
            for i in range(len(chains)):
                resume(i)
            while asking:
                if held and stop is None:
                    stop = KeyboardInterrupt()
                if stop is not None:
                    batch, asking = asking, {}
                    for i in batch:
                        aborted = BatchAborted("sampling stopped")
                        aborted.__cause__ = stop
                        resume(i, exc=aborted)
                    continue
                try:
                    results = self._serve(asking)
                except KeyboardInterrupt as exc:   # someone else's SIGINT handler raised
                    stop = exc
                    continue
                asking = {}
                for i, out in results.items():
                    if isinstance(out, BaseException):
                        resume(i, exc=out)
                    else:
                        resume(i, out)
        finally:
            self._hub = None
            if previous is not None:
                signal.signal(signal.SIGINT, previous)
        interrupted = isinstance(stop, KeyboardInterrupt)
        return [e for e in errors if not isinstance(e, KeyboardInterrupt)], interrupted

    def _serve(self, asking):
        """One call for the positions in ``asking`` (chain -> x): chain -> (logp, grad) or error."""
        try:
            if len(asking) == 1:
                ((i, x),) = asking.items()
                results = {i: self._one(x)}
            else:
                logps, grads = self._evaluate(list(asking.values()))
                results = {i: (logps[k], grads[k]) for k, i in enumerate(asking)}
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to every chain of the batch
            results = {i: exc for i in asking}
        self.calls += 1
        self.positions += len(asking)
        return results

    # -- requests -------------------------------------------------------------------------------------
    def __call__(self, x):
        """Return ``(logp, grad)`` at position ``x`` (blocks until its batch ran)."""
        hub = self._hub
        if hub is not None and greenlet.getcurrent().parent is hub:
            return hub.switch(x)
        lock = self._lock
        with lock:
            # Threads started elsewhere: who asked lately tells who is sampling.
            self._seen[threading.get_ident()] = self._calls
            alone = self._expected() == 1 and not self._busy and not self._pending
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
        """Wait for the other threads' requests; the last one to ask makes the call."""
        with self._cond:
            ticket = self._tickets
            self._tickets += 1
            self._pending[ticket] = x
            first = time.monotonic()
            while True:
                if ticket in self._results:
                    return self._take(ticket)
                if not self._busy and ticket in self._pending:
                    waited = time.monotonic() - first
                    if len(self._pending) >= self._expected() or waited >= self.max_wait_s:
                        break
                self._waiting += 1
                try:
                    self._cond.wait(self.max_wait_s)
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


def _install_sigint(handler):
    """Install ``handler`` for SIGINT if Python's own is installed (main thread); return the old one.

    Returns None (nothing installed) where SIGINT is ignored or handled by
    someone else's handler, or off the main thread: theirs stays.
    """
    if threading.current_thread() is not threading.main_thread():
        return None
    previous = signal.getsignal(signal.SIGINT)
    if previous is not signal.default_int_handler:
        return None
    signal.signal(signal.SIGINT, handler)
    return previous
