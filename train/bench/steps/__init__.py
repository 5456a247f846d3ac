"""The steps and workloads the benchmark suites time: Transformer, BERT and GPT-2 training steps built with ls_jax
and with the plain Flax references, the counters' and scaling suites' workloads, and the hand FLOP count."""
