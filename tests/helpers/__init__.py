"""Code shared by the tests (no tests here): ``helpers.ops`` (test data, VJP checks), ``helpers.kernels`` (ffi vs
xla comparisons for the GPU tests), ``helpers.layers`` (layer and model parameters), ``helpers.optim`` (a small
model and optimizer trajectories), ``helpers.imports`` (the import-direction checker). tests/ is on sys.path
(pyproject's ``pythonpath``), so a test imports them as ``from helpers.ops import normal``."""
