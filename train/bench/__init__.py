"""``python -m train.bench SUITE``: benchmarks that write JSON into docs/results/.

suites        the command and its suites
ops           the fused ops against their XLA implementations
gemm          the feed-forward GEMMs alone and with their epilogues
attention     ls_jax attention against cuDNN's as JAX calls it
optim         the fused optimizers against optax
e2e           training steps against the plain Flax references
profile       where one training step's GPU time goes, by category
scaling       weak scaling of the data-parallel step
cli_scaling   weak scaling of the training commands themselves
timeline      where each device's time went in a traced run
schedule      where a compiled step's all-reduces sit among its products
counters      hardware counters under Nsight Compute
flops         hand-counted FLOPs and bytes against measured ones
common        the environment record, timing, the copy-bandwidth ceiling, output
steps/        the training steps and workloads the suites time
tracing/      profiler traces and Nsight Compute runs
"""
