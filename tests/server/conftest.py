"""Fixtures for end-to-end server tests; the helpers live in server_process.py."""

from __future__ import annotations

import os
import sys

import pytest

# The helpers next to these tests are imported by name.
sys.path.insert(0, os.path.dirname(__file__))

from server_process import ServerProcess  # noqa: E402


@pytest.fixture
def start_server():
    started: list[ServerProcess] = []

    def start(*args: str, ready: bool = True) -> ServerProcess:
        s = ServerProcess(*args)
        started.append(s)
        return s.wait_ready() if ready else s

    yield start
    for s in started:
        if s.proc.poll() is None:
            s.kill_all()
