"""docs/architecture.md's one direction of imports (ffi_kernels <- ls_jax.ops <- ls_jax.layers <- ls_jax.models <-
train's layers <- tpu <- scripts; only the ops, the optimizer and the backend reach ffi_kernels) and the absence of
import cycles, checked over the source with helpers.imports, and the checker itself on small packages with
forbidden imports and a cycle."""

import textwrap
from pathlib import Path

import pytest
from helpers import imports

REPO = Path(__file__).resolve().parents[2]


def test_the_packages_import_in_one_direction():
    found = imports.violations(REPO)
    assert not found, "imports against docs/architecture.md's layering:\n" + "\n".join(map(str, found))


def test_no_module_imports_itself_through_others():
    """Every import counts, those under TYPE_CHECKING and inside functions too."""
    edges = imports.module_edges(REPO, ["ffi_kernels", "ls_jax", "train", "tpu"])
    assert len(edges) > 120 and sum(map(len, edges.values())) > 300  # the scan saw the tree
    assert imports.cycles(edges) == []


def test_the_cycle_finder_sees_a_cycle_through_a_type_checking_import(tmp_path):
    _write_package(
        tmp_path,
        {
            "train/__init__.py": "",
            "train/a.py": "from train import b\n",
            "train/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from train.c import Thing\n",
            "train/c.py": "def f():\n    from train.a import x\n",
            "train/d.py": "from train import a, b\n",
        },
    )
    assert imports.cycles(imports.module_edges(tmp_path, ["train"])) == [["train.a", "train.b", "train.c"]]


def test_the_checker_sees_every_link_of_the_chain_in_the_source():
    """Not vacuous: each allowed link of the chain is an import the scan finds in the real packages."""
    edges = {(importer, imported) for _, _, importer, imported in imports.import_edges(REPO, ["ls_jax", "train"])}

    def linked(importer_package: str, imported_package: str) -> bool:
        return any(
            importer.startswith(importer_package + ".") and (imported + ".").startswith(imported_package + ".")
            for importer, imported in edges
        )

    assert linked("ls_jax.ops", "ffi_kernels")
    assert linked("ls_jax.layers", "ls_jax.ops")
    assert linked("ls_jax.models", "ls_jax.layers")
    assert linked("train", "ls_jax.models")
    assert linked("train.records", "train.errors")
    assert linked("train.harness", "train.records")
    assert linked("train.wmt", "train.harness")
    assert linked("train.bench", "train.wmt")


@pytest.mark.parametrize(
    "importer, imported",
    [
        ("train.harness.loop", "ffi_kernels"),
        ("train.bench.ops", "ffi_kernels.build"),
        ("tpu.launch", "ffi_kernels"),
        ("scripts.sanitize_kernels", "ffi_kernels"),
        ("train.bench.ops", "scripts.gemm_probe"),
        ("ls_jax.layers.attention", "ffi_kernels"),
        ("ls_jax.models.bert", "ffi_kernels"),
        ("ls_jax.ops.dropout", "ls_jax.layers"),
        ("ls_jax.ops.attention", "ls_jax.models.gpt"),
        ("ls_jax.ops", "train.harness.loop"),
        ("ls_jax.optim.adan", "ls_jax.layers.common"),
        ("ls_jax.layers.common", "ls_jax.models"),
        ("ls_jax.models.transformer", "train.costs.metrics"),
        ("ls_jax", "train"),
        ("ls_jax.backend", "ls_jax.ops"),
        ("ffi_kernels.build", "ls_jax.backend"),
        ("train.records.rundir", "train.harness.loop"),
        ("train.costs.metrics", "train.harness.config"),
        ("train.harness.training", "train.wmt.task"),
        ("train.wmt.model", "train.bench.e2e"),
        ("train.reference.zoo", "train.harness.step"),
    ],
)
def test_forbidden_imports_name_the_rule(importer, imported):
    assert imports.check_import(importer, imported) is not None


