"""Benchmark suites run by ``python -m train.bench SUITE``; each writes JSON into --out DIR (default docs/results on a GPU, runs/bench elsewhere)."""
