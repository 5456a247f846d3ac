"""The TPU launcher's plan carried out for real on this machine: ``python -m tpu.launch`` with a local stand-in for
gcloud, whose ``ssh`` runs the command in a scratch home directory and whose ``scp`` copies files in and out of it.
The worker's steps run as planned: the source archive packed from this checkout, a fresh virtual environment with
JAX and the library installed from it, and the worker's exact training command in an empty directory (on the CPU:
``JAX_PLATFORMS=cpu``, and a one-process ``jax.distributed`` job), then the run log fetched back."""

import json
import os
import socket
import sys

from tpu import launch
from train.records import runlog

LOCAL_GCLOUD = """#!{python}
import os, shutil, subprocess, sys
args = sys.argv[1:]  # compute tpus tpu-vm ssh|scp ...
home = os.environ["LOCAL_TPU_HOME"]
env = {{k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}}
if args[3] == "ssh":
    command = args[args.index("--command") + 1]
    sys.exit(subprocess.run(["bash", "-c", command], cwd=home, env={{**env, "HOME": home}}).returncode)
source, target = args[4], args[5]
if ":" in target:
    shutil.copy(source, os.path.join(home, target.split(":", 1)[1]))
else:
    shutil.copy(os.path.join(home, source.split(":", 1)[1]), target)
"""


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_the_planned_worker_steps_install_the_checkout_and_train(tmp_path, monkeypatch, capsys):
    bin_dir, home = tmp_path / "bin", tmp_path / "worker-home"
    bin_dir.mkdir()
    home.mkdir()
    gcloud = bin_dir / "gcloud"
    gcloud.write_text(LOCAL_GCLOUD.format(python=sys.executable))
    gcloud.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("LOCAL_TPU_HOME", str(home))
    cpu_job = [f"JAX_COORDINATOR_ADDRESS=127.0.0.1:{free_port()}", "JAX_NUM_PROCESSES=1", "JAX_PROCESS_ID=0"]
    argv = ["--tpu", "local", "--zone", "here", "--jax", "jax", "--env", "JAX_PLATFORMS=cpu"]
    for assignment in cpu_job:
        argv += ["--env", assignment]
    command = ["python", "-m", "train.wmt", "--steps", "3", "--log-every", "1", "--bleu-sentences", "0"]
    code = launch.main([*argv, "--logs-to", str(tmp_path / "logs"), "--", *command, "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0, out

    assert (home / "ls_jax_work" / "venv" / "bin" / "python").exists()  # the environment the plan made
    (log,) = (tmp_path / "logs").rglob("run.jsonl")
    records = runlog.read(log)
    run, summary = records[0], records[-1]
    assert run["backend"] == "xla" and run["precision"] == "bf16" and run["device_kind"] == "cpu"
    assert run["command"].endswith("--backend xla --precision bf16 --distributed")  # the TPU defaults
    assert summary["completed"] and summary["steps"] == 3
    (config,) = (home / "ls_jax_work").glob("*/runs/*/config.json")
    assert json.loads(config.read_text())["distributed"] is True
