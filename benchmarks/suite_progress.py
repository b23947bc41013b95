"""A pytest plugin for ``run_suites.py``: reports, as JSON lines on the file descriptor in
``DPGRAD_PROGRESS_FD``, how many tests each suite (``bench_*.py``) collected, each test's
start and outcome, and the exit status. Loaded with ``-p suite_progress``; inert without
that variable."""

from __future__ import annotations

import json
import os
from collections import Counter

import pytest

_stream = None


def _send(**message) -> None:
    if _stream is not None:
        _stream.write(json.dumps(message) + "\n")
        _stream.flush()


def _suite(nodeid: str) -> str:
    return nodeid.split("::", 1)[0].rsplit("/", 1)[-1].removesuffix(".py")


def pytest_configure(config):
    global _stream
    fd = os.environ.get("DPGRAD_PROGRESS_FD")
    if fd and _stream is None:
        _stream = os.fdopen(int(fd), "w", buffering=1, closefd=True)


def pytest_collection_finish(session):
    _send(collected=dict(Counter(_suite(item.nodeid) for item in session.items)))


def pytest_runtest_logstart(nodeid, location):
    _send(start=_suite(nodeid))


@pytest.hookimpl(trylast=True)
def pytest_runtest_logreport(report):
    # A test ends at its call, or at a setup that did not pass (skipped, failed); a failing
    # teardown is reported too.
    if report.when == "call" or (report.when == "setup" and not report.passed) or (
            report.when == "teardown" and report.failed):
        _send(test=_suite(report.nodeid), outcome=report.outcome, when=report.when)


def pytest_sessionfinish(session, exitstatus):
    _send(exit=int(exitstatus))
