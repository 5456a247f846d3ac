"""``python -m train.imdb``: `train.imdb.task.TASK` through the training harness."""

from train.harness import entry

if __name__ == "__main__":
    entry.start()  # before the imports below load JAX

from train.harness.training import run_training  # noqa: E402
from train.imdb.task import TASK  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(run_training(TASK))
