"""The training sequence every task shares.

training        run_training(task): Task and TaskSetup, what a task plugs in; setup, train, summary, exit code
cli             the flags every task shares, their range checks, the exit codes
errors          UsageError and DataError (bad input as one line) and the exit code of each fault
loop            the loop driver: intervals, evaluation, checkpoints, signals, counters
step            the train state, fp16 loss scaling, the gradient-accumulating step
step_compiler   the step compiled ahead of training, per batch shape
parallel        the device mesh and how batches and state are placed on it
peers           the watch over the other processes of a distributed run
precision       compute precision and master weights
optimizer       ls_jax.optim optimizers and learning-rate schedules
signature       what a checkpoint must agree on with the run restoring it
"""
