"""``python -m train.compare``: turns run logs into comparison tables and plots (`train.compare.report`)."""

from train.compare.report import main

if __name__ == "__main__":
    raise SystemExit(main())
