"""The house rules a reviewer would otherwise check by eye: ruff's lint and format, and files of one job.

The configuration is ``[tool.ruff]`` in pyproject.toml (line length 120). ``make test`` runs this file, so a
change that breaks a rule fails CI rather than waiting for a reviewer.
"""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_FOLDERS = ("lit_parl", "callbacks", "kernels")
MAX_LINES = 300  # past this a file usually holds two jobs (docs/design.md)


def _ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True)


def test_ruff_check_is_clean():
    result = _ruff("check", "--no-cache", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format_leaves_every_file_as_it_is():
    result = _ruff("format", "--check", "--no-cache", ".")
    assert result.returncode == 0, "run `ruff format .`:\n" + result.stdout + result.stderr


@pytest.mark.parametrize("folder", PACKAGE_FOLDERS)
def test_no_package_file_is_past_300_lines(folder):
    long = {
        str(path.relative_to(ROOT)): n
        for path in (ROOT / folder).rglob("*.py")
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"split these by job: {long}"
