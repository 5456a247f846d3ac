"""``python -m train.gpt``: `train.gpt.task.TASK` through the training harness."""

from train.gpt.task import TASK
from train.harness.training import run_training

if __name__ == "__main__":
    raise SystemExit(run_training(TASK))
