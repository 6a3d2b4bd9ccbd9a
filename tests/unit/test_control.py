"""control and liveness: the bounded waits every barrier is built on, commands, handlers."""

import threading
import time

import pytest

from synkhronos import control, liveness
from synkhronos.control import Command


class Flag:
    """A predicate that comes true after ``n`` evaluations."""

    def __init__(self, n):
        self.n = n
        self.calls = 0

    def __call__(self):
        self.calls += 1
        return self.calls > self.n


class Checks:
    def __init__(self, fail_after=None):
        self.calls = 0
        self.fail_after = fail_after

    def __call__(self):
        self.calls += 1
        if self.fail_after is not None and self.calls > self.fail_after:
            raise RuntimeError("peer died")


def test_spin_until_returns_true_when_the_predicate_holds():
    check = Checks()
    assert liveness.spin_until(lambda: True, check, 0.0)
    assert check.calls == 0
    assert liveness.spin_until(Flag(1000), check, 5.0)


def test_spin_until_gives_up_after_spin_s():
    t0 = time.perf_counter()
    assert liveness.spin_until(lambda: False, Checks(), 0.05) is False
    assert time.perf_counter() - t0 < 5.0


def test_spin_until_calls_check_while_spinning():
    check = Checks()
    liveness.spin_until(lambda: False, check, 0.1)
    assert check.calls >= 1


def test_spin_until_propagates_the_check_exception():
    with pytest.raises(RuntimeError, match="peer died"):
        liveness.spin_until(lambda: False, Checks(fail_after=0), 5.0)


def test_wait_until_returns_when_another_thread_sets_the_flag():
    box = {"go": False}
    timer = threading.Timer(0.1, lambda: box.update(go=True))
    timer.start()
    check = Checks()
    liveness.wait_until(lambda: box["go"], check, spin_s=0.0)
    timer.join()
    assert box["go"]
    assert check.calls >= 1          # it kept checking while it slept


def test_wait_until_is_bounded_by_check():
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match="peer died"):
        liveness.wait_until(lambda: False, Checks(fail_after=2), spin_s=0.0)
    assert time.perf_counter() - t0 < 5.0


def test_wait_until_returns_at_once_when_true():
    check = Checks()
    liveness.wait_until(lambda: True, check, spin_s=0.01)
    assert check.calls == 0


def test_default_spin_s(monkeypatch):
    monkeypatch.delenv("SYNK_SPIN_S", raising=False)
    assert control.default_spin_s(3, 2) == 0.0     # ranks outnumber cores: never spin
    assert control.default_spin_s(2, 2) > 0.0
    monkeypatch.setenv("SYNK_SPIN_S", "0.25")
    assert control.default_spin_s(2, 2) == 0.25


def test_commands_are_an_int_enum_with_distinct_values():
    # __members__ includes aliases, which iterating the Enum would skip.
    values = [c.value for c in Command.__members__.values()]
    assert len(values) == len(set(values))
    assert Command(int(Command.CALL)) is Command.CALL


def test_handler_registers_under_its_command():
    # Importing the modules fills the table the worker loop dispatches on.
    import synkhronos.data_module  # noqa: F401
    import synkhronos.distribute  # noqa: F401
    import synkhronos.function_module  # noqa: F401
    for cmd in (Command.CALL, Command.DISTRIBUTE, Command.DATA_ALLOC, Command.DATA_FREE,
                Command.GROW_MESSAGE):
        assert callable(control.HANDLERS[cmd])
