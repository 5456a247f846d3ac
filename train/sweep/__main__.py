"""``python -m train.sweep``: runs a grid of training runs from a TOML spec, then compares them
(`train.sweep.runner`)."""

from train.sweep.runner import main

if __name__ == "__main__":
    raise SystemExit(main())