@pytest.mark.parametrize(
    "importer, imported",
    [
        ("ls_jax.ops.layer_norm", "ffi_kernels"),
        ("ls_jax.backend", "ffi_kernels"),
        ("ls_jax.optim._kernel", "ffi_kernels"),
        ("ls_jax.ops.attention", "ls_jax.backend"),
        ("ls_jax.layers.attention", "ls_jax.ops.attention"),
        ("ls_jax.models.bert", "ls_jax.layers"),
        ("ls_jax.models.bert", "ls_jax.ops"),
        ("train.wmt", "ls_jax.models"),
        ("train.harness.loop", "ls_jax.optim"),
        ("tpu.launch", "train.wmt"),
        ("train.wmt", "jax.numpy"),
        ("ffi_kernels", "ffi_kernels.build"),
        ("train.harness.loop", "train.records.runlog"),
        ("train.sweep.runner", "train.compare.scoring"),
        ("train.bench.e2e", "train.reference.zoo"),
    ],
)
def test_allowed_imports_pass(importer, imported):
    assert imports.check_import(importer, imported) is None


def _write_package(root: Path, files: dict[str, str]) -> None:
    for name, source in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source))


SYNTHETIC = {
    "ffi_kernels/__init__.py": "",
    "ffi_kernels/build.py": "from ffi_kernels import registry\n",
    "ffi_kernels/registry.py": "import ls_jax\n",
    "ls_jax/__init__.py": "from ls_jax import backend, ops\n",
    "ls_jax/backend.py": """\
        def load():
            import ffi_kernels
            return ffi_kernels
        """,
    "ls_jax/ops/__init__.py": "import ffi_kernels\nfrom ls_jax import backend\n",
    "ls_jax/ops/attention.py": "from ..layers import common\n",
    "ls_jax/ops/typing_only.py": """\
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            from ls_jax.models import gpt
        """,
    "ls_jax/optim/__init__.py": """\
        import importlib
        def suite():
            return importlib.import_module("train.harness.loop")
        """,
    "ls_jax/layers/__init__.py": "",
    "ls_jax/layers/common.py": """\
        from ls_jax import ops

        def kernel():
            import ffi_kernels.build
            return ffi_kernels.build
        """,
    "ls_jax/models/__init__.py": "from . import gpt\n",
    "ls_jax/models/gpt.py": "from ls_jax.layers import common\nfrom ..ops import attention\n",
    "train/__init__.py": "",
    "train/harness/loop.py": "from ls_jax.models import gpt\nfrom ffi_kernels import build\n",
    "train/bench/suites.py": "import importlib\nSUITE = importlib.import_module('train.harness.loop')\n",
    "tpu/launch.py": "import subprocess\nimport ffi_kernels\n",
}


def test_the_checker_reports_each_forbidden_import_of_a_synthetic_package(tmp_path):
    _write_package(tmp_path, SYNTHETIC)
    found = {(str(v.path), v.line, v.imported) for v in imports.violations(tmp_path)}
    assert found == {
        ("ffi_kernels/registry.py", 1, "ls_jax"),  # the kernels know nothing of ls_jax
        ("ls_jax/layers/common.py", 4, "ffi_kernels.build"),  # inside a function
        ("ls_jax/ops/attention.py", 1, "ls_jax.layers"),  # relative
        ("ls_jax/ops/typing_only.py", 3, "ls_jax.models"),  # under TYPE_CHECKING
        ("ls_jax/optim/__init__.py", 3, "train.harness.loop"),  # importlib.import_module
        ("tpu/launch.py", 2, "ffi_kernels"),
        ("train/harness/loop.py", 2, "ffi_kernels"),
    }


def test_a_violation_names_file_line_and_rule(tmp_path):
    _write_package(tmp_path, {"train/__init__.py": "", "train/harness/loop.py": "import os\nimport ffi_kernels\n"})
    (violation,) = imports.violations(tmp_path)
    assert str(violation) == (
        "train/harness/loop.py:2: train.harness.loop imports ffi_kernels: only ls_jax.backend, ls_jax.ops, "
        "ls_jax.optim import ffi_kernels"
    )
