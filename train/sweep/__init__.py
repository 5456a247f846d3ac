"""``python -m train.sweep SPEC``: a grid of training runs from a TOML spec, resumable, then compared.

runner   the command: start, resume or skip each point, then the report
spec     the spec's schema and the grid's points
specs/   the grids shipped: cpu-default.toml (a newcomer's first sweep), bert-gpu.toml (the study's grid)
"""
