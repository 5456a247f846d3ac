"""The source archive `tpu.launch` ships to TPU workers: ``python -m tpu.source ARCHIVE``.

It holds what a worker runs, as this checkout has it now: the library (``ls_jax``, ``ffi_kernels``), the tools
(``train``, ``tpu``) and the project files pip installs the library from (``pyproject.toml``, ``README.md``);
not the tests, docs or results. Unpacked, ``pip install DIR`` installs the library with its dependencies and
``PYTHONPATH=DIR python -m train.wmt ...`` runs the tools.
"""

from __future__ import annotations

import argparse
import sys
import tarfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
CONTENTS = ("pyproject.toml", "README.md", "ls_jax", "ffi_kernels", "train", "tpu")
SKIPPED_SUFFIXES = (".pyc", ".so", ".o")


def files(root: Path = REPO_ROOT) -> list[Path]:
    """The files of `CONTENTS` under ``root`` (compiled files and caches left out), relative to ``root``."""
    found = []
    for name in CONTENTS:
        path = root / name
        if not path.exists():
            raise FileNotFoundError(f"no {name} in {root}: run this from an ls-jax checkout")
        candidates = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        found += [
            p.relative_to(root)
            for p in candidates
            if "__pycache__" not in p.parts and not p.name.endswith(SKIPPED_SUFFIXES)
        ]
    return found


def build(archive: Path, root: Path = REPO_ROOT) -> Path:
    """Writes the gzipped tar of `files` to ``archive`` (its folders made) and returns it."""
    archive.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "w:gz") as tar:
        for relative in files(root):
            tar.add(root / relative, arcname=str(relative))
    return archive


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tpu.source", description=__doc__.split("\n\n")[0])
    parser.add_argument("archive", type=Path, help="the .tar.gz to write")
    args = parser.parse_args(argv)
    print(build(args.archive))
    return 0


if __name__ == "__main__":
    sys.exit(main())
