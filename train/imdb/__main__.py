"""``python -m train.imdb``: `train.imdb.task.TASK` through the training harness."""

from train.harness.training import run_training
from train.imdb.task import TASK

if __name__ == "__main__":
    raise SystemExit(run_training(TASK))
