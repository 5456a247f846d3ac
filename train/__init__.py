"""The training tools: ``python -m train.wmt``, ``train.imdb``, ``train.gpt`` (tasks), ``train.sweep``,
``train.compare`` (studies of many runs) and ``train.bench`` (benchmarks). Imports run one way, top to bottom:

  wmt/ imdb/ gpt/   the tasks: flags, data, model, evaluation; each hands a `Task` to the harness
  tasks             every task by name, for the tools that compare and sweep runs
  harness/          run_training(task): flags every task shares, the loop, the step, parallelism, the optimizer
  records/          what a run leaves on disk: the run directory, its checkpoints and its run log
  costs/            what a run costs: devices, FLOPs, time, energy, price, memory
  data/             what every input pipeline shares: epoch streams, tfds, the sentencepiece vocabulary
  sweep/ compare/   grids of runs and the reports that score them
  bench/            benchmarks
  reference/        the plain Flax models the benchmarks and ``--implementation flax`` train
  errors            how a run ends: the one-line errors and the exit code of each
docs/architecture.md has the whole map.
"""

import importlib
import os

# First, so that a run's start-up clock (`train.harness.startup.LOADED_AT`) starts before the imports it waits for.
importlib.import_module("train.harness.startup")

# XLA's C++ warnings (the GPU autotuner's "Delay kernel timed out", TensorFlow's start-up lines when tfds imports it)
# are read against this level once, when jaxlib loads: set here, before any tool imports JAX, they stay out of a
# user's output. TF_CPP_MIN_LOG_LEVEL=0 in the environment shows them.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
