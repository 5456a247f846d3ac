"""``python -m train.gpt``: `train.gpt.task.TASK` through the training harness."""

from train.harness.signals import stop_at_start_up

if __name__ == "__main__":
    stop_at_start_up()  # before the imports below load JAX

from train.gpt.task import TASK  # noqa: E402
from train.harness.training import run_training  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(run_training(TASK))
