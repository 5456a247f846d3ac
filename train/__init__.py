"""Training entry points (``python -m train.wmt``, ``train.imdb``, ``train.bench``, ``train.compare``) and the
harness they share. One concern per module:

  harness          run_training(task): the one training sequence; Task and TaskSetup, what a task plugs in
  cli              shared flags and defaults, range checks, exit codes
  errors           UsageError and DataError, the bad input reported as one line; the exit code of each fault
  rundir           the run directory, its saved configuration, --resume
  loop             the loop driver: intervals, evaluation, checkpoints, signals, counters
  step             the train state, fp16 loss scaling, the gradient-accumulating step
  step_compiler    the step compiled ahead of training, per batch shape
  parallel         the device mesh and how batches are sharded over it
  hardware         the devices, their peak FLOP/s, price and energy meter
  precision        compute precision and master weights
  optimizer        ls_jax.optim optimizers and learning-rate schedules
  runlog           the run log: its schema, its records, run.jsonl and TensorBoard
  metrics          FLOP counts, the device table, energy meters
  checkpoints      orbax checkpoints; tokenizer: sentencepiece; data: what every input pipeline shares
  wmt, wmt_model, wmt_data, wmt_synthetic          the translation task
  imdb, imdb_model, imdb_data, imdb_synthetic      the sentiment classification task
  report/          reading, scoring, tables and plots for train.compare
  benchmarks/      the suites of train.bench
"""
