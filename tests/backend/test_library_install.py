"""``pip install`` of the checkout into a fresh virtual environment installs the library alone: ``ls_jax`` imports
from outside the checkout, no package only the tools use comes with it, and a training tool run without the
``train`` extra says so in one line."""

import subprocess
import sys
from pathlib import Path

from train.harness.entry import TOOL_PACKAGES

REPO = Path(__file__).resolve().parents[2]
ONLY_THE_TOOLS_USE = {"sentencepiece", "sacrebleu", "tensorboardx", "tqdm", "matplotlib"}  # orbax comes with flax


def test_the_library_installs_alone_and_a_tool_names_the_extra_it_needs(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    subprocess.run([python, "-m", "pip", "install", "--quiet", str(REPO)], check=True, cwd=tmp_path)
    listed = subprocess.run([python, "-m", "pip", "list"], capture_output=True, text=True, check=True).stdout
    installed = {line.split()[0].lower() for line in listed.splitlines()[2:] if line.strip()}
    assert {"ls-jax", "jax", "flax", "optax"} <= installed and not ONLY_THE_TOOLS_USE & installed
    assert ONLY_THE_TOOLS_USE <= {name.lower() for name in TOOL_PACKAGES}

    where = subprocess.run(
        [python, "-c", "import ls_jax.layers, ls_jax.optim; print(ls_jax.layers.__file__)"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert str(venv) in where  # the installed copy, not the checkout

    tool = subprocess.run([python, "-m", "train.wmt"], cwd=REPO, capture_output=True, text=True)
    assert tool.returncode == 2 and tool.stdout == ""
    assert tool.stderr.startswith("error: the training tools need the packages of ls-jax's train extra (")
    assert tool.stderr.count("\n") == 1 and "pip install -e '.[train]'" in tool.stderr


def test_a_run_without_tensorboard_does_not_need_tensorboardx(monkeypatch):
    import importlib.util

    from train.harness import entry

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "tensorboardX" else real(name))
    assert entry.missing_tool_packages(["--steps", "3"]) == ["tensorboardX"]
    assert entry.missing_tool_packages(["--steps", "3", "--no-tensorboard"]) == []
