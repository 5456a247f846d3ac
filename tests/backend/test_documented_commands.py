"""Every ``python -m`` command the README and docs/ name answers ``--help``: a renamed or moved module breaks here
first, not in a user's terminal."""

import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCUMENTS = [
    REPO / "README.md",
    REPO / "tests" / "README.md",
    REPO / "ffi_kernels" / "NOTES.md",
    *sorted((REPO / "docs").rglob("*.md")),
]
# `python -m MODULE [SUITE]`: the module, and the suite where the module takes one (train.bench SUITE)
COMMAND = re.compile(r"python3? -m ((?:train|tpu|ffi_kernels)(?:\.[a-z_]+)+)(?: ([a-z0-9][a-z0-9-]*))?")
SUITE_COMMANDS = {"train.bench"}
NOT_RUN = {"pytest", "venv", "pip"}


def documented_commands() -> set[tuple[str, ...]]:
    """(module,) or (module, suite) of every ``python -m`` command in the documents."""
    commands = set()
    for document in DOCUMENTS:
        for module, word in COMMAND.findall(document.read_text(encoding="utf-8")):
            commands.add((module, word) if module in SUITE_COMMANDS and word else (module,))
    return commands


def test_the_documents_name_the_commands_users_run():
    commands = documented_commands()
    for expected in [
        ("train.wmt",),
        ("train.imdb",),
        ("train.gpt",),
        ("train.sweep",),
        ("train.compare",),
        ("train.bench", "e2e"),
        ("tpu.launch",),
        ("ffi_kernels.build",),
    ]:
        assert expected in commands
    assert not {command[0] for command in commands} & NOT_RUN


def _help(command: tuple[str, ...]) -> tuple[tuple[str, ...], subprocess.CompletedProcess]:
    process = subprocess.run(
        [sys.executable, "-m", *command, "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    return command, process


def test_every_documented_command_answers_help():
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(_help, sorted(documented_commands())))
    failed = [
        f"python -m {' '.join(command)} --help: exit {process.returncode}: {process.stderr.strip()[-300:]}"
        for command, process in results
        if process.returncode != 0 or "usage:" not in process.stdout
    ]
    assert not failed, "\n".join(failed)
