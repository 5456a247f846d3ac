"""The bad input an entry point reports as one ``error:`` line and exit code 2, without a traceback."""

from __future__ import annotations


class UsageError(Exception):
    """Bad flags or files from the user: a value out of range, a run directory that cannot be used, ..."""


class DataError(ValueError):
    """The data cannot be used as given (missing or empty files, impossible batch sizes, ...)."""
