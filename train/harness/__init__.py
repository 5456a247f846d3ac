"""The training sequence every task shares.

training        run_training(task): Task and TaskSetup, what a task plugs in; setup, train, summary, exit code
entry           what an entry point does before JAX starts: signals, the train extra's packages
config          the typed configuration (`TrainingConfig`, which each task's extends) and a run's inputs (`Run`)
cli             the flags every task shares and their range checks
compile_cache   XLA's persistent compilation cache, on by default
loop            the loop driver: intervals, evaluation, checkpoints, signals, counters
startup         the start-up's named parts, from the training tools' load
progress        the run's totals and the records and summary lines that report them
host_phases     where the host's time goes in each step
signals         SIGINT and SIGTERM: where a signal stops the run at once and where it waits
resume          --resume: what a checkpoint must agree on with the run restoring it
step            the train state, fp16 loss scaling, the gradient-accumulating step
step_compiler   the step compiled ahead of training, per batch shape
executable_cache  the compiled step kept on disk under a key made before tracing, loaded untraced by a re-run
creation        a new run's state, compiled on a thread while the step compiles
parallel        the device mesh and how batches and state are placed on it
peers           the watch over the other processes of a distributed run
optimizer       the optimizer of a run (`ls_jax.optim.registry`) and learning-rate schedules
"""
