"""What two compiled steps launch, side by side: the kernels (fusions) and custom calls of each optimized HLO module's
entry computation, grouped by kind and by where they come from (the op's name: inside the model, the last part of its
path; outside it, the path after the jit's name):

    XLA_FLAGS="--xla_dump_to=DIR --xla_dump_hlo_as_text --xla_dump_hlo_module_re=jit_train_step" python -m train.wmt ...
    python3 scripts/step_launches.py DIR/module_*.jit_train_step.*_after_optimizations.txt OTHER.txt [--rows 30]

Prints one line per group, the counts of both and the group, the groups the first has most more of first.
"""

import argparse
import collections
import re
from pathlib import Path

ENTRY = re.compile(r"^ENTRY [^\n]*\{\n(.*?)^\}", re.S | re.M)
KIND = re.compile(r"kind=(\w+)")
OP_NAME = re.compile(r'op_name="([^"]*)"')


def launches(hlo_text: str) -> collections.Counter:
    """(kind, origin) -> count over the entry computation's fusions and custom calls."""
    counts: collections.Counter = collections.Counter()
    for line in ENTRY.search(hlo_text).group(1).splitlines():
        if " fusion(" not in line and " custom-call(" not in line:
            continue
        kind = KIND.search(line)
        name = OP_NAME.search(line)
        path = (name.group(1) if name else "?").split("/")
        origin = "model: " + path[-1] if any("Transformer" in part for part in path) else "/".join(path[1:])[:60]
        counts[(kind.group(1) if kind else "custom-call", origin)] += 1
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("first", type=Path)
    parser.add_argument("second", type=Path)
    parser.add_argument("--rows", type=int, default=30)
    args = parser.parse_args()
    first, second = (launches(path.read_text()) for path in (args.first, args.second))
    for group in sorted(set(first) | set(second), key=lambda g: second[g] - first[g])[: args.rows]:
        print(f"{first[group]:5d} {second[group]:5d}  {group[0]:12s} {group[1]}")
    print(f"{sum(first.values()):5d} {sum(second.values()):5d}  launches in all")


if __name__ == "__main__":
    main()
