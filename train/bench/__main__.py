"""``python -m train.bench``: the benchmark suites (`train.bench.suites`)."""

from train.bench.suites import main

if __name__ == "__main__":
    raise SystemExit(main())
