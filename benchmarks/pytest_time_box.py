"""A pytest plugin: ``--time-box SECONDS`` fails a test whose call runs longer.

    python -m pytest -p pytest_time_box --time-box 60 ...   # benchmarks/ on PYTHONPATH

``benchmarks/gpu.sh`` loads it for the CUDA tests, so one slow or hung test fails with
its traceback and the rest still run inside the step's time box (pytest-timeout is not
in the GPU image). A SIGALRM raises ``TimeoutError`` in the test; a test blocked inside
one C call (a CUDA kernel) fails when that call returns, so the step's own box (SIGINT,
then SIGKILL) is the last resort. Main thread, POSIX only.
"""

from __future__ import annotations

import signal

import pytest


def pytest_addoption(parser):
    parser.addoption("--time-box", type=float, default=0.0,
                     help="fail a test whose call runs longer than this many seconds "
                          "(0: no limit)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    limit = item.config.getoption("--time-box")
    if limit <= 0:
        yield
        return

    def expired(signum, frame):
        raise TimeoutError(f"{item.nodeid} ran past its time box of {limit:g} s "
                           "(--time-box)")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, limit)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
