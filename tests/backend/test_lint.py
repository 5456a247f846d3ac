"""The repository passes ruff's lint and format checks with the settings of pyproject.toml ([tool.ruff])."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("command", [["check", "."], ["format", "--check", "."]], ids=["lint", "format"])
def test_ruff_passes(command):
    result = subprocess.run([sys.executable, "-m", "ruff", *command], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, (
        f"ruff {' '.join(command)}: fix with `ruff check --fix .` and `ruff format .`\n"
        f"{result.stdout[-3000:]}{result.stderr[-1000:]}"
    )
