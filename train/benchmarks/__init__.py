"""Benchmark suites run by ``python -m train.bench SUITE``; each writes JSON into docs/results/."""
