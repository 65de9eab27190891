"""The README is part of the product: its flag list is `nsaserve serve --help`, verbatim, and its
quick start names the test command CI runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

README = Path(__file__).parent.parent / "README.md"


def test_readme_lists_every_serve_flag_exactly_as_help_prints_it():
    env = dict(os.environ, COLUMNS="100")
    help_text = subprocess.run(
        [sys.executable, "-m", "nsaserve", "serve", "--help"], env=env, capture_output=True, text=True, check=True
    ).stdout.rstrip()
    assert help_text in README.read_text(), "README flags are stale: paste `COLUMNS=100 nsaserve serve --help`"


def test_quick_start_has_the_serve_and_test_commands():
    text = README.read_text()
    assert "nsaserve serve" in text and "bash .ci/run" in text
