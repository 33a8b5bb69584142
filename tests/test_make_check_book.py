"""``make check-book`` on a machine without Chromium (issue 31, item 6): the browser checks skip with one line
that says so and how to get them, and the target passes; ``KVCOURSE_REQUIRE_BROWSER=1`` (CI) makes it fail."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _check_book(require: bool) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVCOURSE_REQUIRE_BROWSER", "MAKE"))}
    env["KVCOURSE_CHROMIUM"] = "/nonexistent/chromium"  # as on a machine without the browser
    if require:
        env["KVCOURSE_REQUIRE_BROWSER"] = "1"
    # -o book: do not build the book here (the test of the recipe does not need it)
    return subprocess.run(
        ["make", "-s", "-o", "book", "check-book"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_without_chromium_check_book_passes_and_says_why():
    done = _check_book(require=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "check-book: the browser checks were skipped" in done.stdout
    assert "chromium-driver" in done.stdout


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_without_chromium_check_book_fails_where_the_browser_is_required():
    done = _check_book(require=True)
    assert done.returncode != 0
    assert "browser checks were skipped" not in done.stdout
