"""Where a step's time goes: JAX profiler traces by kernel and stage, Nsight Compute runs and their reports."""
