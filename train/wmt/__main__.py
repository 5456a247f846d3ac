"""``python -m train.wmt``: `train.wmt.task.TASK` through the training harness."""

from train.harness.training import run_training
from train.wmt.task import TASK

if __name__ == "__main__":
    raise SystemExit(run_training(TASK))
