"""Data files read as UTF-8 text: a file that is not (a binary file, text in another encoding) is a `DataError`
naming the file and where its first byte that is not UTF-8 lies, never a UnicodeDecodeError traceback."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

from train.errors import DataError


def not_utf8(path: Path) -> DataError:
    """The error for a file that does not decode as UTF-8: the first offending byte, its line and column."""
    data = Path(path).read_bytes()
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        column = err.start - data.rfind(b"\n", 0, err.start)
        where = f"byte {data[err.start]:#04x} at line {line}, byte {column} of the line"
    else:  # the file changed while it was read
        where = "while it was read"
    return DataError(
        f"{path} is not UTF-8 text ({where}); give a text file, converted to UTF-8 if it is in another "
        "encoding (e.g. iconv -f latin1 -t utf-8 FILE > FILE.utf8)"
    )


def utf8_lines(path: str | Path, newline: str | None = None) -> Iterator[str]:
    """The lines of a UTF-8 text file, read as they are consumed (``newline`` as `open` takes it: "" for csv);
    a byte-order mark in front (what spreadsheet programs write) is dropped.

    Raises:
      DataError: the file is not UTF-8 text.
    """
    with open(path, encoding="utf-8-sig", newline=newline) as file:
        try:
            yield from file
        except UnicodeDecodeError:
            raise not_utf8(Path(path)) from None


def utf8_text(path: str | Path) -> str:
    """The whole text of a UTF-8 file; DataError when it is not UTF-8 text."""
    return "".join(utf8_lines(path))
