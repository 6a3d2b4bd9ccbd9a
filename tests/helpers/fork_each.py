"""pytest plugin (``-p helpers.fork_each``, with tests/ on the path): run every test in its own fork.

JAX cannot fork: a child forked after JAX started its backend hangs on its
first JAX call.  In a JAX-mode run every fork() needs a master in which JAX
never ran, so test_jax_mode.py runs suites that fork per test (such as
test_collectives.py) with this plugin: each test, its fixtures included, runs
in a child of the pytest process, which itself never touches JAX.
"""

import os
import pickle
import traceback

import pytest
from _pytest.reports import TestReport
from _pytest.runner import runtestprotocol


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    hook = item.config.hook
    item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        try:
            # nextitem=None: the child tears down every fixture it set up.
            reports = runtestprotocol(item, log=False, nextitem=None)
            blob = pickle.dumps([hook.pytest_report_to_serializable(config=item.config, report=r)
                                 for r in reports])
        except BaseException:  # noqa: BLE001 - reported as the test's failure
            blob = pickle.dumps(traceback.format_exc())
        with os.fdopen(write_fd, "wb") as f:
            f.write(blob)
        os._exit(0)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as f:
        blob = f.read()
    _, status = os.waitpid(pid, 0)
    got = pickle.loads(blob) if blob else f"the test's process ended with status {status}"
    if isinstance(got, str):
        reports = [TestReport(item.nodeid, item.location, {}, "failed", got, "call")]
    else:
        reports = [hook.pytest_report_from_serializable(config=item.config, data=d) for d in got]
    for report in reports:
        item.ihook.pytest_runtest_logreport(report=report)
    item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    return True
