"""``python -m train.bench SUITE``: benchmarks that write JSON into docs/results/.

suites      the command and its suites: ops, attention, optim, e2e, profile, scaling, counters, flops
common      the environment record, timing, the copy-bandwidth ceiling, output
steps/      the training steps and workloads the suites time
tracing/    profiler traces and Nsight Compute runs
"""
